"""Traffic counters: calls, messages and payload bytes per collective kind, per group.

Why: tests, ledgers and a cost model need the traffic exactly, not estimated. Every send
goes through a transport (``transport.py``), which adds one message and its bytes to the
counter list it currently points at; the communicator points it at the counters of the
kind it is running. So the numbers are what THIS rank sent as payload, per
``Communicator`` (= per group of a ``Mesh``), summed over its channels (caller thread,
progress thread, point-to-point).

What is not counted, on purpose:

- MPI's own collectives (``algorithm="mpi"``): what MPI sends inside them cannot be
  observed from outside MPI. Their calls are counted (``calls`` and ``native_calls``);
  their ``messages`` and ``bytes`` stay 0 rather than a guess.
- Control traffic: the consistency check's description exchange and ``allgatherv``'s
  exchange of counts (MPI Allgather calls on small fixed-size records) are not payload.

One-sided traffic (``rma``): what a ``rma.SharedVector`` does on windows this
communicator's ranks expose, counted by the vector itself into the communicator's
``counter("rma")``: a call per ``read``, ``add`` or ``versions``, a message per MPI
one-sided operation it issues (a get, an accumulate, a version's fetch-and-op), and the
bytes each moves (fetched or sent: the elements, 8 per version).

Each list is ``[calls, messages, bytes, native_calls]``.
"""

from .transport import new_count

KINDS = ("allreduce", "reduce_scatter", "reduce", "bcast", "allgather", "allgatherv", "p2p",
         "rma")
FIELDS = ("calls", "messages", "bytes", "native_calls")


def new_table():
    """One counter list per kind (one table per channel)."""
    return {kind: new_count() for kind in KINDS}


def summarize(tables):
    """``{kind: {field: n}}`` summed over channel tables, plus ``"total"``."""
    out = {}
    total = [0, 0, 0, 0]
    for kind in KINDS:
        sums = [0, 0, 0, 0]
        for table in tables:
            for i, v in enumerate(table[kind]):
                sums[i] += v
        out[kind] = dict(zip(FIELDS, sums))
        total = [a + b for a, b in zip(total, sums)]
    out["total"] = dict(zip(FIELDS, total))
    return out


def reset(tables):
    for table in tables:
        for counts in table.values():
            counts[:] = [0, 0, 0, 0]

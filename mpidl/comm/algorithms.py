"""The algorithm registry: one module per algorithm, one signature per collective kind.

Every algorithm is a module that implements some of these functions (the communicator
hands them flat contiguous buffers, p > 1 and a non-empty buffer; it has already checked
the arguments, run the consistency check and started the timeline span):

- ``allreduce(t, src, dst, op, ctx)``: ``dst`` = reduction of ``src`` over all ranks;
  ``src`` may be ``dst`` (in place).
- ``reduce_scatter(t, src, out, op, counts, displs, ctx)``: chunk ``rank`` (``counts``,
  ``displs``, in elements) of the reduction into ``out``; ``src`` is left untouched.
- ``reduce(t, src, dst, root, op, ctx)``: the reduction into ``dst`` at ``root``;
  ``dst`` is None on the other ranks (take work memory from ``t.scratch``).
- ``bcast(t, buf, root, ctx)``: ``buf`` of ``root`` into ``buf`` everywhere.
- ``allgatherv(t, buf, counts, displs, ctx)``: block ``rank`` of ``buf`` is in place;
  fill in the others (``allgather`` is ``allgatherv`` with equal counts).

``t`` is the transport (``transport.py``: send/recv/isend/irecv/sendrecv/wait/waitall,
combine/copy, ``t.rank``, ``t.size``, ``t.scratch``; every send through it is counted);
``op`` an ``ops.Op`` (``op.fn`` the NumPy/CuPy function, ``op.mpi`` the MPI operation);
``ctx`` a ``Context`` (the ring's segment size today; room for more tunables).

Why a registry: the communicator dispatches through this table only, so adding an
algorithm is one module plus one line here (or ``register(name, module)`` at run time,
e.g. from a test), and ``algorithm="auto"``'s tables may name it. A module that lacks a
kind raises a clear error when it is chosen for that kind.
"""

from . import hierarchical, native, recursive_doubling, ring, shared, tree

KINDS = ("allreduce", "reduce_scatter", "reduce", "bcast", "allgatherv")

REGISTRY = {
    "ring": ring,
    "tree": tree,
    "recursive_doubling": recursive_doubling,
    "hierarchical": hierarchical,
    "shared": shared,
    "mpi": native,
}

# The registry kind that serves each public collective.
_KIND_OF = {"allgather": "allgatherv"}


class Context:
    """Per-communicator settings the algorithms read (``comm.segment_bytes`` lives here),
    and the node of every rank (``node_of``: node numbers, consecutive from 0 in the
    order of each node's lowest rank)."""

    __slots__ = ("segment_bytes", "node_of")

    def __init__(self, segment_bytes, node_of=None):
        self.segment_bytes = segment_bytes
        self.node_of = node_of

    def nodes(self, size):
        """The node of each of the ``size`` ranks (all on one node when unknown)."""
        return list(self.node_of) if self.node_of is not None else [0] * size

    def segment(self, itemsize):
        """Elements per ring pipeline segment for items of ``itemsize`` bytes."""
        return max(1, self.segment_bytes // itemsize)


def names():
    """The registered algorithm names, in registration order."""
    return tuple(REGISTRY)


def get(name, kind):
    """The function of algorithm ``name`` for collective ``kind``, or one clear error."""
    module = REGISTRY.get(name)
    if module is None:
        raise ValueError(f"unknown algorithm {name!r} for {kind}: expected one of "
                         f"auto, {', '.join(REGISTRY)} (or register it in "
                         "mpidl.comm.algorithms)")
    fn = getattr(module, _KIND_OF.get(kind, kind), None)
    if fn is None:
        has = [k for k in KINDS if callable(getattr(module, k, None))]
        raise ValueError(f"algorithm {name!r} does not implement {kind} (it has: "
                         f"{', '.join(has) or 'nothing'}): choose another algorithm for "
                         f"{kind}, or add {_KIND_OF.get(kind, kind)}() to "
                         f"{module.__name__}")
    return fn


def register(name, module):
    """Add (or replace) algorithm ``name``; every rank must register it alike."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"algorithm name {name!r}: use a non-empty name other than 'auto'")
    REGISTRY[name] = module
    return module

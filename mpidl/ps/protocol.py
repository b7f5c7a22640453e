"""The parameter server's wire protocol: tags, message kinds, and polite waiting.

A message is a small pickled header followed by zero or more arrays sent as raw bytes
(buffer sends: no pickling of tensors). Headers and their arrays travel with different
tags; MPI keeps messages of one (source, tag) pair in order, so a receiver that reads a
header then reads ``len(header["arrays"])`` arrays from the same source gets the right
ones. ``comm`` is an mpidl ``Communicator`` (the world's group): everything goes through
its point-to-point calls, which run on their own duplicate communicator (so these tags
never meet anyone else's messages) and count every message and byte.

Worker -> server, tag ``TAG_CTRL`` (arrays on ``TAG_UP``):
    push   {clock, version, lr, tensors: [(name, encoding, meta, n_arrays)]} + payloads
    pull   {}                      current parameters, no clock change
    barrier {}                     end of epoch: answered (params + the server's counts)
                                   when every active worker is there, all at once
    done   {pushed}                this worker will push no more
    ack    {}                      abort received and reported (see below)
Server -> worker, tag ``TAG_REPLY`` (arrays on ``TAG_DOWN``):
    params {version, names[, stats]} + one array per parameter of the server's shard
    stats  {stats}                 after every worker is done: the server's final counts
    abort  {message}               the job must end; fin follows
    fin    {}                      every rank has reported the abort; raise now
Server -> server, tag ``TAG_CTRL``: abort {message}, ack, fin (same meanings).

Waiting never busy-spins: ``Poller`` probes without blocking and sleeps between probes
with exponential backoff (20 us doubling to 1 ms), because a blocking MPI wait in MPICH
polls the network at full speed and, on an oversubscribed machine, takes the core from
the workers that would send the awaited message.
"""

import pickle
import time

import numpy as np

TAG_CTRL = 7301
TAG_UP = 7302
TAG_REPLY = 7303
TAG_DOWN = 7304


class PSError(RuntimeError):
    """The parameter-server job cannot go on (a bad push, an abort from a peer)."""


def _host_bytes(a):
    """A contiguous host array and its flat uint8 view (what MPI sends)."""
    from mpidl.backend import to_numpy

    a = np.ascontiguousarray(to_numpy(a))
    return a, a.reshape(-1).view(np.uint8)


def send(comm, dest, tag, data_tag, header, arrays=()):
    """Start sending ``header`` and ``arrays`` to ``dest``; returns the requests.

    The caller keeps the returned requests (they hold the buffers alive) and completes
    them with ``Poller.wait_requests`` or tests them later.
    """
    hosts, views = [], []
    for a in arrays:
        a, view = _host_bytes(a)
        hosts.append(a)
        views.append(view)
    reqs = [comm.isend_obj(described(header, hosts), dest, tag)]
    for view in views:
        reqs.append(comm.isend(view, dest, data_tag))
    return reqs


def described(header, arrays):
    """The header as ``send`` sends it: with each array's (shape, dtype) under
    ``arrays``, so the receiver knows what follows."""
    return dict(header, arrays=[(a.shape, a.dtype.str) for a in arrays])


def message_bytes(header, arrays=()):
    """The payload bytes of each message ``send`` sends for ``header`` and ``arrays``
    (host arrays), as the counters count them: the pickled header, then each array.
    ``mpidl simulate`` counts the parameter server's traffic with it."""
    head = pickle.dumps(described(header, arrays), protocol=pickle.HIGHEST_PROTOCOL)
    return [len(head)] + [int(a.nbytes) for a in arrays]


def push_header(clock, version, lr, tensors, **extra):
    """A worker's push: its ``clock`` (pushes so far), the server ``version`` its
    parameters came from, the step's ``lr``, and per tensor ``(name, encoding, meta,
    number of arrays)``."""
    return {"kind": "push", "clock": clock, "lr": lr, "version": version,
            "tensors": tensors, **extra}


def params_header(version, names, epoch_over=False, **extra):
    """A server's answer: the parameters ``names`` of its shard at ``version``."""
    return {"kind": "params", "version": version, "names": names, "epoch_over": epoch_over,
            **extra}


def receive(comm, source, tag, data_tag, into=None):
    """Receive a header (already probed from ``source``) and the arrays that follow it.

    ``into(header, i, shape, dtype)`` may return a C-contiguous host array of that shape
    and dtype to receive array ``i`` in place (no allocation, no copy), or None.
    """
    header, _, _ = comm.recv_obj(source, tag)
    arrays = []
    for i, (shape, dtype) in enumerate(header.get("arrays", ())):
        dtype = np.dtype(dtype)
        buf = into(header, i, tuple(shape), dtype) if into is not None else None
        if buf is None:
            buf = np.empty(shape, dtype=dtype)
        comm.recv(buf.reshape(-1).view(np.uint8), source, data_tag)
        arrays.append(buf)
    return header, arrays


def fits(a, shape, dtype):
    """True when ``a`` is a C-contiguous NumPy array of exactly that shape and dtype."""
    return (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.shape == shape
            and a.dtype == dtype)


class Poller:
    """Non-blocking probes with sleeping backoff: waiting costs (almost) no CPU.

    ``first``/``longest``: the first and the longest sleep between two probes. A message
    that arrives while we sleep waits at most ``longest`` seconds to be noticed.
    """

    def __init__(self, comm, first=20e-6, longest=1e-3, who=""):
        self.comm = comm
        self.first, self.longest = first, longest
        # longest == 0: block inside MPI instead (MPICH then polls; kept for comparison)
        self.blocking = longest <= 0
        self.who = who
        self.delay = first
        self.idle_s = 0.0  # wall time spent sleeping between probes

    def reset(self):
        self.delay = self.first

    def nap(self):
        t = time.perf_counter()
        time.sleep(self.delay or self.first)
        self.idle_s += time.perf_counter() - t
        self.delay = min(self.delay * 2, self.longest)

    def probe(self, source, tag):
        """The source rank if a message from ``source`` with ``tag`` is waiting, else None."""
        found = self.comm.iprobe(source, tag)
        if found is not None:
            self.reset()
            return found[0]
        return None

    def wait(self, source, tag, what=None, timeout=None, idle=None, peers=None):
        """Sleep-probe until a message matches; returns its source rank (None on timeout).

        ``idle()`` is called between probes (e.g. to retire finished sends). While we
        wait, the stall inspector (``mpidl.comm.stall``) knows we wait for ``what`` from
        ``peers`` (ranks; default ``source``, or everyone for ANY_SOURCE): after the stall
        warning it names those that have not answered, and what the others do.
        """
        if peers is None and source >= 0:
            peers = (source,)
        text = f"for {what or 'a message'}" + (f" ({self.who})" if self.who else "")
        with self.comm.waiting(text, peers):
            if self.blocking and timeout is None:
                return self.comm.probe(source, tag)[0]
            start = time.monotonic()
            while True:
                found = self.probe(source, tag)
                if found is not None:
                    return found
                if idle is not None:
                    idle()
                if timeout is not None and time.monotonic() - start > timeout:
                    return None
                self.nap()

    def wait_requests(self, reqs, timeout=None):
        """Complete ``reqs`` without spinning; returns False on timeout."""
        start = time.monotonic()
        while reqs:
            if all(r.test() for r in reqs):
                return True
            if timeout is not None and time.monotonic() - start > timeout:
                return False
            self.nap()
        return True


def retire(reqs):
    """Drop completed requests from ``reqs`` (in place); returns how many remain."""
    reqs[:] = [r for r in reqs if not r.test()]
    return len(reqs)


def header_size(header):
    """Bytes a header takes pickled (for the bytes-sent statistics)."""
    return len(pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL))

"""Point-to-point messages on a ``Communicator``: tagged arrays and pickled objects.

Why here and not raw mpi4py: arrays go through the same transports as the collectives
(NumPy straight to MPI, CuPy to a CUDA-aware MPI or staged through pinned host memory),
every call shows in the timeline, and every send is counted (``counters.py``), so a
pipeline schedule or a parameter server is as observable and as portable as a collective.

All point-to-point traffic runs on its own duplicate of the MPI communicator (made in the
``Communicator`` constructor, which is collective anyway), so a user's tag can never
match a message of a collective, whatever the tag. Sends and receives match by
(source, tag) in issue order, as in MPI. ``isend``/``irecv`` are real ``MPI_Isend`` /
``MPI_Irecv``: no thread is involved, ``wait()`` completes them (for a staged device
receive it also copies the data to the device). Every request must be waited for (or
tested until done) before its buffer is touched. Each request, with its buffer, is kept
until it completes, past ``close()`` and past its caller dropping it: MPI never writes
into (or reads from) memory already given back.

Objects (``send_obj``/``recv_obj``) are pickled and sent as bytes; ``recv_obj`` uses a
matched probe (``MPI_Mprobe``), so concurrent receivers cannot steal each other's
message between the probe and the receive. The counters count the pickled bytes.

One thread at a time should issue point-to-point calls on a given communicator (as with
blocking collectives): the counters and the staging buffers are not locked.
"""

import pickle

import numpy as np
from mpi4py import MPI

from .timeline import TID_CALLER
from .transport import ANY_SOURCE, ANY_TAG, BYTE


def _check_tag(tag, recv=False):
    if recv and tag == ANY_TAG:
        return
    if not isinstance(tag, (int, np.integer)) or tag < 0 or tag > _tag_ub():
        raise ValueError(f"tag {tag!r}: point-to-point tags are integers from 0 to "
                         f"{_tag_ub()}" + (" (or ANY_TAG to receive any)" if recv else ""))


def _tag_text(tag):
    return "any" if tag == ANY_TAG else str(int(tag))


_TAG_UB = []
_ORPHANS = []  # requests in flight when their communicator closed (``_orphan_p2p``)


def _tag_ub():
    if not _TAG_UB:
        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        _TAG_UB.append(int(ub) if ub is not None else 32767)
    return _TAG_UB[0]


class Request:
    """A point-to-point send or receive in flight. ``wait()`` returns the received array
    (a receive) or None (a send); ``test()`` completes it if it is done, without blocking.
    After completion ``source`` and ``tag`` say what a receive matched."""

    __slots__ = ("kind", "_t", "_req", "_result", "_back", "_done", "_keep", "_timeline",
                 "_waiting", "_pending", "source", "tag", "nbytes")

    def __init__(self, kind, t, req, result=None, back=None, keep=None, timeline=None,
                 waiting=None, pending=None):
        self.kind = kind
        self._pending = pending  # the communicator's requests in flight (module doc)
        if pending is not None:
            pending[self] = None
        self._waiting = waiting  # Communicator.waiting(...): what wait() waits for
        self._t, self._req = t, req
        self._result, self._back, self._keep = result, back, keep
        self._done = False
        self._timeline = timeline
        self.source = self.tag = self.nbytes = None

    def _finish(self, status):
        self._done = True
        self._keep = None
        if self._pending is not None:
            self._pending.pop(self, None)
            self._pending = None
        if self.kind.startswith("irecv"):
            self.source, self.tag = status.Get_source(), status.Get_tag()
            self.nbytes = status.Get_count(BYTE)
            if self._back is not None:  # non-contiguous destination
                self._back[...] = self._result.reshape(self._back.shape)
                self._result = self._back

    def wait(self):
        if not self._done:
            tl = self._timeline
            start = tl.clock() if tl is not None else 0.0
            status = MPI.Status()
            with self._waiting:
                self._t.wait(self._req, status)
            self._finish(status)
            if tl is not None:
                tl.record("wait", self.kind, "", 0, start, tl.clock(), TID_CALLER)
        return self._result

    def test(self):
        if self._done:
            return True
        status = MPI.Status()
        if self._t.test(self._req, status):
            self._finish(status)
            return True
        return False

    @property
    def done(self):
        return self._done

    def __repr__(self):
        return f"<Request {self.kind} {'done' if self._done else 'pending'}>"


class _Plain:
    """Waits on a plain MPI request (object messages never go through a transport)."""

    @staticmethod
    def wait(req, status=None):
        req.Wait(status)

    @staticmethod
    def test(req, status=None):
        return req.Test(status)


def _contiguous(x, xp):
    """A flat contiguous view of ``x`` (or a copy, when ``x`` is not contiguous)."""
    return (x if x.flags.c_contiguous else xp.ascontiguousarray(x)).reshape(-1)


def _landing(out, xp):
    """(flat buffer to receive into, array to copy it to afterwards or None)."""
    if out.flags.c_contiguous:
        return out.reshape(-1), None
    return xp.empty(out.size, dtype=out.dtype), out


class PointToPoint:
    """The point-to-point half of ``Communicator`` (a mixin: it uses the communicator's
    ``_p2p`` channel, ``_timeline``, ``_module`` and ``_closed``)."""

    def _p2p_begin(self, x):
        if self._closed:
            raise RuntimeError("communicator is closed")
        xp, gpu = self._module(x)
        ch = self._p2p
        ch.stats["p2p"][0] += 1
        t = ch.transport(gpu)
        t.count = ch.stats["p2p"]
        return t, xp

    def _p2p_peer(self, rank, what, any_ok=False):
        if any_ok and rank == ANY_SOURCE:
            return
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise ValueError(f"{what} {rank!r} is not a rank of this communicator "
                             f"(size {self.size})" + (" or ANY_SOURCE" if any_ok else ""))

    def _p2p_waiting(self, what, peer, tag):
        """The stall inspector's mark for a point-to-point wait (stall.py). Its text is
        made only if a stall report needs it: p2p calls are too cheap to format one each."""
        if peer == ANY_SOURCE:
            return self.waiting(lambda: f"in {what} from any rank, tag {_tag_text(tag)}")

        def text():
            direction = "to" if what.startswith(("send", "isend")) else "from"
            return f"in {what} {direction} rank {self.world_ranks[peer]}, tag {_tag_text(tag)}"

        return self.waiting(text, (peer,))

    def _orphan_p2p(self):
        """At ``close``: the requests still in flight outlive their communicator, as MPI
        has them (its free lets pending operations complete normally): they are kept,
        with their buffers, until they complete, so MPI never touches memory already
        given back, even for a request its caller dropped."""
        pending = self._p2p.pending
        for req in list(pending):
            req.test()
        _ORPHANS.extend(pending)
        pending.clear()
        _ORPHANS[:] = [req for req in _ORPHANS if not req.test()]

    def _p2p_record(self, kind, start, nbytes, **extra):
        tl = self._timeline
        if tl is not None:
            tl.record(kind, None, "", nbytes, start, tl.clock(), TID_CALLER,
                      **self._label_extra(), **extra)

    def _clock(self):
        tl = self._timeline
        return tl.clock() if tl is not None else 0.0

    # -- arrays -----------------------------------------------------------------------
    def send(self, x, dest, tag=0):
        """Send array ``x`` (any shape; its flat C-order elements) to rank ``dest``."""
        self._p2p_peer(dest, "send: dest")
        _check_tag(tag)
        t, xp = self._p2p_begin(x)
        start = self._clock()
        buf = _contiguous(x, xp)
        t.ready()
        with self._p2p_waiting("send", dest, tag):
            t.send(buf, dest, tag)
        self._p2p_record("send", start, x.nbytes, peer=int(dest), tag=int(tag))

    def recv(self, out, source, tag=0, status=None):
        """Receive into array ``out`` (returned) from ``source`` (or ANY_SOURCE) with
        ``tag`` (or ANY_TAG). Pass an ``MPI.Status`` as ``status`` to learn the
        sender, tag and size of what arrived."""
        self._p2p_peer(source, "recv: source", any_ok=True)
        _check_tag(tag, recv=True)
        t, xp = self._p2p_begin(out)
        start = self._clock()
        if status is None:
            status = MPI.Status()
        buf, back = _landing(out, xp)
        with self._p2p_waiting("recv", source, tag):
            t.recv(buf, source, tag, status)
        if back is not None:
            back[...] = buf.reshape(back.shape)
        self._p2p_record("recv", start, status.Get_count(BYTE),
                         peer=status.Get_source(), tag=status.Get_tag())
        return out

    def isend(self, x, dest, tag=0):
        """Start sending ``x`` (MPI_Isend); returns a ``Request``. ``x`` must not change
        until ``wait()``."""
        self._p2p_peer(dest, "isend: dest")
        _check_tag(tag)
        t, xp = self._p2p_begin(x)
        start = self._clock()
        buf = _contiguous(x, xp)
        t.ready()
        req = t.isend(buf, dest, tag)
        self._p2p_record("isend", start, x.nbytes, peer=int(dest), tag=int(tag))
        return Request("isend", t, req, keep=buf, timeline=self._timeline,
                       waiting=self._p2p_waiting("isend", dest, tag),
                       pending=self._p2p.pending)

    def irecv(self, out, source, tag=0):
        """Start receiving into ``out`` (MPI_Irecv); ``wait()`` returns ``out``."""
        self._p2p_peer(source, "irecv: source", any_ok=True)
        _check_tag(tag, recv=True)
        t, xp = self._p2p_begin(out)
        start = self._clock()
        buf, back = _landing(out, xp)
        req = t.irecv(buf, source, tag)
        self._p2p_record("irecv", start, 0, peer=int(source), tag=int(tag))
        return Request("irecv", t, req, result=out if back is None else buf, back=back,
                       timeline=self._timeline,
                       waiting=self._p2p_waiting("irecv", source, tag),
                       pending=self._p2p.pending)

    def sendrecv(self, x, dest, out, source, sendtag=0, recvtag=None, status=None):
        """Send ``x`` to ``dest`` and receive into ``out`` from ``source`` at once
        (deadlock-free in a ring); ``recvtag`` defaults to ``sendtag``. Returns ``out``."""
        self._p2p_peer(dest, "sendrecv: dest")
        self._p2p_peer(source, "sendrecv: source", any_ok=True)
        recvtag = sendtag if recvtag is None else recvtag
        _check_tag(sendtag)
        _check_tag(recvtag, recv=True)
        xp_out, gpu_out = self._module(out)
        t, xp = self._p2p_begin(x)
        if t is not self._p2p.transport(gpu_out):
            raise TypeError(f"sendrecv: x is a {type(x).__name__} but out is a "
                            f"{type(out).__name__}: pass arrays of the same kind")
        start = self._clock()
        sbuf = _contiguous(x, xp)
        rbuf, back = _landing(out, xp)
        if status is None:
            status = MPI.Status()
        t.ready()
        with self._p2p_waiting("sendrecv", source, recvtag):
            t.sendrecv(sbuf, dest, rbuf, source, sendtag, recvtag, status)
        if back is not None:
            back[...] = rbuf.reshape(back.shape)
        self._p2p_record("sendrecv", start, x.nbytes, peer=int(dest),
                         source=status.Get_source(), tag=int(sendtag))
        return out

    # -- objects ----------------------------------------------------------------------
    def _obj_begin(self, nbytes):
        if self._closed:
            raise RuntimeError("communicator is closed")
        c = self._p2p.stats["p2p"]
        c[0] += 1
        if nbytes is not None:
            c[1] += 1
            c[2] += nbytes

    def send_obj(self, obj, dest, tag=0):
        """Send a picklable object (small headers, not bulk data) to ``dest``."""
        self._p2p_peer(dest, "send_obj: dest")
        _check_tag(tag)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._obj_begin(len(data))
        start = self._clock()
        with self._p2p_waiting("send_obj", dest, tag):
            self._p2p.comm.Send([data, BYTE], dest, tag)
        self._p2p_record("send_obj", start, len(data), peer=int(dest), tag=int(tag))

    def isend_obj(self, obj, dest, tag=0):
        """Start sending a picklable object; returns a ``Request`` (``wait()`` -> None)."""
        self._p2p_peer(dest, "isend_obj: dest")
        _check_tag(tag)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._obj_begin(len(data))
        start = self._clock()
        req = self._p2p.comm.Isend([data, BYTE], dest, tag)
        self._p2p_record("isend_obj", start, len(data), peer=int(dest), tag=int(tag))
        return Request("isend_obj", _Plain, req, keep=data, timeline=self._timeline,
                       waiting=self._p2p_waiting("isend_obj", dest, tag),
                       pending=self._p2p.pending)

    def recv_obj(self, source=ANY_SOURCE, tag=ANY_TAG):
        """Receive one object: returns ``(obj, source, tag)``."""
        self._p2p_peer(source, "recv_obj: source", any_ok=True)
        _check_tag(tag, recv=True)
        self._obj_begin(None)
        start = self._clock()
        status = MPI.Status()
        with self._p2p_waiting("recv_obj", source, tag):
            msg = self._p2p.comm.Mprobe(source, tag, status)
        data = bytearray(status.Get_count(BYTE))
        msg.Recv([data, BYTE])
        src, got_tag = status.Get_source(), status.Get_tag()
        self._p2p_record("recv_obj", start, len(data), peer=src, tag=got_tag)
        return pickle.loads(data), src, got_tag

    def iprobe(self, source=ANY_SOURCE, tag=ANY_TAG):
        """``(source, tag, nbytes)`` of a message (array or object) waiting to be
        received, or None. Neither counted nor in the timeline (it moves nothing)."""
        status = MPI.Status()
        if not self._p2p.comm.Iprobe(source, tag, status):
            return None
        return status.Get_source(), status.Get_tag(), status.Get_count(BYTE)

    def probe(self, source=ANY_SOURCE, tag=ANY_TAG):
        """Like ``iprobe`` but blocks until a message is there."""
        status = MPI.Status()
        with self._p2p_waiting("probe", source, tag):
            self._p2p.comm.Probe(source, tag, status)
        return status.Get_source(), status.Get_tag(), status.Get_count(BYTE)

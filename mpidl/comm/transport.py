"""How array memory meets MPI: host arrays, device arrays MPI can read, staged device arrays.

The algorithms (ring, tree, recursive doubling) are written once against the small
interface below; a transport decides what a send or a receive does with the memory:

- ``HostTransport``: NumPy arrays straight to MPI. Every buffer travels as
  ``[array, MPI.BYTE]``, so no datatype lookup sits on the hot path.
- ``DeviceTransport``: CuPy arrays straight to a CUDA-aware MPI. MPI knows nothing of
  CUDA streams, so the stream is synchronized before data it reads and after kernels
  that write data MPI will send.
- ``StagedTransport``: CuPy arrays through reusable pinned host buffers (MPI that is not
  CUDA-aware): device -> pinned copy, MPI on the host copy, pinned -> device copy. The
  reductions still run on the device that holds the data; only the bytes on the wire pass
  through the host.

A transport belongs to one channel (one duplicated communicator used by one thread), so
its scratch and staging buffers are never shared between concurrent collectives.

Counting: every send (``send``, ``isend``, the send half of ``sendrecv``) adds one message
and its payload bytes to ``transport.count``, a list ``[calls, messages, bytes,
native_calls]`` that the communicator points at the counters of the collective kind it is
running (or of point-to-point). A transport is used by one thread at a time, so no lock is
needed. Receives are not counted: every byte is counted once, by the rank that sends it.

Tags: collectives use ``TAG`` on their own duplicate communicators; point-to-point calls
pass the user's tag (on the point-to-point duplicate, so the two never meet).
"""

import time

from mpi4py import MPI

from .buffers import Scratch, Staging
from .timeline import TID_TO_DEVICE, TID_TO_HOST, TID_WIRE

BYTE = MPI.BYTE
# Staged exchanges of at least two of these go in chunks of this size, copies overlapping
# transfers (StagedTransport._pipelined_sendrecv).
PIPELINE_CHUNK = 1 << 20
TAG = 7  # one tag is enough: each channel runs one collective at a time, in order
ANY_SOURCE, ANY_TAG = MPI.ANY_SOURCE, MPI.ANY_TAG


def new_count():
    """A fresh counter: [calls, messages, bytes, native_calls]."""
    return [0, 0, 0, 0]


class HostTransport:
    """NumPy arrays, handed to MPI directly."""

    device = False
    staged = False

    def __init__(self, comm, xp):
        self.comm = comm
        self.xp = xp
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        self.scratch = Scratch(xp)
        self.count = new_count()
        self.node_memory = None  # the "shared" algorithm's slots (shared.NodeMemory)

    # -- point to point -------------------------------------------------------------------
    def sendrecv(self, sbuf, dest, rbuf, source, stag=TAG, rtag=TAG, status=None):
        c = self.count
        c[1] += 1
        c[2] += sbuf.nbytes
        self.comm.Sendrecv([sbuf, BYTE], dest, stag, [rbuf, BYTE], source, rtag, status)

    def send(self, buf, dest, tag=TAG):
        c = self.count
        c[1] += 1
        c[2] += buf.nbytes
        self.comm.Send([buf, BYTE], dest, tag)

    def recv(self, buf, source, tag=TAG, status=None):
        self.comm.Recv([buf, BYTE], source, tag, status)

    def isend(self, buf, dest, tag=TAG):
        c = self.count
        c[1] += 1
        c[2] += buf.nbytes
        return self.comm.Isend([buf, BYTE], dest, tag)

    def irecv(self, buf, source, tag=TAG):
        return self.comm.Irecv([buf, BYTE], source, tag)

    @staticmethod
    def test(req, status=None):
        """True once ``req`` (from isend/irecv) is complete."""
        return req.Test(status)

    @staticmethod
    def wait(req, status=None):
        req.Wait(status)

    @staticmethod
    def waitall(reqs):
        MPI.Request.Waitall(reqs)

    # -- local work -----------------------------------------------------------------------
    @staticmethod
    def combine(fn, a, b, out):
        """``out = fn(a, b)`` element-wise (the reduction step)."""
        fn(a, b, out=out)

    @staticmethod
    def copy(dst, src):
        dst[...] = src

    def ready(self):
        """Called before MPI reads memory that local kernels may still be writing."""

    def free(self):
        self.scratch.free()

    def close(self):
        """Free everything, the memory shared with the other ranks too (collective)."""
        self.free()
        if self.node_memory is not None:
            self.node_memory.close()
            self.node_memory = None


class PoliteHostTransport(HostTransport):
    """Host transport whose waits poll and sleep instead of spinning inside MPI.

    MPICH busy-polls in blocking calls. On a progress thread that shares its core with
    the caller's computation (data-parallel training on few cores), that spinning steals
    the core; this transport waits with ``Test`` and a sleep that backs off from a few
    microseconds to ``max_sleep`` seconds. Chosen with ``MPIDL_PROGRESS_WAIT=poll``.
    """

    def __init__(self, comm, xp, max_sleep=2e-4):
        super().__init__(comm, xp)
        self.max_sleep = max_sleep

    def _poll(self, test):
        delay = 2e-6
        while not test():
            time.sleep(delay)
            delay = min(delay * 2, self.max_sleep)

    def wait(self, req, status=None):
        self._poll(req.Test if status is None else (lambda: req.Test(status)))

    def waitall(self, reqs):
        self._poll(lambda: MPI.Request.Testall(reqs))

    def sendrecv(self, sbuf, dest, rbuf, source, stag=TAG, rtag=TAG, status=None):
        if status is not None:  # the progress thread never asks for one
            return super().sendrecv(sbuf, dest, rbuf, source, stag, rtag, status)
        self.waitall([self.comm.Irecv([rbuf, BYTE], source, rtag),
                      self.isend(sbuf, dest, stag)])

    def send(self, buf, dest, tag=TAG):
        self.wait(self.isend(buf, dest, tag))

    def recv(self, buf, source, tag=TAG, status=None):
        if status is not None:
            return super().recv(buf, source, tag, status)
        self.wait(self.comm.Irecv([buf, BYTE], source, tag))


class DeviceTransport(HostTransport):
    """CuPy arrays handed to a CUDA-aware MPI (device pointers on the wire)."""

    device = True

    def __init__(self, comm, xp):
        super().__init__(comm, xp)
        self._stream = xp.cuda.get_current_stream

    def ready(self):
        self._stream().synchronize()

    def combine(self, fn, a, b, out):
        fn(a, b, out=out)
        self._stream().synchronize()  # MPI may send ``out`` next

    def copy(self, dst, src):
        dst[...] = src
        self._stream().synchronize()


class _StagedRequest:
    """An MPI request on host memory; for a receive, the device array the data goes to
    when it completes. Waiting twice is harmless."""

    __slots__ = ("req", "host", "dev", "done")

    def __init__(self, req, host, dev):
        self.req, self.host, self.dev, self.done = req, host, dev, False


class StagedTransport(HostTransport):
    """Device arrays through pinned host buffers (MPI that cannot read device memory).

    ``to_host``/``to_device`` are CuPy copies normally; tests substitute NumPy copies to
    drive this code path on a machine without a GPU (``Communicator(..., _staging="host")``).
    """

    device = True
    staged = True

    def __init__(self, comm, xp, pinned=True):
        super().__init__(comm, xp)
        self.staging = Staging(pinned=pinned)
        self.pipelined = pinned  # CUDA streams: only for CuPy arrays
        self.timeline = None  # the communicator's, to show copies beside transfers
        self._streams = None
        if pinned:
            self._sync = lambda: xp.cuda.get_current_stream().synchronize()
        else:
            self._sync = lambda: None

    def _pipelined_sendrecv(self, sbuf, dest, rbuf, source, stag, rtag):
        """An exchange of a large buffer in chunks, so that copies overlap transfers: the
        device-to-host copies of every chunk are queued on one stream; each chunk goes
        out as soon as its copy is done while later chunks are still copying; each chunk
        received goes back to the device on another stream while later ones are still
        on the wire."""
        xp = self.xp
        if self._streams is None:
            self._streams = (xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True))
        d2h, h2d = self._streams
        n = sbuf.size
        step = max(1, PIPELINE_CHUNK // sbuf.itemsize)
        bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        hs = self.staging.take(n, sbuf.dtype)
        hr = self.staging.take(n, rbuf.dtype)
        tl = self.timeline
        clock = time.perf_counter
        d2h.wait_event(xp.cuda.get_current_stream().record())  # sbuf's producers first
        ref = d2h.record()
        if tl is not None:  # a GPU time of reference on the host clock
            ref.synchronize()
        t_ref = clock()
        copied = []
        for lo, hi in bounds:
            sbuf[lo:hi].get(out=hs[lo:hi], stream=d2h, blocking=False)
            copied.append(d2h.record())
        recvs = [self.comm.Irecv([hr[lo:hi], BYTE], source, rtag) for lo, hi in bounds]
        sends, sent_at = [], []
        for (lo, hi), done in zip(bounds, copied):
            done.synchronize()
            sent_at.append(clock())
            sends.append(self.comm.Isend([hs[lo:hi], BYTE], dest, stag))
        back, arrived = [], []
        for (lo, hi), req in zip(bounds, recvs):
            req.Wait()
            arrived.append(clock())
            start = h2d.record()
            rbuf[lo:hi].set(hr[lo:hi], stream=h2d)
            back.append((start, h2d.record()))
        MPI.Request.Waitall(sends)
        h2d.synchronize()  # the pinned regions are reused once released
        c = self.count
        c[1] += len(bounds)
        c[2] += sbuf.nbytes
        self.staging.release()
        self.staging.release()
        if tl is not None:
            self._record_chunks(tl, ref, t_ref, bounds, copied, sent_at, arrived, back,
                                sbuf.itemsize)

    def _record_chunks(self, tl, ref, t_ref, bounds, copied, sent_at, arrived, back, itemsize):
        """Timeline spans of every chunk: its copy to the host, its transfer from send to
        arrival (host clock), its copy back to the device, each on its own lane. Copy
        times are CUDA event times, placed on the host clock at ``ref``."""
        def at(event):
            return t_ref + self.xp.cuda.get_elapsed_time(ref, event) / 1e3

        prev = ref
        for k, (lo, hi) in enumerate(bounds):
            nbytes = (hi - lo) * itemsize
            tl.record("staging", f"copy to host {k}", "pipelined", nbytes, at(prev),
                      at(copied[k]), TID_TO_HOST)
            prev = copied[k]
            tl.record("staging", f"transfer {k}", "pipelined", nbytes, sent_at[k], arrived[k],
                      TID_WIRE)
            tl.record("staging", f"copy to device {k}", "pipelined", nbytes, at(back[k][0]),
                      at(back[k][1]), TID_TO_DEVICE)

    def to_host(self, dev, dtype=None):
        host = self.staging.take(dev.size, dev.dtype)
        if hasattr(dev, "get"):
            dev.get(out=host)  # blocking device -> pinned copy
        else:
            host[...] = dev
        return host

    def to_device(self, host, dev):
        if hasattr(dev, "set"):
            dev.set(host)
            self._sync()  # the pinned region is reused as soon as it is released
        else:
            dev[...] = host

    def sendrecv(self, sbuf, dest, rbuf, source, stag=TAG, rtag=TAG, status=None):
        if (self.pipelined and status is None and sbuf.nbytes >= 2 * PIPELINE_CHUNK
                and sbuf.nbytes == rbuf.nbytes and sbuf.dtype == rbuf.dtype):
            return self._pipelined_sendrecv(sbuf, dest, rbuf, source, stag, rtag)
        hs = self.to_host(sbuf)
        hr = self.staging.take(rbuf.size, rbuf.dtype)
        c = self.count
        c[1] += 1
        c[2] += sbuf.nbytes
        self.comm.Sendrecv([hs, BYTE], dest, stag, [hr, BYTE], source, rtag, status)
        self.to_device(hr, rbuf)
        self.staging.release()
        self.staging.release()

    def send(self, buf, dest, tag=TAG):
        hs = self.to_host(buf)
        c = self.count
        c[1] += 1
        c[2] += buf.nbytes
        self.comm.Send([hs, BYTE], dest, tag)
        self.staging.release()

    def recv(self, buf, source, tag=TAG, status=None):
        hr = self.staging.take(buf.size, buf.dtype)
        self.comm.Recv([hr, BYTE], source, tag, status)
        self.to_device(hr, buf)
        self.staging.release()

    def isend(self, buf, dest, tag=TAG):
        hs = self.to_host(buf)
        c = self.count
        c[1] += 1
        c[2] += buf.nbytes
        return _StagedRequest(self.comm.Isend([hs, BYTE], dest, tag), hs, None)

    def irecv(self, buf, source, tag=TAG):
        hr = self.staging.take(buf.size, buf.dtype)
        return _StagedRequest(self.comm.Irecv([hr, BYTE], source, tag), hr, buf)

    def wait(self, r, status=None):
        if r.done:
            return
        r.req.Wait(status)
        self._complete(r)

    def test(self, r, status=None):
        if r.done:
            return True
        if not r.req.Test(status):
            return False
        self._complete(r)
        return True

    def waitall(self, reqs):
        reqs = [r for r in reqs if not r.done]
        MPI.Request.Waitall([r.req for r in reqs])
        for r in reqs:
            self._complete(r)

    def _complete(self, r):
        r.done = True
        if r.dev is not None:
            self.to_device(r.host, r.dev)
        self.staging.release()

    def combine(self, fn, a, b, out):
        fn(a, b, out=out)
        self._sync()

    def copy(self, dst, src):
        dst[...] = src
        self._sync()

    def ready(self):
        self._sync()

    def free(self):
        super().free()
        self.staging.free()

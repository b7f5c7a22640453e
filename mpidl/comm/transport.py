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
"""

import time

from mpi4py import MPI

from .buffers import Scratch, Staging

BYTE = MPI.BYTE
TAG = 7  # one tag is enough: each channel runs one collective at a time, in order


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

    # -- point to point -------------------------------------------------------------------
    def sendrecv(self, sbuf, dest, rbuf, source):
        self.comm.Sendrecv([sbuf, BYTE], dest, TAG, [rbuf, BYTE], source, TAG)

    def send(self, buf, dest):
        self.comm.Send([buf, BYTE], dest, TAG)

    def recv(self, buf, source):
        self.comm.Recv([buf, BYTE], source, TAG)

    def isend(self, buf, dest):
        return self.comm.Isend([buf, BYTE], dest, TAG)

    def irecv(self, buf, source):
        return self.comm.Irecv([buf, BYTE], source, TAG)

    @staticmethod
    def wait(req):
        req.Wait()

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

    def wait(self, req):
        self._poll(req.Test)

    def waitall(self, reqs):
        self._poll(lambda: MPI.Request.Testall(reqs))

    def sendrecv(self, sbuf, dest, rbuf, source):
        self.waitall([self.comm.Irecv([rbuf, BYTE], source, TAG),
                      self.comm.Isend([sbuf, BYTE], dest, TAG)])

    def send(self, buf, dest):
        self.wait(self.comm.Isend([buf, BYTE], dest, TAG))

    def recv(self, buf, source):
        self.wait(self.comm.Irecv([buf, BYTE], source, TAG))


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
        if pinned:
            self._sync = lambda: xp.cuda.get_current_stream().synchronize()
        else:
            self._sync = lambda: None

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

    def sendrecv(self, sbuf, dest, rbuf, source):
        hs = self.to_host(sbuf)
        hr = self.staging.take(rbuf.size, rbuf.dtype)
        self.comm.Sendrecv([hs, BYTE], dest, TAG, [hr, BYTE], source, TAG)
        self.to_device(hr, rbuf)
        self.staging.release()
        self.staging.release()

    def send(self, buf, dest):
        hs = self.to_host(buf)
        self.comm.Send([hs, BYTE], dest, TAG)
        self.staging.release()

    def recv(self, buf, source):
        hr = self.staging.take(buf.size, buf.dtype)
        self.comm.Recv([hr, BYTE], source, TAG)
        self.to_device(hr, buf)
        self.staging.release()

    def isend(self, buf, dest):
        hs = self.to_host(buf)
        return _StagedRequest(self.comm.Isend([hs, BYTE], dest, TAG), hs, None)

    def irecv(self, buf, source):
        hr = self.staging.take(buf.size, buf.dtype)
        return _StagedRequest(self.comm.Irecv([hr, BYTE], source, TAG), hr, buf)

    def wait(self, r):
        if r.done:
            return
        r.req.Wait()
        self._complete(r)

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

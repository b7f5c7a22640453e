"""Compressed gradient exchange over a ``mpidl.comm.Communicator``.

``Exchanger(comm, compressor).exchange(grad, name)`` returns the mean over the ranks of
the (compressed) gradients, in ``grad``'s shape, dtype and backend, the same bits on
every rank:

- summable compressors (none, fp16, random-k): each payload array is all-reduced
  (mean), then decompressed; except float16 payloads of NumPy arrays at p = 2, which
  take the all-gather route below (the same bytes at p = 2) and are added in float32
  after decoding: NumPy adds float16 in software, and an all-reduce of float16 ran 3-4x
  slower than of float32 here;
- the others: the payload arrays are packed into one uint8 frame (``frame.py``: one
  collective per tensor, whatever the dtypes) and all-gathered with ``allgatherv``;
  every rank then decompresses the ranks' frames in rank order into one float32 buffer
  (sparse payloads scatter-add) and divides by the rank count;
- multi-round compressors (PowerSGD) run their own protocol through ``reduce``.

``exchange_all`` starts every tensor's collective (non-blocking) before decoding any, so
the transfers overlap each other and the decoding. That needs a core for the progress
thread: where a rank has none, ``blocking=True`` runs each collective on the caller's
thread when the tensor starts (the same calls and bits), instead of a progress thread
that busy-waits in MPI beside the compression it should overlap.

Bytes are counted per rank, as a ring algorithm moves them (the convention of the
uncompressed data-parallel path, so the figures compare): an all-reduce of B bytes sends
2 (p - 1) / p * B, an all-gather of frames totalling T bytes (p - 1) / p * T.
``bytes_sent`` accumulates that; ``payload_bytes`` this rank's own frames or arrays;
``dense_bytes`` the uncompressed gradients, so dense_bytes / payload_bytes is the
compression ratio. Malformed payloads raise PayloadError naming the tensor and the rank.
"""

import numpy as np

from mpidl.backend import array_module, is_gpu_array
from mpidl.kernels import PayloadError, share_cores

from . import frame
from .base import restore


class _Pending:
    """One tensor between start and finish: all-reduce handles (one per payload array),
    one all-gather handle, or the finished result of a multi-round compressor."""

    __slots__ = ("name", "grad", "ctx", "handles", "gathered", "done")

    def __init__(self, name, grad, ctx=None, handles=(), gathered=False, done=None):
        self.name, self.grad, self.ctx = name, grad, ctx
        self.handles, self.gathered, self.done = list(handles), gathered, done


class Done:
    """A collective that ran to completion when it was started (``blocking``), with the
    ``wait()`` of a queued one's handle."""

    __slots__ = ("result",)

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class Exchanger:
    """Averages gradients over ``comm``'s ranks through ``compressor`` (and ``memory``).

    ``memory``: "default" takes the compressor's (``make_compressor`` sets it: error
    feedback where the algorithm wants it), None for none, or a Memory.
    ``algorithm``: passed to the collectives ("auto", "ring", "mpi", ...).
    ``blocking``: each collective runs on the caller's thread in ``start`` (module doc).
    """

    def __init__(self, comm, compressor, memory="default", algorithm="auto",
                 blocking=False):
        self.comm = comm
        self.blocking = bool(blocking)
        self.compressor = compressor
        self.memory = getattr(compressor, "memory", None) if memory == "default" else memory
        self.algorithm = algorithm
        self.size = comm.size
        compressor.bind(comm.rank, comm.size)
        # ranks sharing a node share its cores (the kernels' threads, see share_cores)
        share_cores(getattr(comm, "local_size", 1))
        self.bytes_sent = 0
        self.payload_bytes = 0
        self.dense_bytes = 0
        self.calls = 0

    # -- byte counting
    def _count_allreduce(self, nbytes):
        p = self.size
        self.bytes_sent += 2 * (p - 1) * nbytes // p

    def _allreduce_mean(self, array, name):
        """For multi-round compressors: a counted, blocking mean all-reduce."""
        self._count_allreduce(array.nbytes)
        self.payload_bytes += array.nbytes
        return self.comm.allreduce(array, op="mean", algorithm=self.algorithm, name=name)

    # -- one tensor in two halves: start (compress + launch), finish (wait + decode)
    def start(self, grad, name):
        self.calls += 1
        self.dense_bytes += grad.nbytes
        c = self.compressor
        if c.multi_round:
            return _Pending(name, grad, done=c.reduce(grad, name, self._allreduce_mean))
        if self.memory is not None:
            payload, ctx = self.memory.compress(c, grad, name)
        else:
            payload, ctx = c.compress(grad, name)
        if c.summable and not self._gather_instead(payload):
            handles = []
            for i, a in enumerate(payload):
                self._count_allreduce(a.nbytes)
                self.payload_bytes += a.nbytes
                handles.append(self._collective("allreduce", a, op="mean", name=f"{name}/{i}"))
            return _Pending(name, grad, ctx, handles)
        buf = frame.pack(payload, like=grad)
        self.payload_bytes += buf.nbytes
        return _Pending(name, grad, ctx, [self._collective("allgatherv", buf, name=name)],
                        gathered=True)

    def _collective(self, kind, x, **kwargs):
        """Start ``kind`` ("allreduce" or "allgatherv") of ``x``: run now on this thread
        (``blocking``: a ``Done``), or queued on the progress thread (its handle)."""
        if self.blocking:
            return Done(getattr(self.comm, kind)(x, algorithm=self.algorithm, **kwargs))
        return getattr(self.comm, "i" + kind)(x, algorithm=self.algorithm, **kwargs)

    def _gather_instead(self, payload):
        """float16 on the CPU at p = 2: all-gather, add in float32 (see the module doc)."""
        return self.size == 2 and any(a.dtype == np.float16 and not is_gpu_array(a)
                                      for a in payload)

    def finish(self, pending):
        if pending.done is not None:
            return pending.done
        c, ctx, name = self.compressor, pending.ctx, pending.name
        if not pending.gathered:
            means = [h.wait() for h in pending.handles]
            return self._typed(c.decompress(means, ctx), pending.grad)
        gathered, counts = pending.handles[0].wait()
        p = self.size
        self.bytes_sent += (p - 1) * int(gathered.nbytes) // p
        xp = array_module(gathered)
        out = xp.zeros(ctx.n, dtype=xp.float32)
        pos = 0
        for rank, count in enumerate(counts):
            what = f"tensor {name!r}: rank {rank}'s payload"
            try:
                parts = frame.unpack(gathered[pos:pos + count], what)
                c.decompress_add(parts, ctx, out)
            except PayloadError as e:
                msg = str(e)
                raise PayloadError(msg if msg.startswith(what) else f"{what}: {msg}") from None
            pos += count
        out /= p
        return self._typed(restore(out, ctx), pending.grad)

    @staticmethod
    def _typed(result, grad):
        if result.shape != grad.shape:
            result = result.reshape(grad.shape)
        return result if result.dtype == grad.dtype else result.astype(grad.dtype)

    def exchange(self, grad, name):
        """The mean over the ranks of ``grad`` (compressed on the way), for tensor ``name``.

        Every rank must call it for the same names in the same order.
        """
        return self.finish(self.start(grad, name))

    def exchange_all(self, named_grads):
        """``exchange`` for several (name, grad) pairs, all collectives started first."""
        pending = [self.start(g, name) for name, g in named_grads]
        return [self.finish(p) for p in pending]

    def adopt_momentum(self, optimizer):
        """Let a momentum-correcting memory (onebit, dgc) apply the momentum in place of
        ``optimizer`` (see ``mpidl.compress.build_compression``, which does it)."""
        return self.memory.adopt_momentum(optimizer) if self.memory is not None else 0.0

    # -- checkpoints
    def state_dict(self):
        """Host copies of the memory's residuals and the compressor's state."""
        return {"memory": self.memory.state_dict() if self.memory is not None else {},
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state):
        if self.memory is not None:
            self.memory.load_state_dict(state.get("memory", {}))
        self.compressor.load_state_dict(state.get("compressor", {}))

    def stats(self):
        """Counters since construction: calls, bytes_sent, payload_bytes, dense_bytes and
        the compression ratio dense / payload."""
        return {"calls": self.calls, "bytes_sent": self.bytes_sent,
                "payload_bytes": self.payload_bytes, "dense_bytes": self.dense_bytes,
                "compression_ratio": self.dense_bytes / max(self.payload_bytes, 1)}


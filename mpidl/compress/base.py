"""The two interfaces of gradient compression: ``Compressor`` and ``Memory``.

A compressor turns a gradient into *payload* arrays (all that travels over MPI) plus a
small local *context* (shape, dtype, a few scalars; never large arrays, so the parameter
server can ship it in a message header), and back. A memory keeps what compression left
out (error feedback's residual, DGC's momentum) and adds it to the next gradient.

The generic flow, as GRACE has it::

    g = memory.compensate(grad, name)
    payload, ctx = compressor.compress(g, name)
    memory.update(g, name, compressor, payload, ctx)

``Memory.compress(compressor, grad, name)`` runs those three steps; a memory and a
compressor that know each other fuse them (``compress_ef``: the residual is updated in
the kernel's own pass instead of decompressing the payload again).
"""

from math import prod
from typing import NamedTuple

import numpy as np

from mpidl.backend import array_module
from mpidl.kernels import PayloadError


class Ctx(NamedTuple):
    """What a receiver needs besides the payload: the gradient's shape and dtype, and a
    few compressor-specific scalars (``info``). The same on every rank for a tensor."""

    shape: tuple
    dtype: str
    info: tuple = ()

    @property
    def n(self):
        return prod(self.shape)


def flat32(tensor):
    """``tensor`` as a flat, contiguous float32 array (a view when it already is one)."""
    xp = array_module(tensor)
    return xp.ascontiguousarray(tensor, dtype=xp.float32).reshape(-1)


def ctx_of(tensor, *info):
    return Ctx(tuple(int(d) for d in tensor.shape), np.dtype(tensor.dtype).str, tuple(info))


def restore(flat, ctx):
    """A flat float32 result back in the gradient's shape and dtype."""
    return flat.reshape(ctx.shape).astype(np.dtype(ctx.dtype), copy=False)


def check_payload(payload, dtypes, what):
    """Raise PayloadError unless ``payload`` holds arrays of exactly these dtypes."""
    if len(payload) != len(dtypes):
        raise PayloadError(f"{what} payload has {len(payload)} arrays, expected "
                           f"{len(dtypes)}")
    for i, (a, dt) in enumerate(zip(payload, dtypes)):
        if not hasattr(a, "dtype") or a.dtype != np.dtype(dt):
            raise PayloadError(f"{what} payload array {i} is {getattr(a, 'dtype', type(a))},"
                               f" expected {np.dtype(dt).name}")


class Compressor:
    """Compress a gradient into payload arrays plus a local context; decompress; aggregate.

    ``summable``: payloads of different ranks may be summed element-wise (allreduce), and
    decompressing the mean of the payloads gives the mean of the gradients (fp16,
    random-k with a shared seed). Others are all-gathered and decompressed rank by rank.
    ``memory``: the Memory this compressor uses by default (``make_compressor`` sets it).
    """

    name = None
    summable = False
    #: True for compressors that run their own protocol of several all-reduces between
    #: the ranks (``reduce(tensor, name, allreduce_mean)``, PowerSGD): they need a group
    #: of peers and cannot push to a parameter server
    multi_round = False
    #: "bucket": the math is element-wise, so a whole fused bucket can be compressed as
    #: one tensor (a comm hook on the buckets); "tensor": per tensor (top-k ratios,
    #: per-tensor scales, PowerSGD's matrices)
    granularity = "tensor"
    memory = None
    rank, size = 0, 1

    def bind(self, rank, size):
        """Tell the compressor its rank (random seeds differ per rank) and the rank count."""
        self.rank, self.size = int(rank), int(size)

    def compress(self, tensor, name):
        """-> (payload: list of arrays, ctx)."""
        raise NotImplementedError

    def decompress(self, payload, ctx):
        """-> tensor of ctx's shape and dtype; PayloadError if the payload is malformed."""
        raise NotImplementedError

    def decompress_add(self, payload, ctx, out):
        """out (flat float32) += the decompressed payload (sparse compressors scatter)."""
        out += flat32(self.decompress(payload, ctx))
        return out

    def aggregate(self, tensors):
        """The mean of decompressed tensors (several ranks' gradients)."""
        total = tensors[0].copy()
        for t in tensors[1:]:
            total += t
        total /= len(tensors)
        return total

    def state_dict(self):
        """Host copies of any state that must survive a checkpoint (step counters, ...)."""
        return {}

    def load_state_dict(self, state):
        pass

    def __repr__(self):
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")
                  and k not in ("memory", "rank", "size")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


class Memory:
    """Keeps what compression left out and gives it back: ``compensate`` before compressing,
    ``update`` after. The base class keeps nothing."""

    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, payload, ctx):
        pass

    def compress(self, compressor, tensor, name):
        """compensate -> compress -> update; subclasses fuse the steps where they can."""
        t = self.compensate(tensor, name)
        payload, ctx = compressor.compress(t, name)
        self.update(t, name, compressor, payload, ctx)
        return payload, ctx

    def adopt_momentum(self, optimizer):
        """Memories that apply momentum before compressing take it over from the
        optimizer (see ``memory.MomentumMemory``); this one leaves it. Returns the
        momentum applied here."""
        return 0.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

"""Random-k: send k entries chosen at random, the same on every rank.

The indices come from a counter-based hash of (seed, tensor name, step), so every rank
draws the same ones without sending them: only the k values travel, and values of the
same indices can be summed, so the payload goes through allreduce (``summable``).
One index is drawn in each of k equal strata, so they are distinct and sorted.

No error feedback by default: at 1 % an entry waits ~100 steps between sends, and the
residual it then dumps at once made the MLP diverge with momentum SGD here (with
momentum correction it trained, poorly); ``memory="residual"`` turns it on.
"""

import zlib

from mpidl.backend import array_module
from mpidl.kernels import PayloadError, randomk_indices

from .base import Compressor, check_payload, ctx_of, flat32, restore
from .sparse import check_ratio, density_count


class RandomKCompressor(Compressor):
    """``ratio``: the fraction of entries sent; ``seed``: must match on every rank."""

    name = "randomk"
    summable = True
    default_memory = "none"

    def __init__(self, ratio=0.01, seed=0):
        self.ratio = check_ratio(ratio, "randomk")
        self.seed = int(seed)
        self._steps = {}

    def _indices(self, n, name, like):
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        seed = (self.seed * 0x9E3779B1 + zlib.crc32(name.encode()) * 0x85EBCA77
                + step) & 0xFFFFFFFFFFFFFFFF
        k = density_count(self.ratio, n)
        return randomk_indices(n, k, seed, like=like), seed

    def compress(self, tensor, name):
        flat = flat32(tensor)
        idx, seed = self._indices(flat.size, name, flat)
        return [flat[idx]], ctx_of(tensor, idx.size, seed)

    def compress_ef(self, tensor, residual, name):
        residual += flat32(tensor)
        idx, seed = self._indices(residual.size, name, residual)
        values = residual[idx]
        residual[idx] = 0
        return [values], ctx_of(tensor, idx.size, seed)

    def _unpack(self, payload, ctx):
        check_payload(payload, ["float32"], "randomk")
        k, seed = ctx.info
        if payload[0].size != k:
            raise PayloadError(f"randomk payload has {payload[0].size} values, expected {k}")
        return randomk_indices(ctx.n, k, seed, like=payload[0]), payload[0]

    def decompress(self, payload, ctx):
        idx, values = self._unpack(payload, ctx)
        xp = array_module(values)
        out = xp.zeros(ctx.n, dtype=xp.float32)
        out[idx] = values
        return restore(out, ctx)

    def decompress_add(self, payload, ctx, out):
        idx, values = self._unpack(payload, ctx)
        out[idx] += values  # distinct indices: no repeated-index hazard
        return out

    def state_dict(self):
        return {"steps": dict(self._steps)}

    def load_state_dict(self, state):
        self._steps = dict(state.get("steps", {}))

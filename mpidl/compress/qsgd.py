"""QSGD (Alistarh et al. 2017): unbiased stochastic quantization to ``levels`` levels.

Per bucket of ``bucket`` entries: the L2 norm, and each entry's |x| / norm rounded at
random to one of levels + 1 steps (up with probability equal to the fraction), so the
decoded gradient equals the true one in expectation. Codes take code_width(levels) bits
(levels 7: 4 bits, about 8x fewer bytes). Payload: ``[norms (float32), codes (uint8)]``.
No error feedback by default (it is unbiased); ``memory="residual"`` adds it.
"""

import zlib

from mpidl.kernels import chunk_norms, dequantize, quantize

from .base import Compressor, check_payload, ctx_of, flat32, restore


def _check_bucket(bucket, who):
    bucket = int(bucket)
    if bucket < 0 or bucket % 8:
        raise ValueError(f"{who}: bucket must be 0 (one per tensor) or a positive multiple of "
                         f"8, got {bucket}")
    return bucket


def dither_seed(seed, rank, name, step):
    """A different dither for every rank, tensor and step (reproducible from ``seed``)."""
    return (int(seed) * 0x9E3779B1 + rank * 0xC2B2AE3D + zlib.crc32(name.encode()) * 0x85EBCA77
            + step) & 0xFFFFFFFFFFFFFFFF


class QSGDCompressor(Compressor):
    name = "qsgd"

    def __init__(self, levels=7, bucket=512, seed=0):
        levels = int(levels)
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd: levels must be in [1, 127] (codes of at most 8 bits), "
                             f"got {levels}")
        self.levels = levels
        self.bucket = _check_bucket(bucket, "qsgd")
        self.seed = int(seed)
        self._steps = {}
        self._norm = "l2"

    def _seed(self, name):
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return dither_seed(self.seed, self.rank, name, step)

    def _prepare(self, flat):
        """A hook for what happens before quantizing (TernGrad clips)."""
        return flat

    def compress(self, tensor, name):
        flat = self._prepare(flat32(tensor))
        scales = chunk_norms(flat, self.bucket, self._norm)
        codes = quantize(flat, scales, self.levels, self._seed(name), self.bucket)
        return [scales, codes], ctx_of(tensor)

    def _decode(self, payload, ctx):
        check_payload(payload, ["float32", "uint8"], self.name)
        return dequantize(payload[1], payload[0], self.levels, ctx.n, self.bucket)

    def decompress(self, payload, ctx):
        return restore(self._decode(payload, ctx), ctx)

    def decompress_add(self, payload, ctx, out):
        out += self._decode(payload, ctx)
        return out

    def state_dict(self):
        return {"steps": dict(self._steps)}

    def load_state_dict(self, state):
        self._steps = dict(state.get("steps", {}))

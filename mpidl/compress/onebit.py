"""1-bit compression with error feedback (Seide et al. 2014).

Each entry is sent as its sign (1 bit); the receiver reads it as the mean of its chunk's
non-negative entries or minus the mean magnitude of its negative ones (``two_scales``,
Seide's reconstruction, which keeps each chunk's sum; or one mean |v| per chunk). The
error goes into the residual and is sent later. About 32x fewer bytes than float32.
Payload: ``[sign bits (uint8), scales (float32)]``.

The default memory is momentum correction (``memory.MomentumMemory``): momentum applied
before compression, error feedback on it, the optimizer without momentum (the strategy
hands it over with ``Exchanger.adopt_momentum``). Plain error feedback with the
optimizer's momentum after the exchange trained the MLP 9 points worse here.
"""

from mpidl.kernels import pack_signs, unpack_signs

from .base import Compressor, check_payload, ctx_of, flat32, restore


class OneBitCompressor(Compressor):
    """``chunk``: entries per scale (a multiple of 8), 0 for one per tensor;
    ``two_scales``: Seide's two reconstruction values per chunk (default) or one;
    ``momentum``: of the momentum correction (None: the optimizer's, handed over)."""

    name = "onebit"
    default_memory = "momentum"

    def __init__(self, chunk=0, two_scales=True, momentum=None):
        chunk = int(chunk)
        if chunk < 0 or chunk % 8:
            raise ValueError(f"onebit: chunk must be 0 (one scale per tensor) or a positive "
                             f"multiple of 8, got {chunk}")
        if momentum is not None and not 0 <= float(momentum) < 1:
            raise ValueError(f"onebit: momentum must be in [0, 1), got {momentum}")
        self.chunk = chunk
        self.two_scales = bool(two_scales)
        self.momentum = None if momentum is None else float(momentum)

    def compress(self, tensor, name):
        bits, scales = pack_signs(flat32(tensor), None, self.chunk, self.two_scales)
        return [bits, scales], ctx_of(tensor)

    def compress_ef(self, tensor, residual, name):
        bits, scales = pack_signs(flat32(tensor), residual, self.chunk, self.two_scales)
        return [bits, scales], ctx_of(tensor)

    def _unpack(self, payload, ctx):
        check_payload(payload, ["uint8", "float32"], "onebit")
        return unpack_signs(payload[0], payload[1], ctx.n, self.chunk, self.two_scales)

    def decompress(self, payload, ctx):
        return restore(self._unpack(payload, ctx), ctx)

    def decompress_add(self, payload, ctx, out):
        out += self._unpack(payload, ctx)
        return out

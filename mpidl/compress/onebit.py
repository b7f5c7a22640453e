"""1-bit compression with error feedback (Seide et al. 2014; EF-signSGD).

Each entry is sent as its sign (1 bit) times the mean magnitude of its chunk; the error
goes into the residual and is sent later. 32x fewer bytes than float32 (plus one float
per chunk). Payload: ``[sign bits (uint8), scales (float32)]``.
"""

from mpidl.kernels import pack_signs, unpack_signs

from .base import Compressor, check_payload, ctx_of, flat32, restore


class OneBitCompressor(Compressor):
    """``chunk``: entries per scale (a multiple of 8), 0 for one scale per tensor."""

    name = "onebit"
    default_memory = "residual"

    def __init__(self, chunk=0):
        chunk = int(chunk)
        if chunk < 0 or chunk % 8:
            raise ValueError(f"onebit: chunk must be 0 (one scale per tensor) or a positive "
                             f"multiple of 8, got {chunk}")
        self.chunk = chunk

    def compress(self, tensor, name):
        bits, scales = pack_signs(flat32(tensor), None, self.chunk)
        return [bits, scales], ctx_of(tensor)

    def compress_ef(self, tensor, residual, name):
        bits, scales = pack_signs(flat32(tensor), residual, self.chunk)
        return [bits, scales], ctx_of(tensor)

    def _unpack(self, payload, ctx):
        check_payload(payload, ["uint8", "float32"], "onebit")
        return unpack_signs(payload[0], payload[1], ctx.n, self.chunk)

    def decompress(self, payload, ctx):
        return restore(self._unpack(payload, ctx), ctx)

    def decompress_add(self, payload, ctx, out):
        out += self._unpack(payload, ctx)
        return out

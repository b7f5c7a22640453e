"""What the sparsifying compressors (top-k, DGC, threshold) share: one self-describing
sparse payload (``mpidl.kernels.encode_sparse``: delta-packed indices + values), decoded
with checks and scattered into a dense buffer."""

from mpidl.backend import array_module
from mpidl.kernels import decode_sparse, encode_sparse, scatter_add

from .base import Compressor, check_payload, ctx_of, flat32, restore


class SparseCompressor(Compressor):
    """Subclasses pick the indices to send (``sparsify``); the rest is here.

    ``compress_ef`` is the fused error-feedback path: the residual accumulates the
    gradient, the selected entries are sent from it and zeroed, the others stay.
    """

    value_kind = "float32"

    def sparsify(self, flat, name):
        """Sorted int64 indices of the entries of ``flat`` (float32) to send."""
        raise NotImplementedError

    def _payload(self, idx, flat, tensor):
        n = flat.size
        blob = encode_sparse(idx, flat[idx], n, self.value_kind)
        return [blob], ctx_of(tensor)

    def compress(self, tensor, name):
        flat = flat32(tensor)
        return self._payload(self.sparsify(flat, name), flat, tensor)

    def compress_ef(self, tensor, residual, name):
        residual += flat32(tensor)
        idx = self.sparsify(residual, name)
        payload = self._payload(idx, residual, tensor)
        residual[idx] = 0
        return payload

    def _decode(self, payload, ctx):
        check_payload(payload, ["uint8"], f"{self.name}")
        idx, values, _ = decode_sparse(payload[0], ctx.n)
        return idx, values

    def decompress(self, payload, ctx):
        idx, values = self._decode(payload, ctx)
        xp = array_module(values)
        out = xp.zeros(ctx.n, dtype=xp.float32)
        out[idx] = values
        return restore(out, ctx)

    def decompress_add(self, payload, ctx, out):
        idx, values = self._decode(payload, ctx)
        return scatter_add(out, idx, values)


def density_count(ratio, n):
    """How many of n entries a density ``ratio`` keeps: at least one of a non-empty tensor."""
    return min(n, max(1, int(round(ratio * n)))) if n else 0


def check_ratio(ratio, name):
    ratio = float(ratio)
    if not 0 < ratio <= 1:
        raise ValueError(f"{name}: ratio is the fraction of entries sent, in (0, 1]; "
                         f"got {ratio}")
    return ratio

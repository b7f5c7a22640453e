"""Strom (2015): send only the entries whose accumulated gradient exceeds a threshold tau,
each as +-tau (its sign, one bit), and keep the rest, and the excess, in the residual.

The payload is one sparse message (indices delta-packed, then tau and the sign bits), so
an entry costs about its index gap's varint plus one bit. A step where nothing passes
still sends a well-formed payload of zero entries.
"""

import math

from mpidl.kernels import encode_sparse, threshold_select

from .base import ctx_of, flat32
from .sparse import SparseCompressor


class ThresholdCompressor(SparseCompressor):
    """``threshold``: tau, in gradient units (Strom used values of order 1e-2..1)."""

    name = "threshold"
    default_memory = "residual"

    def __init__(self, threshold=0.01):
        threshold = float(threshold)
        if not (threshold > 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold: tau must be a positive number, got {threshold}")
        self.threshold = threshold

    def _send(self, tensor, residual):
        flat = flat32(tensor)
        idx, signs = threshold_select(flat, self.threshold, residual)
        blob = encode_sparse(idx, signs, flat.size, "signs", self.threshold)
        return [blob], ctx_of(tensor)

    def compress(self, tensor, name):
        return self._send(tensor, None)

    def compress_ef(self, tensor, residual, name):
        return self._send(tensor, residual)

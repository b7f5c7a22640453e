"""TernGrad (Wen et al. 2017): each entry becomes -s, 0 or +s (2 bits), s = max |g|.

Unbiased like QSGD with one level and the max instead of the L2 norm. The paper's
gradient clipping to ``clip`` standard deviations shrinks s first (less variance; 0
turns it off). One scale per tensor by default (``bucket`` splits it).
"""

import math

from mpidl.backend import array_module
from mpidl.kernels import l2norm

from .qsgd import QSGDCompressor


class TernGradCompressor(QSGDCompressor):
    name = "terngrad"

    def __init__(self, clip=2.5, bucket=0, seed=0):
        super().__init__(levels=1, bucket=bucket, seed=seed)
        clip = float(clip)
        if not clip >= 0:
            raise ValueError(f"terngrad: clip is in standard deviations, >= 0; got {clip}")
        self.clip = clip
        self._norm = "max"

    def _prepare(self, flat):
        if not self.clip or not flat.size:
            return flat
        sigma = float(l2norm(flat)) / math.sqrt(flat.size)  # the RMS: gradients ~ mean 0
        if not (math.isfinite(sigma) and sigma > 0):
            return flat  # zeros, or NaN/Inf that must stay visible
        c = self.clip * sigma
        return array_module(flat).clip(flat, -c, c)

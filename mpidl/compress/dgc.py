"""Deep Gradient Compression (Lin et al. 2018): sampled top-k with momentum correction.

``DGCCompressor`` sends about ``ratio`` of the entries: the threshold is estimated from a
random sample of |v| and one pass selects (``mpidl.kernels.topk_sampled``), never more
than k. During warm-up (``warmup_steps`` calls per tensor) the density falls
geometrically from 25 % to ``ratio``, as in the paper's 25 %, 6.25 %, ... schedule.

Its memory (``memory.DGCMemory``) keeps, per tensor, the momentum u and the accumulated
v (the residual):

    g <- g * min(1, clip / ||g||)        local gradient clipping (if clip is set)
    u <- m u + g ;  v <- v + u           momentum correction
    send top-k of v ;  v[sent] = 0 ;  u[sent] = 0     momentum factor masking

Momentum is applied there, before the exchange, so the optimizer after it must run
without: ``Exchanger.adopt_momentum(optimizer)`` moves the optimizer's momentum into the
memory (``momentum=None``, the default, takes it from there; until then it is 0).
"""

import math
import zlib

from mpidl.kernels import topk_sampled

from .sparse import SparseCompressor, check_ratio, density_count


class DGCCompressor(SparseCompressor):
    """``ratio``: final density; ``momentum``/``clip``: the memory's (None: the optimizer's
    momentum, handed over); ``warmup_steps``: steps per tensor over which the density
    falls from 25 % to ratio."""

    name = "dgc"
    default_memory = "dgc"

    WARMUP_START = 0.25

    def __init__(self, ratio=0.001, momentum=None, clip=None, warmup_steps=0, seed=0):
        self.ratio = check_ratio(ratio, "dgc")
        if momentum is not None:
            momentum = float(momentum)
            if not 0 <= momentum < 1:
                raise ValueError(f"dgc: momentum must be in [0, 1), got {momentum}")
        if clip is not None and not float(clip) > 0:
            raise ValueError(f"dgc: clip must be a positive gradient norm, got {clip}")
        if int(warmup_steps) < 0:
            raise ValueError(f"dgc: warmup_steps must be >= 0, got {warmup_steps}")
        self.momentum = momentum
        self.clip = None if clip is None else float(clip)
        self.warmup_steps = int(warmup_steps)
        self.seed = int(seed)
        self._steps = {}

    def density(self, step):
        """The density at a tensor's step: geometric from 25 % down to ratio over warm-up."""
        start = max(self.ratio, self.WARMUP_START)
        if step >= self.warmup_steps:
            return self.ratio
        return math.exp(math.log(start)
                        + (math.log(self.ratio) - math.log(start)) * step / self.warmup_steps)

    def sparsify(self, flat, name):
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        k = density_count(self.density(step), flat.size)
        seed = (self.seed * 0x9E3779B1 + zlib.crc32(name.encode()) * 0x85EBCA77 + step
                + self.rank * 0xC2B2AE3D) & 0xFFFFFFFFFFFFFFFF
        return topk_sampled(flat, k, seed=seed)

    def state_dict(self):
        return {"steps": dict(self._steps)}

    def load_state_dict(self, state):
        self._steps = dict(state.get("steps", {}))

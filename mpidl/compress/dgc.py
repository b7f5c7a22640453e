"""Deep Gradient Compression (Lin et al. 2018): sampled top-k with momentum correction.

``DGCCompressor`` sends about ``ratio`` of the entries: the threshold is estimated from a
random sample of |v| and one pass selects (``mpidl.kernels.topk_sampled``), never more
than k. During warm-up (``warmup_steps`` calls per tensor) the density falls
geometrically from 1 to ``ratio``, as in the paper's 25 %, 6.25 %, ... schedule.

``DGCMemory`` keeps, per tensor, the momentum u and the accumulated velocity v:

    g <- g * min(1, clip / ||g||)        local gradient clipping (if clip is set)
    u <- m u + g ;  v <- v + u           momentum correction
    send top-k of v ;  v[sent] = 0 ;  u[sent] = 0     momentum factor masking

Momentum is applied here, before the exchange, so the optimizer after it should be plain
SGD (momentum 0); ``momentum=0`` turns DGCMemory into plain error feedback instead.
"""

import math
import zlib

from mpidl.backend import array_module, to_numpy, xp
from mpidl.kernels import l2norm, topk_sampled

from .base import Memory, flat32
from .sparse import SparseCompressor, check_ratio, density_count


class DGCCompressor(SparseCompressor):
    """``ratio``: final density; ``momentum``/``clip``: DGCMemory's (the default memory);
    ``warmup_steps``: steps per tensor over which the density falls from 1 to ratio."""

    name = "dgc"
    default_memory = "dgc"

    def __init__(self, ratio=0.001, momentum=0.9, clip=None, warmup_steps=0, seed=0):
        self.ratio = check_ratio(ratio, "dgc")
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
        """The density at a tensor's step: geometric from 1 down to ratio over warm-up."""
        if step >= self.warmup_steps:
            return self.ratio
        return math.exp(math.log(self.ratio) * (step + 1) / (self.warmup_steps + 1))

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


class DGCMemory(Memory):
    """Momentum correction, momentum factor masking and local clipping (see the module)."""

    def __init__(self, momentum=0.9, clip=None):
        self.momentum = float(momentum)
        self.clip = clip
        self.velocity = {}  # v: accumulated, what top-k selects from
        self.mom = {}       # u: momentum

    def _state(self, name, like):
        v = self.velocity.get(name)
        if v is None:
            mod = array_module(like)
            v = self.velocity[name] = mod.zeros(like.size, mod.float32)
            self.mom[name] = mod.zeros(like.size, mod.float32)
        elif v.size != like.size:
            raise ValueError(f"tensor {name!r} has {like.size} elements, its DGC state "
                             f"{v.size}: the model changed between steps")
        return v, self.mom[name]

    def _accumulate(self, tensor, name):
        g = flat32(tensor)
        if self.clip is not None:
            norm = float(l2norm(g))
            if norm > self.clip:
                g = g * (self.clip / norm)
        v, u = self._state(name, g)
        if self.momentum:
            u *= self.momentum
            u += g
            v += u
        else:
            v += g
        return v, u

    def compensate(self, tensor, name):
        v, _ = self._accumulate(tensor, name)
        return v.reshape(tensor.shape).copy()

    def update(self, tensor, name, compressor, payload, ctx):
        sent = flat32(compressor.decompress(payload, ctx)) != 0
        v, u = self.velocity[name], self.mom[name]
        v[sent] = 0
        u[sent] = 0

    def compress(self, compressor, tensor, name):
        sparsify = getattr(compressor, "sparsify", None)
        if sparsify is None:
            return super().compress(compressor, tensor, name)
        v, u = self._accumulate(tensor, name)
        idx = sparsify(v, name)
        payload = compressor._payload(idx, v, tensor)
        v[idx] = 0
        u[idx] = 0
        return payload

    def state_dict(self):
        return {"velocity": {k: to_numpy(a) for k, a in self.velocity.items()},
                "momentum": {k: to_numpy(a) for k, a in self.mom.items()}}

    def load_state_dict(self, state):
        mod = xp()
        self.velocity = {k: mod.asarray(a, dtype=mod.float32)
                         for k, a in state.get("velocity", {}).items()}
        self.mom = {k: mod.asarray(a, dtype=mod.float32)
                    for k, a in state.get("momentum", {}).items()}

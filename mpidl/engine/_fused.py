"""Fused optimizer updates for CPU arrays, compiled by Numba on first use.

NumPy needs 4-6 passes over memory for a momentum or Adam update; these kernels make one.
Each performs exactly the float operations of the NumPy sequence in ``optim.py``, in the
same order and precision (scalars are passed in the array's dtype; no fastmath, so no
FMA contraction), hence both paths give bitwise the same parameters — the tests check it.
Without Numba, ``available()`` is False and the optimizers use the NumPy sequence.
"""

import math

_KERNELS = {}

#: parameter updates (parameters x steps) a run must make before the fused kernels repay
#: what they cost to load: importing Numba and loading its cached machine code takes about a
#: second per process, and one pass instead of NumPy's 4-6 saves about half a nanosecond
#: per parameter per step (README, "Fused optimizer updates", has the measurements)
PAYBACK_UPDATES = 2e9


def pays_back(parameters, steps):
    """Whether ``steps`` updates of ``parameters`` numbers repay loading the kernels: true
    for a long run of a large model; false for the short runs of tests, sweeps and smoke
    checks, whose start-up the load would dominate."""
    return parameters * steps >= PAYBACK_UPDATES


def _compile():
    import numba  # noqa: PLC0415 - optional, and slow to import: only when first needed

    @numba.njit(cache=True, nogil=True)
    def sgd(p, g, v, lr, mu, wd, use_wd, use_momentum, nesterov):
        for i in range(p.size):
            gi = g[i]
            if use_wd:
                gi = gi + wd * p[i]
            if use_momentum:
                vi = mu * v[i] + gi
                v[i] = vi
                if nesterov:
                    gi = gi + mu * vi
                else:
                    gi = vi
            p[i] = p[i] - lr * gi

    @numba.njit(cache=True, nogil=True)
    def adam(p, g, m, v, step_size, b1, c1, b2, c2, inv_sqrt_bc2, eps, wd, use_wd, decay,
             use_decay):
        for i in range(p.size):
            gi = g[i]
            pi = p[i]
            if use_wd:
                gi = gi + wd * pi
            if use_decay:
                pi = pi * decay
            mi = b1 * m[i] + gi * c1
            m[i] = mi
            vi = b2 * v[i] + (gi * gi) * c2
            v[i] = vi
            denom = math.sqrt(vi) * inv_sqrt_bc2 + eps
            p[i] = pi - (mi / denom) * step_size

    _KERNELS["sgd"], _KERNELS["adam"] = sgd, adam


def available():
    """Whether the fused kernels can be used (Numba importable and compiling).

    The first call compiles (or loads from Numba's on-disk cache) the float32 kernels
    with a tiny warm-up, so a Numba that cannot compile here means a fallback to NumPy
    now rather than an error in the middle of training."""
    if "ok" not in _KERNELS:
        try:
            import numpy as np  # noqa: PLC0415

            _compile()
            a = np.zeros(2, np.float32)
            sgd(a, a.copy(), a.copy(), 0.1, 0.9, 0.0, False)
            adam(a, a.copy(), a.copy(), a.copy(), 0.1, 0.9, 0.999, 1.0, 1e-8, 0.0, 1.0)
            _KERNELS["ok"] = True
        except Exception:  # no Numba, or a Numba that cannot compile here
            _KERNELS["ok"] = False
    return _KERNELS["ok"]


def sgd(p, g, v, lr, mu, wd, nesterov):
    """In place on flat contiguous arrays of one dtype; ``v`` is ignored when mu == 0."""
    t = p.dtype.type
    _KERNELS["sgd"](p, g, v if v is not None else p, t(lr), t(mu), t(wd), wd != 0.0,
                    mu != 0.0, bool(nesterov))


def adam(p, g, m, v, step_size, b1, b2, inv_sqrt_bc2, eps, wd, decay):
    t = p.dtype.type
    _KERNELS["adam"](p, g, m, v, t(step_size), t(b1), t(1.0 - b1), t(b2), t(1.0 - b2),
                     t(inv_sqrt_bc2), t(eps), t(wd), wd != 0.0, t(decay), decay != 1.0)

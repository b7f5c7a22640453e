"""L-BFGS whose decisions are made from dot products alone (Sandblaster's coordinator).

The algorithm is SciPy's L-BFGS-B without bounds (Byrd, Lu, Nocedal and Zhu 1995, as
``scipy.optimize.minimize(method="L-BFGS-B")`` runs it): the same first step
(``1 / ||g||``, later steps 1), the same Moré–Thuente line search (MINPACK-2's dcsrch with
``ftol`` 1e-3, ``gtol`` 0.9, ``xtol`` 0.1, at most ``max_line_search`` evaluations before
the memory is dropped), the same rule for skipping a correction pair (``s'y <= eps
(-g'd) stp``), the same scaling ``theta = y'y / s'y``, the same stopping tests (``max
|g_i| <= pgtol``, relative decrease ``<= factr eps``). Only the direction is computed
another way: SciPy uses the compact representation of ``B``; here the two-loop recursion
runs on the coefficients of ``d`` in the basis ``(s_1..s_k, y_1..y_k, g)`` — vector-free
L-BFGS (Chen, Wang and Zhou, NIPS 2014) — so it needs only the dot products of
those vectors, and the direction is the same up to rounding.

That split is the point: ``Lbfgs`` (the coordinator) holds scalars only — the dot
products the recursion reads, the line search's state — and tells the holders of the
vectors (``shards``) what to do: take a trial step, accept it, build the next direction
from coefficients. ``ShardVectors`` holds the vectors of some parameters and answers with
one dot product *per tensor*; the coordinator adds them in the model's parameter order.
So every reduction's order depends on the model alone: one process holding every tensor
(``LocalShards``) and parameter servers each holding some (``mpidl.ps.lbfgs``) compute
bitwise the same iterates.
"""

import math
import zlib
from dataclasses import dataclass

import numpy as np

EPS = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class LbfgsSettings:
    """What L-BFGS runs with; the defaults are SciPy's L-BFGS-B defaults.

    ``history``: correction pairs kept (SciPy's ``maxcor``); ``iterations``: the most
    iterations (``maxiter``); ``pgtol``: stop when ``max |g_i| <= pgtol`` (``gtol``);
    ``factr``: stop when ``(f_old - f) / max(|f_old|, |f|, 1) <= factr * eps`` (SciPy's
    ``ftol`` is ``factr * eps``); ``max_line_search``: evaluations per line search
    (``maxls``); ``ftol``, ``gtol``, ``xtol``: the line search's (fixed in SciPy).
    """

    history: int = 10
    iterations: int = 15000
    pgtol: float = 1e-5
    factr: float = 1e7
    max_line_search: int = 20
    ftol: float = 1e-3
    gtol: float = 0.9
    xtol: float = 0.1
    stpmax: float = 1e10

    def check(self):
        for name in ("history", "iterations", "max_line_search"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"L-BFGS {name} must be at least 1, got "
                                 f"{getattr(self, name)}")
        for name in ("pgtol", "factr", "ftol", "gtol", "xtol"):
            if not float(getattr(self, name)) >= 0:
                raise ValueError(f"L-BFGS {name} must be >= 0, got {getattr(self, name)}")
        return self


# -- the line search --------------------------------------------------------------------

def _sqrt(v):
    """sqrt, NaN for a negative argument (as C's, which the search was written for)."""
    return math.sqrt(v) if v >= 0 else math.nan


def _cubic(u, fu, du, v, fv, dv, clamp=False):
    """``theta`` and ``|gamma|`` of the cubic through (u, fu, du) and (v, fv, dv), scaled
    by ``s`` against overflow (Moré and Thuente's formulas); ``clamp``: a negative
    discriminant counts as 0 (the cubic does not tend to infinity that way)."""
    theta = 3.0 * (fu - fv) / (v - u) + du + dv
    s = max(abs(theta), abs(du), abs(dv))
    disc = (theta / s) ** 2 - (du / s) * (dv / s)
    return theta, s * _sqrt(max(0.0, disc) if clamp else disc)


def _safeguarded_step(stx, fx, dx, sty, fy, dy, stp, fp, dp, bracketed, lo, hi):
    """One interval update of Moré and Thuente (1994), section 4 (dcstep).

    ``stx``: the best step so far (value ``fx``, slope ``dx``); ``sty``: the interval's
    other end; ``stp``: the step just evaluated (``fp``, ``dp``). Returns the new
    ``(stx, fx, dx, sty, fy, dy, next step, bracketed)``: a cubic or quadratic
    interpolation step, chosen and safeguarded by the four cases of the paper."""
    sgnd = dp * (dx / abs(dx))
    if fp > fx:
        # 1: a higher value; the minimum is bracketed. The cubic step if it is closer to
        # stx than the quadratic step, else their mean.
        theta, gamma = _cubic(stx, fx, dx, stp, fp, dp)
        if stp < stx:
            gamma = -gamma
        p = (gamma - dx) + theta
        q = ((gamma - dx) + gamma) + dp
        cubic = stx + (p / q) * (stp - stx)
        quad = stx + ((dx / ((fx - fp) / (stp - stx) + dx)) / 2.0) * (stp - stx)
        new = cubic if abs(cubic - stx) < abs(quad - stx) else cubic + (quad - cubic) / 2.0
        bracketed = True
    elif sgnd < 0.0:
        # 2: a lower value, slopes of opposite sign; bracketed. The cubic step if it is
        # farther from stp than the secant step, else the secant step.
        theta, gamma = _cubic(stx, fx, dx, stp, fp, dp)
        if stp > stx:
            gamma = -gamma
        p = (gamma - dp) + theta
        q = ((gamma - dp) + gamma) + dx
        cubic = stp + (p / q) * (stx - stp)
        secant = stp + (dp / (dp - dx)) * (stx - stp)
        new = cubic if abs(cubic - stp) > abs(secant - stp) else secant
        bracketed = True
    elif abs(dp) < abs(dx):
        # 3: a lower value, slopes of the same sign, the slope's magnitude decreases. The
        # cubic step only if the cubic tends to infinity in the step's direction or its
        # minimum lies beyond stp; else the secant step.
        theta, gamma = _cubic(stx, fx, dx, stp, fp, dp, clamp=True)
        if stp > stx:
            gamma = -gamma
        r = ((gamma - dp) + theta) / ((gamma + (dx - dp)) + gamma)
        if r < 0.0 and gamma != 0.0:
            cubic = stp + r * (stx - stp)
        else:
            cubic = hi if stp > stx else lo
        secant = stp + (dp / (dp - dx)) * (stx - stp)
        if bracketed:  # the step closer to stp, no farther than 0.66 of the way to sty
            new = cubic if abs(cubic - stp) < abs(secant - stp) else secant
            limit = stp + 0.66 * (sty - stp)
            new = min(limit, new) if stp > stx else max(limit, new)
        else:
            new = cubic if abs(cubic - stp) > abs(secant - stp) else secant
            new = max(lo, min(hi, new))
    elif bracketed:
        # 4: a lower value, slopes of the same sign, the slope does not decrease: the
        # cubic step through sty when bracketed, else an end of the allowed range.
        theta, gamma = _cubic(sty, fy, dy, stp, fp, dp)
        if stp > sty:
            gamma = -gamma
        new = stp + (((gamma - dp) + theta) / (((gamma - dp) + gamma) + dy)) * (sty - stp)
    else:
        new = hi if stp > stx else lo
    if fp > fx:
        sty, fy, dy = stp, fp, dp
    else:
        if sgnd < 0.0:
            sty, fy, dy = stx, fx, dx
        stx, fx, dx = stp, fp, dp
    return stx, fx, dx, sty, fy, dy, new, bracketed


class LineSearch:
    """Moré and Thuente's line search for a step satisfying the strong Wolfe conditions
    ``f(stp) <= f(0) + ftol stp f'(0)`` and ``|f'(stp)| <= gtol |f'(0)|`` (MINPACK-2's
    dcsrch, which L-BFGS-B calls). ``start`` takes the value and slope at step 0 and the
    first step; ``next`` takes the value and slope at the step it last gave and answers
    ``("evaluate", step)``, ``("converged", step)`` or ``("warning", step)`` (no step
    satisfies both conditions within the tolerances: the last one is kept)."""

    XTRAPL, XTRAPU = 1.1, 4.0  # how far an unbracketed step may extrapolate

    def __init__(self, ftol=1e-3, gtol=0.9, xtol=0.1, stpmin=0.0, stpmax=1e10):
        self.ftol, self.gtol, self.xtol = float(ftol), float(gtol), float(xtol)
        self.stpmin, self.stpmax = float(stpmin), float(stpmax)

    def start(self, f, g, stp):
        if g >= 0.0:
            raise ValueError(f"the line search needs a descent direction (slope {g} >= 0)")
        if not self.stpmin <= stp <= self.stpmax:
            raise ValueError(f"first step {stp} outside [{self.stpmin}, {self.stpmax}]")
        self.bracketed = False
        self.stage = 1
        self.finit, self.ginit = f, g
        self.gtest = self.ftol * g
        self.width = self.stpmax - self.stpmin
        self.width1 = self.width / 0.5
        self.stx, self.fx, self.gx = 0.0, f, g
        self.sty, self.fy, self.gy = 0.0, f, g
        self.stmin, self.stmax = 0.0, stp + self.XTRAPU * stp
        self.stp = stp
        return stp

    def next(self, f, g):
        stp, gtest = self.stp, self.gtest
        ftest = self.finit + stp * gtest
        if self.stage == 1 and f <= ftest and g >= 0.0:
            self.stage = 2
        status = None
        if self.bracketed and (stp <= self.stmin or stp >= self.stmax):
            status = "warning"  # rounding errors prevent progress
        if self.bracketed and self.stmax - self.stmin <= self.xtol * self.stmax:
            status = "warning"  # the interval is within xtol
        if stp == self.stpmax and f <= ftest and g <= gtest:
            status = "warning"
        if stp == self.stpmin and (f > ftest or g >= gtest):
            status = "warning"
        if f <= ftest and abs(g) <= self.gtol * (-self.ginit):
            status = "converged"
        if status is not None:
            return status, stp
        lo, hi = self.stmin, self.stmax
        if self.stage == 1 and f <= self.fx and f > ftest:
            # a lower value but not a sufficient decrease: step on the modified function
            # psi(stp) = f(stp) - f(0) - ftol stp f'(0), then shift back
            (stx, fxm, gxm, sty, fym, gym, stp, self.bracketed) = _safeguarded_step(
                self.stx, self.fx - self.stx * gtest, self.gx - gtest,
                self.sty, self.fy - self.sty * gtest, self.gy - gtest,
                stp, f - stp * gtest, g - gtest, self.bracketed, lo, hi)
            self.stx, self.sty = stx, sty
            self.fx, self.fy = fxm + stx * gtest, fym + sty * gtest
            self.gx, self.gy = gxm + gtest, gym + gtest
        else:
            (self.stx, self.fx, self.gx, self.sty, self.fy, self.gy, stp,
             self.bracketed) = _safeguarded_step(
                self.stx, self.fx, self.gx, self.sty, self.fy, self.gy, stp, f, g,
                self.bracketed, lo, hi)
        stx, sty = self.stx, self.sty
        if self.bracketed:
            if abs(sty - stx) >= 0.66 * self.width1:  # too little progress: bisect
                stp = stx + 0.5 * (sty - stx)
            self.width1 = self.width
            self.width = abs(sty - stx)
            self.stmin, self.stmax = min(stx, sty), max(stx, sty)
        else:
            self.stmin = stp + self.XTRAPL * (stp - stx)
            self.stmax = stp + self.XTRAPU * (stp - stx)
        stp = min(max(stp, self.stpmin), self.stpmax)
        if self.bracketed and (stp <= self.stmin or stp >= self.stmax
                               or self.stmax - self.stmin <= self.xtol * self.stmax):
            stp = stx  # no further progress possible: the best step so far
        self.stp = stp
        return "evaluate", stp


# -- the memory: dot products of the basis (s_1..s_k, y_1..y_k, g) ------------------------

class Memory:
    """The dot products the two-loop recursion reads, oldest pair first: ``sy[i][j] =
    s_i.y_j`` (the diagonal is SciPy's ``s'y`` of the pair), ``yy[i][j] = y_i.y_j``,
    ``sg[i] = s_i.g``, ``yg[i] = y_i.g``. ``s_i.s_j`` is never needed."""

    def __init__(self, m):
        self.m = int(m)
        self.clear()

    def clear(self):
        self.sy, self.yy, self.sg, self.yg = [], [], [], []

    @property
    def k(self):
        return len(self.sy)

    def add(self, sy, yy, s_y, y_s, y_y):
        """A new pair (s, y): ``sy = s.y``, ``yy = y.y``, and for the pairs kept (the
        oldest is dropped when ``m`` are held): ``s_y[j] = s.y_j``, ``y_s[j] = y.s_j``,
        ``y_y[j] = y.y_j``."""
        if self.k == self.m:
            self.sy = [row[1:] for row in self.sy[1:]]
            self.yy = [row[1:] for row in self.yy[1:]]
        k = self.k
        if not len(s_y) == len(y_s) == len(y_y) == k:
            raise ValueError(f"a new pair needs {k} dot products with each kept vector")
        for j in range(k):
            self.sy[j].append(float(y_s[j]))
            self.yy[j].append(float(y_y[j]))
        self.sy.append([float(v) for v in s_y] + [float(sy)])
        self.yy.append([float(v) for v in y_y] + [float(yy)])

    def set_gradient(self, sg, yg):
        if not len(sg) == len(yg) == self.k:
            raise ValueError(f"the gradient needs {self.k} dot products with s and with y")
        self.sg, self.yg = [float(v) for v in sg], [float(v) for v in yg]

    def direction(self, theta):
        """Coefficients of ``d = -H g`` in the basis, ``[c_s1..c_sk, c_y1..c_yk, c_g]``:
        the two-loop recursion with ``H_0 = I / theta``, run on coefficient vectors
        (``q = c_g g + sum c_yj y_j``; ``s_i.q`` and ``y_i.r`` from the dot products)."""
        k, sy, yy = self.k, self.sy, self.yy
        cs, cy, cg = [0.0] * k, [0.0] * k, 1.0
        alpha = [0.0] * k
        for i in reversed(range(k)):
            sq = self.sg[i] * cg
            for j in range(k):
                sq += sy[i][j] * cy[j]
            alpha[i] = sq / sy[i][i]
            cy[i] -= alpha[i]
        cg /= theta
        cy = [c / theta for c in cy]
        for i in range(k):
            yr = self.yg[i] * cg
            for j in range(k):
                yr += yy[i][j] * cy[j]
            for j in range(k):
                yr += sy[j][i] * cs[j]
            cs[i] += alpha[i] - yr / sy[i][i]
        return [-c for c in cs] + [-c for c in cy] + [-cg]


# -- the coordinator --------------------------------------------------------------------

def accepted_width(k, updated):
    """Values per tensor in a shard's report after a step is accepted with ``k`` pairs
    then held: crc of x, max |g|, g.g, g.s_j, g.y_j (k each), and for a new pair y.y and
    its ``k - 1`` dot products with the older s, y (s.y_j, y.s_j, y.y_j)."""
    return 3 + 2 * k + ((1 + 3 * (k - 1)) if updated else 0)


class Lbfgs:
    """The coordinator (module doc): call ``evaluated(f)`` after each evaluation of the
    loss and gradient at the point the shards hold; it decides, has the shards move to the
    next point and returns True, or tells them to stop and returns False.

    ``shards`` (``LocalShards``, or ``mpidl.ps.lbfgs.RemoteShards``) carries out
    ``report``, ``trial``, ``accept``, ``restart``, ``direction`` and ``stop`` and answers
    with ``{tensor name: row of values}``; ``names``: the model's parameter order, in
    which every sum over tensors runs. ``on_iteration(record)``: called with each
    iteration's record (iteration 0 is the starting point).
    """

    def __init__(self, settings, shards, names, on_iteration=None):
        self.cfg = settings.check()
        self.shards = shards
        self.names = list(names)
        self.on_iteration = on_iteration
        self.memory = Memory(self.cfg.history)
        self.theta = 1.0
        self.iteration = 0
        self.evaluations = 0
        self.started = False
        self.done = False
        self.stop_reason = None
        self.records = []
        self.restarts = 0  # failed line searches since the last record
        self.f = self.fold = None
        self.stp, self.gmax, self.gg, self.crc = 0.0, math.nan, math.nan, None
        self._ls = None
        self._evals_here = self._evals_iteration = 0

    # -- sums over tensors, in the model's order
    def _column(self, rows, c):
        total = 0.0
        for name in self.names:
            total += float(rows[name][c])
        return total

    def _crc(self, rows):
        crcs = np.array([int(rows[name][0]) for name in self.names], dtype=np.uint32)
        return zlib.crc32(crcs.tobytes())

    def evaluated(self, f):
        """The loss ``f`` at the point just evaluated (the shards took its gradient)."""
        if self.done:
            raise RuntimeError("L-BFGS has stopped; no evaluation was asked for")
        self.evaluations += 1
        rows = self.shards.report()
        f = float(f)
        if not self.started:
            self.started = True
            self.f = f
            self._take(rows, updated=False, sy=0.0)
            self._record(evaluations=1, stp=0.0, updated=False)
            if not math.isfinite(f):
                return self._stop(f"the loss at the starting point is {f}")
            if self.gmax <= self.cfg.pgtol:
                return self._stop("converged: max |g| <= pgtol")
            return self._new_direction()
        gd = self._column(rows, 0)
        self._evals_here += 1
        self._evals_iteration += 1
        status, stp = self._ls.next(f, gd)
        if status == "evaluate":
            if self._evals_here >= self.cfg.max_line_search:
                return self._search_failed(f"the line search took {self._evals_here} "
                                           "evaluations")
            self._trial(stp)
            return True
        return self._accept(f, gd)

    def _trial(self, stp):
        self.stp = stp
        self.shards.trial(stp)

    def _new_direction(self):
        coeffs = self.memory.direction(self.theta) if self.memory.k else [-1.0]
        rows = self.shards.direction(coeffs)
        gd, dtd = self._column(rows, 0), self._column(rows, 1)
        if not gd < 0.0:
            return self._search_failed(f"the direction is not a descent direction "
                                       f"(g.d = {gd})")
        stp = min(1.0 / math.sqrt(dtd), self.cfg.stpmax) if self.iteration == 0 else 1.0
        self.fold, self.gdold = self.f, gd
        self._ls = LineSearch(self.cfg.ftol, self.cfg.gtol, self.cfg.xtol, 0.0,
                              self.cfg.stpmax)
        self._ls.start(self.f, gd, stp)
        self._evals_here = 0
        self._trial(stp)
        return True

    def _search_failed(self, why):
        """SciPy's answer to a failed line search: back to the last accepted point; with
        correction pairs, drop them and search along -g; without, stop."""
        self.restarts += 1
        if self.memory.k == 0:
            return self._stop(f"abnormal line search: {why}", restore=True)
        self.memory.clear()
        self.theta = 1.0
        self.shards.restart()
        return self._new_direction()

    def _accept(self, f, gd):
        stp = self.stp
        if stp == 1.0:  # SciPy's s'y from the slopes (no dot product of s and y)
            sy, floor = gd - self.gdold, -self.gdold
        else:
            sy, floor = (gd - self.gdold) * stp, -self.gdold * stp
        updated = not sy <= EPS * floor
        rows = self.shards.accept(stp, updated)
        self.f = f
        self.iteration += 1
        self._take(rows, updated, sy)
        self._record(evaluations=self._evals_iteration, stp=stp, updated=updated)
        if self.iteration >= self.cfg.iterations:
            return self._stop("iteration limit reached")
        if self.gmax <= self.cfg.pgtol:
            return self._stop("converged: max |g| <= pgtol")
        if self.fold - f <= self.cfg.factr * EPS * max(abs(self.fold), abs(f), 1.0):
            return self._stop("converged: relative reduction of f <= factr * eps")
        return self._new_direction()

    def _take(self, rows, updated, sy):
        """Read an accepted point's report (``accepted_width`` values per tensor)."""
        k = self.memory.k + (1 if updated and self.memory.k < self.memory.m else 0)
        width = accepted_width(k, updated)
        for name in self.names:
            if len(rows[name]) != width:
                raise RuntimeError(f"L-BFGS: the report for tensor {name!r} has "
                                   f"{len(rows[name])} values, expected {width}")
        self.crc = self._crc(rows)
        self.gmax = max((float(rows[name][1]) for name in self.names), default=0.0)
        self.gg = self._column(rows, 2)
        at = 3
        sg = [self._column(rows, at + j) for j in range(k)]
        yg = [self._column(rows, at + k + j) for j in range(k)]
        at += 2 * k
        if updated:
            yy = self._column(rows, at)
            old = k - 1
            s_y = [self._column(rows, at + 1 + j) for j in range(old)]
            y_s = [self._column(rows, at + 1 + old + j) for j in range(old)]
            y_y = [self._column(rows, at + 1 + 2 * old + j) for j in range(old)]
            self.memory.add(sy, yy, s_y, y_s, y_y)
            self.theta = yy / sy
        self.memory.set_gradient(sg, yg)

    def _record(self, evaluations, stp, updated):
        record = {"iteration": self.iteration, "loss": self.f, "grad_max": self.gmax,
                  "grad_norm": math.sqrt(max(self.gg, 0.0)), "step": stp,
                  "evaluations": evaluations, "evaluations_total": self.evaluations,
                  "pairs": self.memory.k, "updated": bool(updated),
                  "restarts": self.restarts, "x_crc": self.crc}
        self.restarts = 0
        self._evals_iteration = 0
        self.records.append(record)
        if self.on_iteration is not None:
            self.on_iteration(record)

    def _stop(self, why, restore=False):
        self.stop_reason = why
        self.done = True
        self.shards.stop(restore)
        return False


# -- a shard's vectors ------------------------------------------------------------------

def _dot(a, b, work):
    """``a.b`` of two tensors of one shape, summed by the array library's own pairwise
    reduction of the flat product (no BLAS: its threads would change the order)."""
    xp = _xp(a)
    xp.multiply(a, b, out=work)
    return float(work.reshape(-1).sum())


def _xp(a):
    from mpidl.backend import array_module  # noqa: PLC0415

    return array_module(a)


def _crc32(a):
    from mpidl.backend import to_numpy  # noqa: PLC0415

    return zlib.crc32(np.ascontiguousarray(to_numpy(a)).reshape(-1).view(np.uint8))


class ShardVectors:
    """The L-BFGS vectors of some parameters: ``x`` (the parameters' own arrays), ``t``
    (the last accepted point), ``g`` (its gradient), ``gt`` (the gradient at the point
    being tried), ``d`` (the direction) and the correction pairs ``s``, ``y`` (oldest
    first). Each operation answers one row of values per tensor, in ``names`` order.

    ``named_params``: (name, Parameter) pairs in the model's order; ``history``: the
    most pairs kept. Whoever evaluates the loss calls ``take_gradient`` before the
    coordinator asks for the ``report``.
    """

    def __init__(self, named_params, history):
        self.names = [n for n, _ in named_params]
        self.x = {n: p.data for n, p in named_params}
        self.history = int(history)
        self.t = {n: x.copy() for n, x in self.x.items()}
        self.g, self.gt, self.d, self.work = ({n: _xp(x).zeros_like(x) for n, x in
                                               self.x.items()} for _ in range(4))
        self.s, self.y = [], []
        self.started = False

    def take_gradient(self, grads):
        """The gradient at the point being tried (``{name: array}``; a missing tensor's
        gradient is zero). Copied: the caller's arrays are its own again."""
        for n in self.names:
            g = grads.get(n)
            if g is None:
                self.gt[n][...] = 0
            else:
                self.gt[n][...] = g

    def _rows(self, fn):
        return [np.array(fn(n), dtype=np.float64) for n in self.names]

    def report(self):
        """After an evaluation: at the starting point, the accepted point's report (it is
        accepted as it is); later, the trial slope ``gt.d`` per tensor."""
        if not self.started:
            self.started = True
            self.g, self.gt = self.gt, self.g
            for n in self.names:
                self.t[n][...] = self.x[n]
            return self._accepted(updated=False)
        return self._rows(lambda n: [_dot(self.gt[n], self.d[n], self.work[n])])

    def trial(self, stp):
        """x = stp d + t."""
        for n in self.names:
            x = self.x[n]
            _xp(x).multiply(self.d[n], stp, out=x)
            x += self.t[n]

    def accept(self, stp, updated):
        """The point tried becomes the accepted one; with ``updated``, the pair ``s = stp
        d``, ``y = gt - g`` joins the memory (the oldest leaves when it is full)."""
        if updated:
            if len(self.s) == self.history:
                s, y = self.s.pop(0), self.y.pop(0)  # their arrays serve again
            else:
                s = {n: _xp(x).empty_like(x) for n, x in self.x.items()}
                y = {n: _xp(x).empty_like(x) for n, x in self.x.items()}
            for n in self.names:
                xp = _xp(self.x[n])
                xp.multiply(self.d[n], stp, out=s[n])
                xp.subtract(self.gt[n], self.g[n], out=y[n])
            self.s.append(s)
            self.y.append(y)
        self.g, self.gt = self.gt, self.g
        for n in self.names:
            self.t[n][...] = self.x[n]
        return self._accepted(updated)

    def _accepted(self, updated):
        k, s, y, w = len(self.s), self.s, self.y, self.work

        def row(n):
            g = self.g[n]
            out = [_crc32(self.x[n]), float(_xp(g).abs(g).max()) if g.size else 0.0,
                   _dot(g, g, w[n])]
            out += [_dot(g, s[j][n], w[n]) for j in range(k)]
            out += [_dot(g, y[j][n], w[n]) for j in range(k)]
            if updated:
                sn, yn = s[-1][n], y[-1][n]
                out.append(_dot(yn, yn, w[n]))
                out += [_dot(sn, y[j][n], w[n]) for j in range(k - 1)]
                out += [_dot(yn, s[j][n], w[n]) for j in range(k - 1)]
                out += [_dot(yn, y[j][n], w[n]) for j in range(k - 1)]
            return out
        return self._rows(row)

    def restart(self):
        """Back to the accepted point; the memory is dropped."""
        self.s, self.y = [], []
        for n in self.names:
            self.x[n][...] = self.t[n]

    def direction(self, coeffs):
        """``d = sum c_sj s_j + sum c_yj y_j + c_g g`` (``coeffs`` in that order, oldest
        pair first); answers ``g.d`` and ``d.d`` per tensor."""
        k = len(self.s)
        if len(coeffs) != 2 * k + 1:
            raise ValueError(f"a direction over {k} pairs takes {2 * k + 1} coefficients, "
                             f"got {len(coeffs)}")
        for n in self.names:
            d, w = self.d[n], self.work[n]
            xp = _xp(d)
            xp.multiply(self.g[n], float(coeffs[-1]), out=d)
            for j in range(k):
                xp.multiply(self.s[j][n], float(coeffs[j]), out=w)
                d += w
            for j in range(k):
                xp.multiply(self.y[j][n], float(coeffs[k + j]), out=w)
                d += w
        return self._rows(lambda n: [_dot(self.g[n], self.d[n], self.work[n]),
                                     _dot(self.d[n], self.d[n], self.work[n])])

    def stop(self, restore):
        """The end: the parameters hold the last accepted point."""
        if restore:
            for n in self.names:
                self.x[n][...] = self.t[n]


class LocalShards:
    """Every tensor in this process: the coordinator's operations are calls."""

    def __init__(self, vectors):
        self.vectors = vectors

    def _named(self, rows):
        return dict(zip(self.vectors.names, rows))

    def report(self):
        return self._named(self.vectors.report())

    def trial(self, stp):
        self.vectors.trial(stp)

    def accept(self, stp, updated):
        return self._named(self.vectors.accept(stp, updated))

    def restart(self):
        self.vectors.restart()

    def direction(self, coeffs):
        return self._named(self.vectors.direction(coeffs))

    def stop(self, restore):
        self.vectors.stop(restore)


def minimize(named_params, evaluate, settings=None, on_iteration=None):
    """L-BFGS on one process: ``evaluate()`` returns ``(f, {name: gradient})`` at the
    parameters' current values; the parameters end at the last accepted point. Returns
    the coordinator (``records``, ``stop_reason``, ``evaluations``)."""
    settings = settings or LbfgsSettings()
    named_params = list(named_params)
    vectors = ShardVectors(named_params, settings.history)
    lbfgs = Lbfgs(settings, LocalShards(vectors), vectors.names, on_iteration)
    more = True
    while more:
        f, grads = evaluate()
        vectors.take_gradient(grads)
        more = lbfgs.evaluated(f)
    return lbfgs

"""L-BFGS's algorithm on one process (``mpidl.engine.lbfgs``), against SciPy.

1. The line search takes SciPy's steps, bit for bit: each trial step and the final
   status of MINPACK-2's dcsrch (SciPy's port, ``scipy.optimize._dcsrch.DCSRCH``) on
   Moré and Thuente's test functions, from small and large first steps.
2. The vector-free direction (two-loop recursion on dot products) is ``-H g`` for the
   dense inverse-BFGS matrix built from the same pairs, wrap-around of the memory
   included.
3. Float64 multinomial logistic regression (600 Fashion-MNIST images): the first 20
   iterates are within 1e-10 of ``scipy.optimize.minimize(method="L-BFGS-B")``
   (recorded by its callback), with as many function evaluations, with SciPy's
   settings and with a memory of 3 pairs and 2-evaluation line searches; on
   Rosenbrock's function, SciPy's answers to a failed line search (memory dropped and
   -g tried; then, without pairs, its abnormal stop) too.

The same algorithm on parameter servers is in test_lbfgs_mpi.py.
"""

import functools
import math

import numpy as np
import pytest

from mpidl.engine import Flatten, Linear, Sequential, SoftmaxCrossEntropy
from mpidl.engine.lbfgs import LbfgsSettings, LineSearch, Memory, minimize
from mpidl.runtime.dealing import sum_of_portions

scipy_optimize = pytest.importorskip("scipy.optimize")


# -- 1. the line search -------------------------------------------------------------------

def mt1(a, beta=2.0):  # Moré–Thuente (1994), function (5.1)
    return -a / (a * a + beta), (a * a - beta) / (a * a + beta) ** 2


def mt2(a, beta=0.004):  # (5.2)
    return (a + beta) ** 5 - 2 * (a + beta) ** 4, 5 * (a + beta) ** 4 - 8 * (a + beta) ** 3


def mt3(a, beta=0.01, ell=39):  # (5.3): a wiggly function
    if a <= 1 - beta:
        f0, d0 = 1 - a, -1.0
    elif a >= 1 + beta:
        f0, d0 = a - 1, 1.0
    else:
        f0, d0 = (a - 1) ** 2 / (2 * beta) + beta / 2, (a - 1) / beta
    w = ell * math.pi / 2
    return (f0 + 2 * (1 - beta) / (ell * math.pi) * math.sin(w * a),
            d0 + (1 - beta) * math.cos(w * a))


def quartic(a):  # slopes of one sign for a while, then a steep wall
    return (a - 3) ** 4 - 5 * a, 4 * (a - 3) ** 3 - 5


CASES = [(mt1, 1e-3, 0.1), (mt2, 0.1, 0.1), (mt3, 0.1, 0.1), (quartic, 1e-3, 0.9),
         (mt1, 1e-3, 0.9)]


@pytest.mark.parametrize("fn, ftol, gtol", CASES)
@pytest.mark.parametrize("first", [1e-3, 1e-1, 10.0, 1e3])
def test_line_search_takes_scipys_steps(fn, ftol, gtol, first):
    from scipy.optimize._dcsrch import DCSRCH  # SciPy's port of MINPACK-2's dcsrch

    f0, g0 = fn(0.0)
    ref = DCSRCH(None, None, ftol, gtol, 0.1, 0.0, 1e10)
    stp, _, _, task = ref._iterate(first, f0, g0, b"START")
    assert task == b"FG" and stp == first
    ours = LineSearch(ftol, gtol, 0.1, 0.0, 1e10)
    ours.start(f0, g0, first)
    trials = []
    for _ in range(50):
        f, g = fn(stp)
        trials.append(stp)
        stp, _, _, task = ref._iterate(stp, f, g, task)
        want = {"FG": "evaluate", "CO": "converged", "WA": "warning"}[task[:2].decode()]
        assert ours.next(f, g) == (want, stp), (trials, task)
        if want != "evaluate":
            break
    else:
        raise AssertionError(f"no end after 50 trials: {trials}")


# -- 2. the direction from dot products ---------------------------------------------------

def test_vector_free_direction_is_minus_h_g():
    rng = np.random.default_rng(0)
    n, m = 12, 3
    A = rng.standard_normal((n, n))
    A = A @ A.T + n * np.eye(n)  # a convex quadratic: y = A s
    memory, pairs = Memory(m), []
    for _ in range(5):  # 5 pairs through a memory of 3: the oldest leave
        s = rng.standard_normal(n)
        y = A @ s
        old = pairs[-(m - 1):] if len(pairs) >= m else pairs
        memory.add(s @ y, y @ y, [s @ yj for _, yj in old], [y @ sj for sj, _ in old],
                   [y @ yj for _, yj in old])
        pairs = (old + [(s, y)])[-m:]
    g = rng.standard_normal(n)
    memory.set_gradient([s @ g for s, _ in pairs], [y @ g for _, y in pairs])
    s_last, y_last = pairs[-1]
    theta = (y_last @ y_last) / (s_last @ y_last)
    coeffs = memory.direction(theta)
    d = sum(c * v for c, v in zip(coeffs, [s for s, _ in pairs] + [y for _, y in pairs] + [g]))
    H = np.eye(n) / theta  # the inverse BFGS updates, oldest pair first
    for s, y in pairs:
        rho = 1.0 / (s @ y)
        V = np.eye(n) - rho * np.outer(y, s)
        H = V.T @ H @ V + rho * np.outer(s, s)
    np.testing.assert_allclose(d, -H @ g, rtol=1e-12, atol=1e-12)


# -- 3. the iterates of SciPy's L-BFGS-B ---------------------------------------------------

@functools.lru_cache(maxsize=1)
def logistic_data(n=600):
    """The first ``n`` Fashion-MNIST training images in float64 (when installed;
    otherwise ten generated classes of 64 features)."""
    from mpirun import fashion_available

    if fashion_available():
        from mpidl.data import load_dataset

        data = load_dataset("fashion-mnist").limit(n, 1)
        return data.train_x.astype(np.float64), data.train_y
    rng = np.random.default_rng(1)
    y = rng.integers(0, 10, n)
    return rng.standard_normal((10, 64))[y] + 2.0 * rng.standard_normal((n, 64)), y


def logistic_problem(portion=150):
    """Float64 multinomial logistic regression, evaluated in portions."""
    x, y = logistic_data()
    features = int(np.prod(x.shape[1:]))

    def build():
        return Sequential(Flatten(), Linear(features, 10, init="glorot_uniform", rng=3,
                                            dtype="float64"))

    loss = SoftmaxCrossEntropy()
    return build, (lambda model: sum_of_portions(model, loss, x, y, portion))


def scipy_run(fun, x0, history, maxls, iterations=20):
    """SciPy's L-BFGS-B iterates (its callback's) and its result."""
    seen = []
    res = scipy_optimize.minimize(fun, x0, jac=True, method="L-BFGS-B",
                                  callback=lambda xk: seen.append(np.array(xk)),
                                  options={"maxiter": iterations, "maxcor": history,
                                           "maxls": maxls})
    return seen, res


def compare(ours, lbfgs, theirs, res, final):
    """Iterates within 1e-10, as many evaluations, the same end."""
    assert len(ours) - 1 == len(theirs) == res.nit  # (ours[0] is the start)
    assert lbfgs.evaluations == res.nfev
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(ours[1:], theirs))
    assert worst <= 1e-10, worst
    assert float(np.max(np.abs(final - res.x))) <= 1e-10  # where each stopped
    assert ("abnormal" in lbfgs.stop_reason) == (res.status == 2)


@pytest.mark.parametrize("history, maxls", [
    (10, 20),  # SciPy's defaults
    pytest.param(3, 2, id="3-2: the memory wraps around, short line searches")])
def test_logistic_regression_first_20_iterates_are_scipys(history, maxls):
    build, evaluate = logistic_problem()
    model = build()
    params = model.named_parameters()

    def flat():
        return np.concatenate([p.data.ravel() for _, p in params])

    ours = []
    x0 = flat()
    lbfgs = minimize(params, lambda: evaluate(model),
                     LbfgsSettings(history=history, iterations=20, max_line_search=maxls),
                     on_iteration=lambda record: ours.append(flat()))
    assert np.array_equal(ours[0], x0)

    ref = build()
    ref_params = ref.named_parameters()

    def fun(x):
        at = 0
        for _, p in ref_params:
            p.data[...] = x[at:at + p.data.size].reshape(p.data.shape)
            at += p.data.size
        f, g = evaluate(ref)
        return f, np.concatenate([g[n].ravel() for n, _ in ref_params])

    theirs, res = scipy_run(fun, x0, history, maxls)
    compare(ours, lbfgs, theirs, res, flat())
    assert lbfgs.iteration == 20
    assert max(r["pairs"] for r in lbfgs.records) == min(history, 20)
    if history == 3:
        assert any(r["evaluations"] > 1 for r in lbfgs.records)


@pytest.mark.parametrize("n, history, maxls, start, what", [
    (2, 3, 3, (-3.0, 3.0), "restart"),  # a search fails with pairs held: -g from there
    (10, 10, 1, (-1.2, 1.0), "abnormal"),  # ... and fails again without: SciPy stops
])
def test_failed_line_searches_go_as_in_scipy(n, history, maxls, start, what):
    """Rosenbrock's function, where SciPy's restart and its abnormal stop happen."""
    from mpidl.engine.module import Parameter

    def fun(x):
        return scipy_optimize.rosen(x), scipy_optimize.rosen_der(x)

    x0 = np.tile(start, n // 2)
    p = Parameter(x0.copy())
    ours = []

    def evaluate():
        f, g = fun(p.data)
        return f, {"x": g}

    lbfgs = minimize([("x", p)], evaluate,
                     LbfgsSettings(history=history, iterations=20, max_line_search=maxls),
                     on_iteration=lambda record: ours.append(p.data.copy()))
    theirs, res = scipy_run(fun, x0, history, maxls)
    compare(ours, lbfgs, theirs, res, p.data)
    if what == "restart":
        assert sum(r["restarts"] for r in lbfgs.records) == 1 and lbfgs.iteration == 20
    else:
        assert "abnormal" in lbfgs.stop_reason

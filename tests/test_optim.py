"""Optimizers against hand-written formulas (and PyTorch where installed), the fused
Numba kernels against the NumPy sequence (bitwise), state round trips, and schedules."""

import copy
import math

import numpy as np
import pytest

from mpidl.engine import (
    SGD, Adam, AdamW, Embedding, Linear, Parameter, SoftmaxCrossEntropy, SparseGrad,
    build_model, make_optimizer, make_schedule,
)
from mpidl.engine import _fused


def params_and_grads(steps=3, shape=(4, 3), seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(steps)]
    return p0, grads


def run(opt_factory, p0, grads):
    p = Parameter(p0.copy())
    opt = opt_factory([("w", p)])
    for g in grads:
        p.grad = g.copy()
        opt.step()
    return p.data


# -- formulas

def test_sgd_plain():
    p0, grads = params_and_grads()
    ref = p0 - 0.1 * sum(grads)
    np.testing.assert_allclose(run(lambda ps: SGD(ps, lr=0.1), p0, grads), ref, rtol=1e-14)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_sgd_momentum_formula(nesterov, wd):
    p0, grads = params_and_grads(steps=4)
    lr, mu = 0.1, 0.9
    p, v = p0.copy(), np.zeros_like(p0)
    for g in grads:
        g = g + wd * p
        v = mu * v + g
        p = p - lr * (g + mu * v if nesterov else v)
    got = run(lambda ps: SGD(ps, lr=lr, momentum=mu, nesterov=nesterov, weight_decay=wd),
              p0, grads)
    np.testing.assert_allclose(got, p, rtol=1e-13)


@pytest.mark.parametrize("cls", [Adam, AdamW])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_formula(cls, wd):
    p0, grads = params_and_grads(steps=5)
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    for t, g in enumerate(grads, 1):
        if cls is AdamW:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
    got = run(lambda ps: cls(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd), p0, grads)
    np.testing.assert_allclose(got, p, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["sgd", "nesterov", "adam", "adamw"])
def test_against_torch(kind):
    torch = pytest.importorskip("torch")
    p0, grads = params_and_grads(steps=5, dtype=np.float32)
    tp = torch.nn.Parameter(torch.tensor(p0))
    if kind in ("sgd", "nesterov"):
        kw = dict(lr=0.1, momentum=0.9, nesterov=kind == "nesterov", weight_decay=0.01)
        topt, mine = torch.optim.SGD([tp], **kw), lambda ps: SGD(ps, **kw)
    else:
        kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
        tcls, cls = (torch.optim.Adam, Adam) if kind == "adam" else (torch.optim.AdamW, AdamW)
        topt, mine = tcls([tp], **kw), lambda ps: cls(ps, **kw)
    for g in grads:
        tp.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(run(mine, p0, grads), tp.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- fused kernels are bitwise the NumPy sequence

@pytest.mark.skipif(not _fused.available(), reason="Numba not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("make", [
    lambda ps, f: SGD(ps, lr=0.1, fused=f),
    lambda ps, f: SGD(ps, lr=0.1, momentum=0.9, fused=f),
    lambda ps, f: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=f),
    lambda ps, f: SGD(ps, lr=0.05, momentum=0.5, weight_decay=1e-2, fused=f),
    lambda ps, f: Adam(ps, lr=0.01, fused=f),
    lambda ps, f: Adam(ps, lr=0.01, weight_decay=0.1, fused=f),
    lambda ps, f: AdamW(ps, lr=0.01, weight_decay=0.1, fused=f),
], ids=["sgd", "momentum", "nesterov-wd", "momentum-wd", "adam", "adam-l2", "adamw"])
def test_fused_equals_numpy_bitwise(dtype, make):
    p0, grads = params_and_grads(steps=6, shape=(37, 29), dtype=dtype)
    fused = run(lambda ps: make(ps, True), p0, grads)
    plain = run(lambda ps: make(ps, False), p0, grads)
    assert fused.dtype == dtype
    np.testing.assert_array_equal(fused, plain)


def test_float32_stays_float32():
    p0, grads = params_and_grads(dtype=np.float32)
    for fused in (True, False):
        for cls in (SGD, Adam):
            kw = {"momentum": 0.9} if cls is SGD else {}
            assert run(lambda ps: cls(ps, lr=0.1, fused=fused, **kw), p0, grads).dtype == np.float32


# -- API

def test_step_names_and_none_grads():
    a, b = Parameter(np.ones(3)), Parameter(np.ones(3))
    opt = SGD([("a", a), ("b", b)], lr=0.5)
    a.grad, b.grad = np.ones(3), np.ones(3)
    opt.step(["b"])
    np.testing.assert_array_equal(a.data, 1.0)
    np.testing.assert_array_equal(b.data, 0.5)
    b.grad = None
    opt.step()  # only a has a grad now... and b's is None: skipped
    np.testing.assert_array_equal(a.data, 0.5)
    np.testing.assert_array_equal(b.data, 0.5)
    with pytest.raises(KeyError, match="unknown parameter 'c'"):
        opt.step(["c"])
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    assert opt.step_count == 1


def test_accepts_a_model_and_lr_is_settable():
    model = build_model("mlp", input_shape=(4,), num_classes=2)
    opt = SGD(model, lr=0.1)
    assert list(opt.params) == [n for n, _ in model.named_parameters()]
    opt.lr = 0.25
    assert opt.lr == 0.25
    opt.lr = 0.0  # a schedule may anneal to zero
    with pytest.raises(ValueError, match="lr must be >= 0, got -1.0"):
        opt.lr = -1


@pytest.mark.parametrize("factory,message", [
    (lambda ps: SGD(ps, lr=-0.1), "lr must be > 0, got -0.1"),
    (lambda ps: SGD(ps, lr=0), "lr must be > 0, got 0.0"),
    (lambda ps: SGD(ps, lr=0.1, momentum=1.5), r"momentum must be in \[0.0, 1.0\), got 1.5"),
    (lambda ps: SGD(ps, lr=0.1, weight_decay=-1), "weight_decay must be in"),
    (lambda ps: SGD(ps, lr=0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda ps: Adam(ps, betas=(0.9, 1.0)), r"beta2 must be in \[0.0, 1.0\), got 1.0"),
    (lambda ps: Adam(ps, eps=0), "eps must be > 0"),
    (lambda ps: make_optimizer("rmsprop", ps), "unknown optimizer 'rmsprop'"),
])
def test_validation(factory, message):
    with pytest.raises(ValueError, match=message):
        factory([("w", Parameter(np.zeros(2)))])


def test_rejects_non_parameters():
    with pytest.raises(TypeError, match=r"\(name, Parameter\) pairs"):
        SGD([np.zeros(2)], lr=0.1)


# -- state round trip: bitwise continuation

def _train(model, opt, steps, seed):
    rng = np.random.default_rng(seed)
    loss = SoftmaxCrossEntropy()
    for _ in range(steps):
        x = rng.standard_normal((8, 1, 6, 6)).astype(np.float32)
        y = rng.integers(0, 3, 8)
        opt.zero_grad()
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        opt.step()


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_state_dict_roundtrip_is_bitwise(kind):
    def make():
        model = build_model("cnn", input_shape=(1, 6, 6), num_classes=3, seed=3,
                            dropout=0.25)  # the Dropout counter must resume too
        if kind == "sgd":
            opt = SGD(model.named_parameters(), lr=0.05, momentum=0.9, nesterov=True,
                      weight_decay=1e-4)
        else:
            opt = AdamW(model.named_parameters(), lr=1e-3)
        return model, opt

    straight, opt1 = make()
    _train(straight, opt1, 3, seed=1)
    _train(straight, opt1, 3, seed=2)

    first, opt2 = make()
    _train(first, opt2, 3, seed=1)
    # What a checkpoint keeps: host copies of both state dicts.
    model_state = {k: np.array(v) for k, v in first.state_dict().items()}
    opt_state = copy.deepcopy(opt2.state_dict())
    assert opt_state["step"] == 3 and opt_state["type"] == opt2.__class__.__name__
    _train(first, opt2, 1, seed=9)  # the live objects move on; the saved state must not

    resumed, opt3 = make()
    resumed.load_state_dict(model_state)
    opt3.load_state_dict(opt_state)
    _train(resumed, opt3, 3, seed=2)
    for (n, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=n)
    for (n, a), (_, b) in zip(straight.named_buffers(), resumed.named_buffers()):
        np.testing.assert_array_equal(a, b, err_msg=n)


def test_load_state_dict_restores_hyperparameters_and_checks():
    p = Parameter(np.zeros(3))
    opt = SGD([("w", p)], lr=0.1, momentum=0.9)
    p.grad = np.ones(3)
    opt.step()
    state = opt.state_dict()
    other = SGD([("w", Parameter(np.zeros(3)))], lr=0.5, momentum=0.5)
    other.load_state_dict(state)
    assert other.lr == 0.1 and other.momentum == 0.9
    np.testing.assert_array_equal(other.state["w"]["momentum"], np.ones(3))
    with pytest.raises(ValueError, match="cannot load SGD state into Adam"):
        Adam([("w", Parameter(np.zeros(3)))]).load_state_dict(state)
    with pytest.raises(KeyError, match="does not hold"):
        SGD([("v", Parameter(np.zeros(3)))], lr=0.1).load_state_dict(state)


# -- sparse gradients

def test_sgd_sparse_touches_rows_only():
    emb = Embedding(6, 2, rng=0, dtype="float64")
    before = emb.weight.data.copy()
    opt = SGD(emb.named_parameters(), lr=0.5, momentum=0.9)
    ids = np.array([1, 4, 1])
    for _ in range(2):
        opt.zero_grad()  # backward accumulates (micro-batches): each step starts clean
        emb.forward(ids)
        emb.backward(np.ones((3, 2)))
        opt.step()
    after = emb.weight.data
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(after[untouched], before[untouched])
    # row 1 gets gradient 2 (it appears twice), row 4 gradient 1; momentum over 2 steps:
    # v1 = g, v2 = 0.9 g + g; total displacement = lr * (g + 1.9 g) = 1.45 g
    np.testing.assert_allclose(after[1], before[1] - 1.45 * 2)
    np.testing.assert_allclose(after[4], before[4] - 1.45 * 1)
    assert set(np.nonzero(opt.state["weight"]["momentum"][:, 0])[0]) == {1, 4}


@pytest.mark.parametrize("factory", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=False),
    lambda ps: Adam(ps, lr=0.01, fused=False),
])
def test_sparse_equals_dense_when_every_row_is_touched_once(factory):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 3))
    dense, sparse = Parameter(w0.copy()), Parameter(w0.copy())
    od, osp = factory([("w", dense)]), factory([("w", sparse)])
    for _ in range(3):
        g = rng.standard_normal((5, 3))
        perm = rng.permutation(5)
        dense.grad = g
        sparse.grad = SparseGrad(perm, g[perm], (5, 3))
        od.step()
        osp.step()
    np.testing.assert_array_equal(sparse.data, dense.data)


# -- schedules

def test_schedules():
    const = make_schedule("constant", 0.1, 100)
    assert const(0) == const(99) == 0.1
    step = make_schedule("step", 0.1, 100, step_size=10, gamma=0.5)
    assert step(9) == 0.1 and step(10) == 0.05 and step(25) == 0.025
    miles = make_schedule("step", 1.0, milestones=[3, 5], gamma=0.1)
    assert [miles(s) for s in (2, 3, 4, 5)] == pytest.approx([1, 0.1, 0.1, 0.01])
    cos = make_schedule("cosine", 0.2, 100)
    assert cos(0) == 0.2 and cos(50) == pytest.approx(0.1) and cos(100) == pytest.approx(0)
    assert cos(1000) == pytest.approx(0)
    assert make_schedule("cosine", 0.2, 100, min_lr=0.02)(100) == pytest.approx(0.02)
    lin = make_schedule("linear", 0.2, 100)
    assert lin(25) == pytest.approx(0.15)


def test_warmup_composes():
    s = make_schedule("cosine", 0.4, 100, warmup_steps=4)
    assert [s(k) for k in range(3)] == pytest.approx(
        [0.1 * 0.4 * (1 + math.cos(math.pi * k / 100)) / 2 * (k + 1) * 10 / 4 for k in range(3)])
    assert s(3) == pytest.approx(0.4 * (1 + math.cos(math.pi * 3 / 100)) / 2)
    c = make_schedule("constant", 0.8, warmup_steps=8)
    assert c(0) == pytest.approx(0.1) and c(7) == 0.8 and c(100) == 0.8
    st = make_schedule("step", 1.0, step_size=10, warmup_steps=2)
    assert st(0) == 0.5 and st(1) == 1.0 and st(10) == pytest.approx(0.1)


@pytest.mark.parametrize("args,kwargs,message", [
    (("poly", 0.1, 10), {}, "unknown schedule 'poly': expected one of constant, step, cosine"),
    (("cosine", 0.1), {}, "needs total_steps >= 1"),
    (("step", 0.1, 10), {}, "needs step_size >= 1"),
    (("constant", -0.1, 10), {}, "base_lr must be > 0"),
    (("constant", 0.1, 10), {"warmup_steps": -1}, "warmup_steps must be >= 0"),
    (("step", 0.1, 10), {"step_size": 2, "gamma": 0}, "gamma must be in"),
])
def test_schedule_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(*args, **kwargs)


def test_linear_layer_update_end_to_end():
    lin = Linear(3, 2, rng=0, dtype="float64")
    w0 = lin.weight.data.copy()
    opt = SGD(lin.named_parameters(), lr=0.1)
    x = np.ones((4, 3))
    lin.forward(x)
    lin.backward(np.ones((4, 2)))
    opt.step()
    np.testing.assert_allclose(lin.weight.data, w0 - 0.1 * 4)

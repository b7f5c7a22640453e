"""Finite-difference gradient checks of every layer and loss, in float64.

For a layer f and a fixed random R, the scalar ``L(x, params) = sum(f(x) * R)`` has
``dL/dy = R``; backward(R) must match central differences ``(L(+h) - L(-h)) / 2h`` with
h = 1e-6 for the input gradient and for every parameter's gradient. Small tensors are
checked at every coordinate, larger ones at 25 random coordinates each. Tolerance:
``|analytic - numeric| <= 1e-6 + 1e-5 * |numeric|`` (float64 central differences are good
to ~1e-9 here; the slack covers kinks of ReLU/max-pool that random inputs never hit).

Each check also runs the same forward/backward a second time without ``zero_grad``: since
backward accumulates, every parameter gradient must then be exactly twice the first one
(bitwise for dense gradients: ``g + g`` is exact), and ``activation_nbytes`` must be 0.
"""

import numpy as np
import pytest

from mpidl.engine import (
    GELU, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten,
    GlobalAvgPool2d, LayerNorm, LeakyReLU, Linear, MaxPool2d, MSELoss, ReLU, Reshape,
    Residual, Sequential, Sigmoid, SoftmaxCrossEntropy, SparseGrad, Tanh, basic_block,
    build_model,
)

F64 = "float64"
H = 1e-6
RTOL, ATOL = 1e-5, 1e-6
MAX_COORDS = 25


def _coords(shape, rng):
    size = int(np.prod(shape))
    flat = np.arange(size) if size <= MAX_COORDS else rng.choice(size, MAX_COORDS, replace=False)
    return [np.unravel_index(i, shape) for i in flat]


def _assert_close(analytic, numeric, what):
    analytic, numeric = np.asarray(analytic), np.asarray(numeric)
    err = np.abs(analytic - numeric)
    bound = ATOL + RTOL * np.abs(numeric)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (f"{what}: analytic {analytic.ravel()[worst]:.10g} vs numeric "
                                  f"{numeric.ravel()[worst]:.10g} (max abs err {err.max():.3g})")


def gradcheck(layer, x, seed=0, before_forward=None, check_input=True):
    """Compare ``layer``'s backward with central differences of ``sum(forward(x) * R)``."""
    rng = np.random.default_rng(seed)

    def run(inp):
        if before_forward is not None:
            before_forward(layer)
        return layer.forward(inp)

    layer.zero_grad()
    y = run(x)
    r = rng.standard_normal(y.shape)
    dx = layer.backward(r.copy())
    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad.to_dense() if isinstance(p.grad, SparseGrad) else p.grad
        grads[name] = np.array(g, copy=True)
    assert layer.activation_nbytes() == 0, f"{layer!r} kept activations after backward"
    run(x)
    layer.backward(r.copy())  # accumulates into the gradients above
    for name, p in layer.named_parameters():
        if isinstance(p.grad, SparseGrad):
            np.testing.assert_allclose(p.grad.to_dense(), 2 * grads[name], rtol=1e-14,
                                       atol=1e-14, err_msg=f"{layer!r} accumulated {name}")
        else:
            assert np.array_equal(p.grad, 2 * grads[name]), f"{layer!r} accumulated {name}"

    def loss(inp):
        return float(np.sum(run(inp) * r))

    if check_input:
        assert dx is not None and dx.shape == x.shape
        num, ana = [], []
        for idx in _coords(x.shape, rng):
            xp_, xm = x.copy(), x.copy()
            xp_[idx] += H
            xm[idx] -= H
            num.append((loss(xp_) - loss(xm)) / (2 * H))
            ana.append(dx[idx])
        _assert_close(ana, num, f"{layer!r} input gradient")
    for name, p in layer.named_parameters():
        num, ana = [], []
        for idx in _coords(p.data.shape, rng):
            old = p.data[idx]
            p.data[idx] = old + H
            lp = loss(x)
            p.data[idx] = old - H
            lm = loss(x)
            p.data[idx] = old
            num.append((lp - lm) / (2 * H))
            ana.append(grads[name][idx])
        _assert_close(ana, num, f"{layer!r} gradient of {name}")


def randn(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    gradcheck(Linear(5, 4, bias=bias, rng=1, dtype=F64), randn(3, 5))


def test_linear_batched_leading_axes():
    gradcheck(Linear(4, 3, rng=1, dtype=F64), randn(2, 3, 4))


@pytest.mark.parametrize("layer", [ReLU(), LeakyReLU(0.1), Tanh(), Sigmoid(), GELU()],
                         ids=lambda l: type(l).__name__)
def test_activations(layer):
    gradcheck(layer, randn(4, 6) * 2)


@pytest.mark.parametrize("stride,padding,kernel", [(1, 0, 3), (1, 1, 3), (2, 1, 3), (2, 0, 1),
                                                   ((1, 2), (0, 1), (2, 3))])
def test_conv2d(stride, padding, kernel):
    conv = Conv2d(3, 4, kernel, stride=stride, padding=padding, rng=2, dtype=F64)
    gradcheck(conv, randn(2, 3, 7, 6))


def test_conv2d_no_bias_single_channel():
    gradcheck(Conv2d(1, 2, 3, padding=1, bias=False, rng=3, dtype=F64), randn(2, 1, 5, 5))


@pytest.mark.parametrize("kernel,stride,padding", [(2, None, 0), (3, 2, 1), (3, 1, 0), (2, 2, 1)])
def test_maxpool(kernel, stride, padding):
    gradcheck(MaxPool2d(kernel, stride, padding), randn(2, 3, 7, 6))


@pytest.mark.parametrize("kernel,stride,padding", [(2, None, 0), (3, 2, 1), (3, 1, 0)])
def test_avgpool(kernel, stride, padding):
    gradcheck(AvgPool2d(kernel, stride, padding), randn(2, 3, 7, 6))


def test_global_avgpool():
    gradcheck(GlobalAvgPool2d(), randn(2, 3, 4, 5))


@pytest.mark.parametrize("train", [True, False])
def test_batchnorm2d(train):
    bn = BatchNorm2d(3, dtype=F64)
    bn.weight.data[...] = randn(3, seed=5) + 1
    bn.bias.data[...] = randn(3, seed=6)
    bn.set_buffer("running_mean", randn(3, seed=7))
    bn.set_buffer("running_var", np.abs(randn(3, seed=8)) + 0.5)
    bn.train(train)
    gradcheck(bn, randn(4, 3, 3, 2) * 3 + 1)


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5)])
def test_batchnorm1d(shape):
    bn = BatchNorm1d(4, dtype=F64)
    bn.weight.data[...] = randn(4, seed=5) + 1
    gradcheck(bn, randn(*shape))


def test_batchnorm_without_affine():
    gradcheck(BatchNorm2d(2, affine=False, dtype=F64), randn(3, 2, 2, 2))


@pytest.mark.parametrize("shape,norm", [((4, 6), 6), ((2, 3, 5), (3, 5))])
def test_layernorm(shape, norm):
    ln = LayerNorm(norm, dtype=F64)
    ln.weight.data[...] = randn(*ln.weight.shape, seed=5) + 1
    ln.bias.data[...] = randn(*ln.bias.shape, seed=6)
    gradcheck(ln, randn(*shape))


def test_dropout_fixed_mask():
    def same_mask(layer):  # every forward draws the first mask again
        layer.set_buffer("calls", np.zeros((), dtype=np.int64))

    gradcheck(Dropout(0.4, seed=3), randn(5, 6), before_forward=same_mask)


def test_dropout_eval_is_identity():
    gradcheck(Dropout(0.5).eval(), randn(3, 4))


def test_flatten_reshape():
    gradcheck(Flatten(), randn(2, 3, 4))
    gradcheck(Reshape(4, 3), randn(2, 3, 4))


def test_embedding():
    emb = Embedding(7, 3, rng=1, dtype=F64)
    ids = np.array([[1, 3, 3], [6, 0, 1]])
    gradcheck(emb, ids, check_input=False)
    emb.zero_grad()
    emb.forward(ids)
    emb.backward(np.ones((2, 3, 3)))
    g = emb.weight.grad
    assert isinstance(g, SparseGrad) and g.shape == (7, 3)
    assert set(np.asarray(g.indices).tolist()) == {0, 1, 3, 6}  # touched rows only
    dense = g.to_dense()
    np.testing.assert_array_equal(dense[:, 0], [1, 2, 0, 2, 0, 0, 1])
    c = g.coalesce()
    np.testing.assert_array_equal(c.indices, [0, 1, 3, 6])
    np.testing.assert_array_equal(c.to_dense(), dense)


@pytest.mark.parametrize("cin,cout,stride", [(3, 3, 1), (3, 4, 2)])
def test_residual_basic_block(cin, cout, stride):
    block = basic_block(cin, cout, stride, rng=4, dtype=F64)
    gradcheck(block, randn(3, cin, 6, 6))


def test_residual_identity_without_activation():
    body = Sequential(Linear(4, 4, rng=1, dtype=F64), Tanh(), Linear(4, 4, rng=2, dtype=F64))
    gradcheck(Residual(body, activation=False), randn(3, 4))
    gradcheck(Residual(body), randn(3, 4))


def test_sequential_mlp():
    model = Sequential(Flatten(), Linear(12, 5, rng=1, dtype=F64), GELU(),
                       LayerNorm(5, dtype=F64), Linear(5, 3, rng=2, dtype=F64))
    gradcheck(model, randn(4, 3, 4))


@pytest.mark.parametrize("name", ["cnn", "resnet-tiny"])
def test_whole_models(name):
    kwargs = {"dropout": 0.0} if name == "cnn" else {}
    model = build_model(name, input_shape=(2, 8, 8), num_classes=3, seed=1, dtype=F64, **kwargs)
    model.needs_input_grad = True
    gradcheck(model, randn(3, 2, 8, 8))


def _loss_gradcheck(loss, out, target):
    loss.forward(out, target)
    ana = loss.backward()
    num = np.zeros_like(out)
    for idx in np.ndindex(out.shape):
        p, m = out.copy(), out.copy()
        p[idx] += H
        m[idx] -= H
        num[idx] = (loss.forward(p, target) - loss.forward(m, target)) / (2 * H)
    _assert_close(ana, num, f"{loss!r} gradient")


def test_softmax_cross_entropy():
    _loss_gradcheck(SoftmaxCrossEntropy(), randn(5, 4) * 3, np.array([0, 3, 1, 1, 2]))


def test_softmax_cross_entropy_huge_logits():
    logits = randn(3, 4) * 1e4
    loss = SoftmaxCrossEntropy()
    value = loss.forward(logits, np.array([0, 1, 2]))
    assert np.isfinite(value)
    assert np.all(np.isfinite(loss.backward()))
    _loss_gradcheck(SoftmaxCrossEntropy(), randn(3, 4) * 30, np.array([0, 1, 2]))


def test_mse():
    _loss_gradcheck(MSELoss(), randn(4, 3), randn(4, 3, seed=9))


def test_checker_catches_a_wrong_gradient():
    class WrongTanh(Tanh):
        def backward(self, dy):
            return super().backward(dy) * 1.001

    with pytest.raises(AssertionError, match="input gradient"):
        gradcheck(WrongTanh(), randn(3, 4))

    class WrongLinear(Linear):
        def backward(self, dy):
            dx = super().backward(dy)
            self.bias.grad = self.bias.grad + 1e-3
            return dx

    with pytest.raises(AssertionError, match="gradient of bias"):
        gradcheck(WrongLinear(3, 2, rng=0, dtype=F64), randn(2, 3))

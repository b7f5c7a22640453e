"""Layer behaviour: shapes, train/eval, BatchNorm statistics, errors, references, dtypes.

Gradients are checked in test_gradcheck.py; here forward results are held against naive
loops (and against PyTorch where it is installed), and the GPU tests (marked ``gpu``)
hold CuPy results against NumPy's.
"""

import math

import numpy as np
import pytest

from mpidl.engine import (
    GELU, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten,
    GlobalAvgPool2d, LayerNorm, LeakyReLU, Linear, MaxPool2d, MSELoss, ReLU, Reshape,
    Residual, Sequential, ShapeError, Sigmoid, SoftmaxCrossEntropy, Tanh, accuracy,
    basic_block, build_model,
)
from mpidl.engine.metrics import top_k_correct


def randn(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# -- naive references (loops over pixels: fine for tiny inputs)

def conv_reference(x, w, b, stride, padding):
    n, c, h, wd = x.shape
    f, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    ho, wo = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, f, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw]
            y[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    return y + (b.reshape(1, -1, 1, 1) if b is not None else 0)


def pool_reference(x, k, s, p, op):
    n, c, h, w = x.shape
    fill = -np.inf if op is np.max else 0.0
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=fill)
    ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    y = np.zeros((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = op(xp[:, :, i * s:i * s + k, j * s:j * s + k], axis=(2, 3))
    return y


# -- Linear

def test_linear_forward_and_shape_error():
    lin = Linear(4, 3, rng=0, dtype="float64")
    x = randn(5, 4)
    np.testing.assert_allclose(lin.forward(x), x @ lin.weight.data + lin.bias.data)
    with pytest.raises(ShapeError) as e:
        Linear(784, 10).forward(np.zeros((32, 100), np.float32))
    assert str(e.value) == "Linear expects 784 input features, got 100 (input shape (32, 100))"
    with pytest.raises(ShapeError, match="add a Flatten before it"):
        Linear(784, 10).forward(np.zeros((2, 1, 28, 28), np.float32))


def test_sequential_prefixes_layer_index():
    model = build_model("mlp")
    with pytest.raises(ShapeError) as e:
        model.forward(np.zeros((32, 100), np.float32))
    assert str(e.value).startswith("layer 1 (Linear(in_features=784, out_features=1024)): "
                                   "Linear expects 784 input features, got 100")


def test_linear_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive sizes"):
        Linear(0, 3)


# -- Conv2d

@pytest.mark.parametrize("stride,padding,kernel", [(1, 0, 3), (1, 1, 3), (2, 1, 3), (3, 2, 2),
                                                   ((2, 1), (1, 0), (3, 2)), (2, 0, 1)])
def test_conv2d_against_naive_loops(stride, padding, kernel):
    conv = Conv2d(3, 5, kernel, stride=stride, padding=padding, rng=1, dtype="float64")
    x = randn(2, 3, 7, 8)
    ref = conv_reference(x, conv.weight.data, conv.bias.data, conv.stride, conv.padding)
    np.testing.assert_allclose(conv.forward(x), ref, rtol=1e-12, atol=1e-12)


def test_conv2d_shape_errors():
    conv = Conv2d(3, 4, 3)
    with pytest.raises(ShapeError, match=r"Conv2d expects input \(N, 3, H, W\), got shape "
                                         r"\(2, 1, 8, 8\)"):
        conv.forward(np.zeros((2, 1, 8, 8), np.float32))
    with pytest.raises(ShapeError, match="does not fit a 2x2 input"):
        conv.forward(np.zeros((1, 3, 2, 2), np.float32))
    with pytest.raises(ShapeError):
        conv.forward(np.zeros((3, 8, 8), np.float32))


def test_conv2d_against_torch():
    torch = pytest.importorskip("torch")
    conv = Conv2d(3, 4, 3, stride=2, padding=1, rng=1, dtype="float64")
    x = randn(2, 3, 9, 7)
    y = conv.forward(x)
    dy = randn(*y.shape, seed=3)
    dx = conv.backward(dy.copy())
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(conv.weight.data, requires_grad=True)
    bt = torch.tensor(conv.bias.data, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=2, padding=1)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(conv.weight.grad, wt.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(conv.bias.grad, bt.grad.numpy(), rtol=1e-10, atol=1e-12)


# -- pooling

@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 0), (2, 1, 1)])
def test_pooling_against_naive_loops(k, s, p):
    x = randn(2, 3, 7, 6)
    np.testing.assert_array_equal(MaxPool2d(k, s, p).forward(x), pool_reference(x, k, s, p, np.max))
    np.testing.assert_allclose(AvgPool2d(k, s, p).forward(x), pool_reference(x, k, s, p, np.mean),
                               rtol=1e-12)


def test_maxpool_ties_go_to_one_input():
    x = np.ones((1, 1, 2, 2))
    pool = MaxPool2d(2)
    pool.forward(x)
    dx = pool.backward(np.ones((1, 1, 1, 1)))
    assert dx.sum() == 1.0 and dx[0, 0, 0, 0] == 1.0


def test_global_avgpool_and_errors():
    x = randn(2, 3, 4, 5)
    np.testing.assert_allclose(GlobalAvgPool2d().forward(x), x.mean(axis=(2, 3)))
    with pytest.raises(ShapeError, match="MaxPool2d expects input"):
        MaxPool2d(2).forward(randn(2, 3, 4))
    with pytest.raises(ShapeError, match="does not fit"):
        MaxPool2d(3).forward(randn(1, 1, 2, 2))
    with pytest.raises(ValueError, match="at most half"):
        MaxPool2d(2, padding=2)


# -- activations

def test_activation_values():
    x = np.array([-3.0, -0.5, 0.0, 0.5, 3.0])
    np.testing.assert_array_equal(ReLU().forward(x), [0, 0, 0, 0.5, 3])
    np.testing.assert_allclose(LeakyReLU(0.1).forward(x), [-0.3, -0.05, 0, 0.5, 3])
    np.testing.assert_allclose(Tanh().forward(x), np.tanh(x))
    np.testing.assert_allclose(Sigmoid().forward(x), 1 / (1 + np.exp(-x)), rtol=1e-12)
    assert np.all(np.isfinite(Sigmoid().forward(np.array([-1e4, 1e4]))))
    gelu_tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(GELU().forward(x), gelu_tanh, rtol=1e-12)
    gelu_erf = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(GELU().forward(x), gelu_erf, atol=1e-3)


@pytest.mark.parametrize("layer", [ReLU(), LeakyReLU(), Tanh(), Sigmoid(), GELU(), Flatten(),
                                   Linear(6, 3), Conv2d(2, 2, 3, padding=1), MaxPool2d(2),
                                   AvgPool2d(2), BatchNorm2d(2), LayerNorm(6),
                                   Dropout(0.5), GlobalAvgPool2d()],
                         ids=lambda l: type(l).__name__)
def test_forward_and_backward_leave_the_input_alone(layer):
    shape = (4, 2, 4, 6) if isinstance(layer, (Conv2d, MaxPool2d, AvgPool2d, BatchNorm2d,
                                                 GlobalAvgPool2d)) else (4, 6)
    x = randn(*shape, dtype=np.float32)
    keep = x.copy()
    y = layer.forward(x)
    layer.backward(np.ones_like(y))
    np.testing.assert_array_equal(x, keep)


# -- BatchNorm

def test_batchnorm_running_stats_and_modes():
    bn = BatchNorm2d(3, momentum=0.1, dtype="float64")
    x = randn(8, 3, 4, 4) * 2 + 5
    y = bn.forward(x)
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    m = x.size // 3
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), var / (var + 1e-5), rtol=1e-10)
    np.testing.assert_allclose(bn.named_buffers()[0][1], 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(bn.named_buffers()[1][1], 0.9 + 0.1 * var * m / (m - 1),
                               rtol=1e-12)
    bn.eval()
    rm, rv = dict(bn.named_buffers())["running_mean"], dict(bn.named_buffers())["running_var"]
    x2 = randn(2, 3, 4, 4, seed=1)
    np.testing.assert_allclose(bn.forward(x2),
                               (x2 - rm.reshape(1, -1, 1, 1)) / np.sqrt(rv.reshape(1, -1, 1, 1) + 1e-5))
    before = {k: v.copy() for k, v in bn.named_buffers()}
    bn.forward(x2)
    for k, v in bn.named_buffers():  # eval mode never moves the statistics
        np.testing.assert_array_equal(v, before[k])


def test_batchnorm_state_dict_roundtrip():
    bn = BatchNorm1d(4)
    bn.forward(randn(16, 4, dtype=np.float32))
    state = {k: np.array(v) for k, v in bn.state_dict().items()}
    assert set(state) == {"weight", "bias", "running_mean", "running_var"}
    fresh = BatchNorm1d(4)
    fresh.load_state_dict(state)
    for k, v in fresh.state_dict().items():
        np.testing.assert_array_equal(v, state[k])


def test_batchnorm_against_torch():
    torch = pytest.importorskip("torch")
    bn = BatchNorm2d(3, dtype="float64")
    tbn = torch.nn.BatchNorm2d(3).double()
    x = randn(4, 3, 5, 5) * 3 + 1
    for _ in range(2):
        y = bn.forward(x)
        yt = tbn(torch.tensor(x))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(bn.state_dict()["running_var"], tbn.running_var.numpy(), rtol=1e-10)
    np.testing.assert_allclose(bn.state_dict()["running_mean"], tbn.running_mean.numpy(),
                               rtol=1e-10)


def test_batchnorm_errors():
    with pytest.raises(ShapeError, match="BatchNorm2d expects 4-D input with 3 channels"):
        BatchNorm2d(3).forward(randn(2, 4, 2, 2))
    with pytest.raises(ShapeError, match="more than one value per channel"):
        BatchNorm1d(3).forward(randn(1, 3))
    with pytest.raises(ValueError, match="momentum"):
        BatchNorm1d(3, momentum=2)


def test_layernorm():
    ln = LayerNorm(6, dtype="float64")
    y = ln.forward(randn(5, 6) * 4 + 2)
    np.testing.assert_allclose(y.mean(axis=1), 0, atol=1e-12)
    np.testing.assert_allclose(y.std(axis=1), 1, rtol=1e-5)
    with pytest.raises(ShapeError, match=r"LayerNorm expects inputs ending in \(6,\)"):
        ln.forward(randn(5, 4))


# -- Dropout

def test_dropout_train_eval_and_reproducibility():
    x = np.ones((200, 100), np.float32)
    d = Dropout(0.3, seed=7)
    y1 = d.forward(x)
    kept = y1 != 0
    assert abs(kept.mean() - 0.7) < 0.02
    np.testing.assert_allclose(y1[kept], 1 / 0.7, rtol=1e-6)
    dx = d.backward(np.ones_like(x))
    np.testing.assert_array_equal(dx != 0, kept)
    y2 = d.forward(x)
    assert not np.array_equal(y1, y2)  # a new mask per call
    again = Dropout(0.3, seed=7)
    np.testing.assert_array_equal(again.forward(x), y1)  # same seed, same masks
    again.load_state_dict(d.state_dict())  # resumed at call 2
    np.testing.assert_array_equal(again.forward(x), d.forward(x))
    other = Dropout(0.3, seed=7)
    other.stream = 1  # another rank's share of the data: other masks
    assert not np.array_equal(other.forward(x), y1)
    d.eval()
    assert d.forward(x) is x
    with pytest.raises(ValueError, match=r"Dropout p must be in \[0, 1\)"):
        Dropout(1.0)


# -- Embedding, shapes, Residual

def test_embedding_forward_and_errors():
    emb = Embedding(10, 4, rng=0)
    ids = np.array([[1, 2], [9, 1]])
    y = emb.forward(ids)
    assert y.shape == (2, 2, 4)
    np.testing.assert_array_equal(y[1, 1], emb.weight.data[1])
    assert emb.backward(np.ones_like(y)) is None
    with pytest.raises(ShapeError, match="Embedding has 10 rows, got id 10"):
        emb.forward(np.array([10]))
    with pytest.raises(ShapeError, match="got id -1"):
        emb.forward(np.array([-1]))
    with pytest.raises(ShapeError, match="integer ids"):
        emb.forward(np.array([1.0]))


def test_flatten_and_reshape():
    x = randn(2, 3, 4)
    assert Flatten().forward(x).shape == (2, 12)
    assert Reshape(4, 3).forward(x).shape == (2, 4, 3)
    with pytest.raises(ShapeError, match="Reshape cannot"):
        Reshape(5).forward(x)


def test_residual_names_and_errors():
    block = basic_block(4, 8, stride=2)
    names = [n for n, _ in block.named_parameters()]
    assert names == ["body.0.weight", "body.1.weight", "body.1.bias", "body.3.weight",
                     "body.4.weight", "body.4.bias", "shortcut.0.weight", "shortcut.1.weight",
                     "shortcut.1.bias"]
    assert block.forward(randn(2, 4, 6, 6, dtype=np.float32)).shape == (2, 8, 3, 3)
    bad = Residual(Sequential(Linear(4, 3)))
    with pytest.raises(ShapeError, match="shortcut that matches"):
        bad.forward(randn(2, 4, dtype=np.float32))


# -- needs_input_grad, hooks

def test_layers_before_the_first_parameter_skip_dx():
    model = Sequential(Flatten(), Linear(6, 4), ReLU(), Linear(4, 2))
    model.needs_input_grad = False
    y = model.forward(randn(3, 2, 3, dtype=np.float32))
    assert [layer.needs_input_grad for layer in model.layers] == [False, False, True, True]
    seen = []
    model.add_grad_ready_hook(seen.append)
    assert model.backward(np.ones_like(y)) is None
    assert seen == [["3.weight", "3.bias"], ["1.weight", "1.bias"]]
    assert all(p.grad is not None for p in model.parameters())
    model.needs_input_grad = True
    model.forward(randn(3, 2, 3, dtype=np.float32))
    assert model.backward(np.ones((3, 2), np.float32)).shape == (3, 2, 3)


# -- dtypes

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_models_keep_their_dtype(dtype):
    for name in ("mlp", "cnn", "resnet-tiny"):
        model = build_model(name, input_shape=(1, 8, 8), num_classes=3, dtype=dtype)
        x = randn(2, 1, 8, 8, dtype=np.float64 if dtype == "float32" else np.float32)
        y = model.forward(x)  # the other float width is cast to the model's
        assert y.dtype == np.dtype(dtype)
        loss = SoftmaxCrossEntropy()
        loss.forward(y, np.array([0, 2]))
        model.backward(loss.backward())
        for n, p in model.named_parameters():
            assert p.data.dtype == np.dtype(dtype) and p.grad.dtype == np.dtype(dtype), n


def test_uint8_images_are_cast():
    y = Conv2d(1, 2, 3).forward(np.zeros((1, 1, 5, 5), np.uint8))
    assert y.dtype == np.float32


# -- losses and metrics

def test_softmax_cross_entropy_value_and_errors():
    logits = randn(4, 3)
    labels = np.array([0, 2, 1, 2])
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    loss = SoftmaxCrossEntropy()
    assert loss.forward(logits, labels) == pytest.approx(-np.log(p[range(4), labels]).mean())
    assert loss.correct(logits, labels) == accuracy(logits, labels)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 2\] for 3 classes, got label 3"):
        loss.forward(logits, np.array([0, 1, 2, 3]))
    with pytest.raises(ShapeError, match="expects 4 integer labels"):
        loss.forward(logits, np.array([0, 1]))
    with pytest.raises(ValueError, match="integer class indices"):
        loss.forward(logits, np.zeros(4))
    with pytest.raises(RuntimeError, match="before forward"):
        SoftmaxCrossEntropy().backward()


def test_mse_and_metrics():
    a, b = randn(3, 2), randn(3, 2, seed=1)
    loss = MSELoss()
    assert loss.forward(a, b) == pytest.approx(((a - b) ** 2).mean())
    np.testing.assert_allclose(loss.backward(), 2 * (a - b) / a.size)
    with pytest.raises(ShapeError):
        loss.forward(a, b[:2])
    logits = np.array([[0.1, 0.5, 0.4], [0.9, 0.05, 0.05]])
    assert accuracy(logits, np.array([1, 1])) == 1
    assert top_k_correct(logits, np.array([2, 1]), k=2) == 2
    assert top_k_correct(logits, np.array([0, 1]), k=1) == 0


# -- GPU (CuPy against NumPy)

def _cupy():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    return cp


def _to_gpu(layer, cp):
    for _, p in layer.named_parameters():
        p.data = cp.asarray(p.data)
    for name, b in layer.named_buffers():
        layer.set_buffer(name, cp.asarray(b))
    return layer


GPU_CASES = [
    ("linear", lambda: Linear(6, 4, rng=1, dtype="float64"), (5, 6)),
    ("conv", lambda: Conv2d(3, 4, 3, stride=2, padding=1, rng=1, dtype="float64"), (2, 3, 7, 6)),
    ("maxpool", lambda: MaxPool2d(3, 2, 1), (2, 3, 7, 6)),
    ("avgpool", lambda: AvgPool2d(2), (2, 3, 6, 6)),
    ("bn2d", lambda: BatchNorm2d(3, dtype="float64"), (4, 3, 3, 3)),
    ("layernorm", lambda: LayerNorm(6, dtype="float64"), (3, 6)),
    ("gelu", lambda: GELU(), (3, 6)),
    ("dropout", lambda: Dropout(0.5, seed=2), (4, 6)),
    ("block", lambda: basic_block(3, 4, 2, rng=1, dtype="float64"), (2, 3, 6, 6)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,make,shape", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_cpu(name, make, shape):
    cp = _cupy()
    cpu, gpu = make(), _to_gpu(make(), cp)
    x = randn(*shape)
    y = cpu.forward(x)
    yg = gpu.forward(cp.asarray(x))
    assert isinstance(yg, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(yg), y, rtol=1e-10, atol=1e-12)
    dy = randn(*y.shape, seed=4)
    dx = cpu.backward(dy.copy())
    dxg = gpu.backward(cp.asarray(dy))
    np.testing.assert_allclose(cp.asnumpy(dxg), dx, rtol=1e-10, atol=1e-12)
    for (n, p), (_, pg) in zip(cpu.named_parameters(), gpu.named_parameters()):
        np.testing.assert_allclose(cp.asnumpy(pg.grad), p.grad, rtol=1e-10, atol=1e-12, err_msg=n)


@pytest.mark.gpu
def test_gpu_embedding_and_loss():
    cp = _cupy()
    emb = _to_gpu(Embedding(10, 3, rng=0, dtype="float64"), cp)
    ids = cp.asarray([[1, 2], [2, 9]])
    y = emb.forward(ids)
    emb.backward(cp.ones_like(y))
    dense = cp.asnumpy(emb.weight.grad.to_dense())
    assert dense[2, 0] == 2 and dense[9, 0] == 1 and dense[0, 0] == 0
    logits = randn(4, 3)
    labels = np.array([0, 2, 1, 2])
    cpu_loss, gpu_loss = SoftmaxCrossEntropy(), SoftmaxCrossEntropy()
    assert gpu_loss.forward(cp.asarray(logits), cp.asarray(labels)) == pytest.approx(
        cpu_loss.forward(logits, labels), rel=1e-12)
    np.testing.assert_allclose(cp.asnumpy(gpu_loss.backward()), cpu_loss.backward(), rtol=1e-12)

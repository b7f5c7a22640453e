"""The model zoo: names, shapes, determinism, errors, and that training lowers the loss."""

import numpy as np
import pytest

from mpidl.backend import to_numpy
from mpidl.engine import (
    MODEL_DEFAULTS, MODELS, SGD, SoftmaxCrossEntropy, accuracy, build_model, make_optimizer,
    make_schedule,
)


#: models over token ids (N, T) rather than images (N, C, H, W)
TEXT_MODELS = {"gpt-tiny"}


def input_shape(name, image=(1, 28, 28)):
    return (16,) if name in TEXT_MODELS else image


@pytest.mark.parametrize("name", sorted(MODELS))
def test_builds_and_runs(name):
    model = build_model(name, input_shape=input_shape(name))
    if name in TEXT_MODELS:
        y = model.forward(np.zeros((3, 16), np.int64))
        assert y.shape == (3, 16, 10) and y.dtype == np.float32
    else:
        y = model.forward(np.zeros((3, 1, 28, 28), np.float32))
        assert y.shape == (3, 10) and y.dtype == np.float32
    assert model.needs_input_grad is False


def test_mlp_layout_and_names():
    model = build_model("mlp")
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    assert shapes == [("1.weight", (784, 1024)), ("1.bias", (1024,)),
                      ("3.weight", (1024, 1024)), ("3.bias", (1024,)),
                      ("5.weight", (1024, 10)), ("5.bias", (10,))]


def test_cnn_names_are_stable():
    names = [n for n, _ in build_model("cnn").named_parameters()]
    assert names == ["0.weight", "1.weight", "1.bias", "4.weight", "5.weight", "5.bias",
                     "9.weight", "9.bias", "11.weight", "11.bias"]
    buffers = [n for n, _ in build_model("cnn").named_buffers()]
    assert buffers == ["1.running_mean", "1.running_var", "5.running_mean", "5.running_var"]
    with_dropout = build_model("cnn", dropout=0.25)
    assert [n for n, _ in with_dropout.named_buffers()][-1] == "11.calls"
    assert [n for n, _ in with_dropout.named_parameters()][-1] == "12.bias"


def test_resnet_uses_residual_blocks():
    names = [n for n, _ in build_model("resnet-tiny").named_parameters()]
    assert "4.body.0.weight" in names and "5.shortcut.0.weight" in names
    assert "4.shortcut.0.weight" not in names  # the first block keeps its width: identity


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_seed_same_model(name):
    shape = input_shape(name)
    a = build_model(name, seed=5, input_shape=shape)
    b = build_model(name, seed=5, input_shape=shape)
    c = build_model(name, seed=6, input_shape=shape)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(to_numpy(pa.data), to_numpy(pb.data))
    assert any(not np.array_equal(pa.data, pc.data)
               for pa, pc in zip(a.parameters(), c.parameters()))


def test_float64_has_the_float32_values_rounded():
    a, b = build_model("mlp", dtype="float32"), build_model("mlp", dtype="float64")
    for pa, pb in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(pa.data, pb.data.astype(np.float32))


def test_errors():
    with pytest.raises(ValueError, match="unknown model 'vgg': expected one of mlp, cnn, "
                                         "resnet-tiny"):
        build_model("vgg")
    with pytest.raises(ValueError, match="does not take option"):
        build_model("mlp", widths=3)
    with pytest.raises(ValueError, match=r"needs input_shape \(channels, height, width\)"):
        build_model("cnn", input_shape=(784,))
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        build_model("mlp", dtype="float16")


def test_other_input_shapes_and_options():
    model = build_model("cnn", input_shape=(3, 32, 32), num_classes=100, dropout=0.0,
                        channels=(8, 16), hidden=32)
    assert model.forward(np.zeros((2, 3, 32, 32), np.float32)).shape == (2, 100)
    mlp = build_model("mlp", input_shape=(64,), hidden=(16,), dropout=0.2)
    assert mlp.forward(np.zeros((2, 64), np.float32)).shape == (2, 10)


def test_model_defaults_cover_every_model():
    assert set(MODEL_DEFAULTS) == set(MODELS)
    for name, d in MODEL_DEFAULTS.items():
        model = build_model(name, input_shape=input_shape(name, (1, 8, 8)))
        kwargs = {"lr": d["lr"], "weight_decay": d["weight_decay"]}
        if d["optimizer"] == "sgd":
            kwargs.update(momentum=d["momentum"], nesterov=d["nesterov"])
        make_optimizer(d["optimizer"], model.named_parameters(), **kwargs)
        make_schedule(d["schedule"], d["lr"], 100)


def synthetic(n=256, shape=(1, 8, 8), classes=4, seed=0):
    """Classes that differ by a fixed random pattern plus noise: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    patterns = rng.standard_normal((classes,) + shape).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = patterns[y] + 0.5 * rng.standard_normal((n,) + shape).astype(np.float32)
    return x, y


@pytest.mark.parametrize("name,steps", [("mlp", 30), ("cnn", 30), ("resnet-tiny", 30)])
def test_training_lowers_the_loss(name, steps):
    x, y = synthetic()
    model = build_model(name, input_shape=(1, 8, 8), num_classes=4, seed=1)
    opt = SGD(model.named_parameters(), lr=0.05, momentum=0.9)
    loss = SoftmaxCrossEntropy()
    losses = []
    for step in range(steps):
        idx = np.arange(step * 32, step * 32 + 32) % len(y)
        opt.zero_grad()
        losses.append(loss.forward(model.forward(x[idx]), y[idx]))
        model.backward(loss.backward())
        opt.step()
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    model.eval()
    assert accuracy(model.forward(x), y) > 0.9 * len(y)


@pytest.mark.gpu
def test_gpu_model_matches_cpu():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    from mpidl import backend

    x, y = synthetic(n=16)
    cpu = build_model("cnn", input_shape=(1, 8, 8), num_classes=4, seed=2, dtype="float64")
    backend.use("gpu")
    try:
        gpu = build_model("cnn", input_shape=(1, 8, 8), num_classes=4, seed=2, dtype="float64")
    finally:
        backend.use("cpu")
    for pc, pg in zip(cpu.parameters(), gpu.parameters()):  # same seed: same weights, bitwise
        assert isinstance(pg.data, cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(pg.data), pc.data)
    opts = [SGD(m.named_parameters(), lr=0.05, momentum=0.9) for m in (cpu, gpu)]
    for model, opt, xs, ys in ((cpu, opts[0], x, y), (gpu, opts[1], cp.asarray(x), cp.asarray(y))):
        loss = SoftmaxCrossEntropy()
        for _ in range(3):
            opt.zero_grad()
            loss.forward(model.forward(xs), ys)
            model.backward(loss.backward())
            opt.step()
    for (n, pc), (_, pg) in zip(cpu.named_parameters(), gpu.named_parameters()):
        np.testing.assert_allclose(cp.asnumpy(pg.data), pc.data, rtol=1e-9, atol=1e-11, err_msg=n)

"""CUDA-graph replay of a training step (``mpidl.engine.cuda_graph``) and the fused GPU
kernels it replays (``mpidl.engine._fused_gpu``): bitwise the eager step's results.

The GPU tests skip without CuPy and a CUDA device; the CPU tests check what a machine
without one sees (an eager step and the reason why nothing was captured).
"""

import numpy as np
import pytest

from mpidl import backend
from mpidl.engine import SGD, Adam, AdamW, SoftmaxCrossEntropy, build_model
from mpidl.engine.cuda_graph import GraphedStep

HAS_GPU = backend.gpu_count() > 0


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


def _setup(name, opt="sgd", **model_options):
    model = build_model(name, seed=3, **model_options)
    if opt == "sgd":
        optimizer = SGD(model.named_parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    elif opt == "adam":
        optimizer = Adam(model.named_parameters(), lr=1e-3, weight_decay=1e-4)
    else:
        optimizer = AdamW(model.named_parameters(), lr=1e-3, weight_decay=1e-2)
    return model, SoftmaxCrossEntropy(), optimizer


def _eager(model, loss, optimizer, x, y):
    optimizer.zero_grad()
    value = loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    optimizer.step()
    return value


def _steps_agree(cp, graphed, ref_model, ref_loss, ref_opt, batches):
    """Each batch through ``graphed`` and through eager steps of the reference: the same
    losses, step by step."""
    for x, y in batches:
        got = float(graphed(cp.asarray(x), cp.asarray(y)))
        assert got == _eager(ref_model, ref_loss, ref_opt, cp.asarray(x), cp.asarray(y))


def _state(model, optimizer):
    out = {k: backend.to_numpy(v).copy() for k, v in model.state_dict().items()}
    for name, st in optimizer.state.items():
        for slot, v in st.items():
            out[f"opt.{name}.{slot}"] = v if isinstance(v, int) else backend.to_numpy(v).copy()
    return out


def _assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], int):
            assert a[k] == b[k], k
        else:
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def test_without_a_gpu_it_steps_eagerly_and_says_why():
    if HAS_GPU:
        pytest.skip("this machine has a GPU")
    backend.use("cpu")
    x, y = _batch(16)
    model, loss, opt = _setup("mlp")
    ref_model, ref_loss, ref_opt = _setup("mlp")
    graphed = GraphedStep(model, loss, opt)
    assert not graphed.captured
    assert graphed.reason  # no CuPy, or parameters not on the GPU
    for _ in range(3):
        got = float(graphed(x, y))
        assert got == _eager(ref_model, ref_loss, ref_opt, x, y)
    _assert_bitwise(_state(model, opt), _state(ref_model, ref_opt))
    assert "eager" in repr(graphed)


def test_forward_array_is_forward_without_the_wait():
    logits = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    labels = np.array([0, 4, 2, 1, 3, 3, 0])
    a, b = SoftmaxCrossEntropy(), SoftmaxCrossEntropy()
    value = a.forward_array(logits, labels)
    assert value.shape == () and float(value) == b.forward(logits, labels)
    assert np.array_equal(a.backward(), b.backward())
    with pytest.raises(ValueError, match="labels must be in"):
        a.forward_array(logits, labels + 1)


# ---------------------------------------------------------------- on a GPU

@pytest.fixture
def on_gpu():
    backend.use("gpu")
    yield backend.cupy_module()
    backend.use("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("name,opt_name", [("mlp", "sgd"), ("cnn", "sgd"),
                                           ("resnet-tiny", "sgd"), ("mlp", "adam"),
                                           ("cnn", "adamw")])
def test_replays_equal_eager_steps_bitwise(on_gpu, name, opt_name):
    """Warm-up, capture, replays with a learning rate that changes every step, one batch
    of another shape (eager) in between: the same parameters, optimizer state and
    BatchNorm statistics, bit for bit, as plain eager steps (Adam's bias correction too)."""
    cp = on_gpu
    model, loss, opt = _setup(name, opt_name)
    ref_model, ref_loss, ref_opt = _setup(name, opt_name)
    graphed = GraphedStep(model, loss, opt, warmup=2)
    assert graphed.reason is None, graphed.reason
    losses, ref_losses = [], []
    for step in range(8):
        x, y = _batch(8 if step == 5 else 32, seed=step)
        lr = 0.05 * (1 - step / 10)
        opt.lr = ref_opt.lr = lr
        losses.append(float(graphed(cp.asarray(x), cp.asarray(y))))
        ref_losses.append(_eager(ref_model, ref_loss, ref_opt, cp.asarray(x), cp.asarray(y)))
    assert graphed.captured, graphed.reason
    assert graphed.replays == 5 and graphed.eager_steps == 3  # 2 warm-up, 1 odd shape
    assert losses == ref_losses
    _assert_bitwise(_state(model, opt), _state(ref_model, ref_opt))
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert np.array_equal(p.grad.get(), q.grad.get()), n


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
def test_a_step_that_waits_is_not_captured_and_stays_exact(on_gpu):
    cp = on_gpu
    model, loss, opt = _setup("mlp", dropout=0.25)  # Dropout reads its call counter
    ref_model, ref_loss, ref_opt = _setup("mlp", dropout=0.25)
    graphed = GraphedStep(model, loss, opt, warmup=1)
    _steps_agree(cp, graphed, ref_model, ref_loss, ref_opt, [_batch(16, seed=s) for s in range(4)])
    assert not graphed.captured and "cannot be captured" in graphed.reason
    _assert_bitwise(_state(model, opt), _state(ref_model, ref_opt))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
def test_adam_with_uneven_update_counts_gives_up_and_stays_exact(on_gpu):
    """One scalar set serves every parameter: when their Adam update counts differ (a
    state loaded that way), the step runs eagerly, with values passed as before."""
    cp = on_gpu
    model, loss, opt = _setup("mlp", "adam")
    ref_model, ref_loss, ref_opt = _setup("mlp", "adam")
    x, y = _batch(8)
    for o, m in ((opt, model), (ref_opt, ref_model)):
        _eager(m, loss, o, cp.asarray(x), cp.asarray(y))
        first = next(iter(o.state))
        o.state[first]["step"] += 3
    graphed = GraphedStep(model, loss, opt)
    _steps_agree(cp, graphed, ref_model, ref_loss, ref_opt, [_batch(8, seed=s) for s in (1, 2, 3)])
    assert not graphed.captured and "update counts differ" in graphed.reason
    _assert_bitwise(_state(model, opt), _state(ref_model, ref_opt))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("kind", ["sgd", "nesterov", "adam", "adamw"])
def test_fused_gpu_update_equals_the_array_sequence_bitwise(on_gpu, kind):
    cp = on_gpu
    from mpidl.engine import AdamW
    from mpidl.engine.module import Parameter

    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(1000).astype(np.float32)
    results = []
    for fused in (None, False):
        p = Parameter(cp.asarray(p0))
        params = [("w", p)]
        opt = {"sgd": lambda: SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=fused),
               "nesterov": lambda: SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                       fused=fused),
               "adam": lambda: Adam(params, lr=1e-2, weight_decay=1e-3, fused=fused),
               "adamw": lambda: AdamW(params, lr=1e-2, weight_decay=1e-2, fused=fused)}[kind]()
        for step in range(5):
            p.grad = cp.asarray(np.random.default_rng(step).standard_normal(1000)
                                .astype(np.float32))
            opt.step()
        results.append(p.data.get())
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (64, 10), (7, 100)])
def test_fused_softmax_cross_entropy_matches_numpy(on_gpu, dtype, shape):
    cp = on_gpu
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal(shape) * 20).astype(dtype)
    labels = rng.integers(0, shape[1], shape[0])
    ref = SoftmaxCrossEntropy()
    want = ref.forward(logits, labels)
    want_grad = ref.backward()
    loss = SoftmaxCrossEntropy()
    got = loss.forward(cp.asarray(logits), cp.asarray(labels))
    got_grad = loss.backward().get()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert abs(got - want) <= tol * max(1.0, abs(want))
    np.testing.assert_allclose(got_grad, want_grad, rtol=tol * 10, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_equals_cupy_matmul_for_every_layout(on_gpu, dtype):
    """mpidl's own cuBLAS call (capturable) against CuPy's ``@``: C and F order, strided
    row views, a transposed slice, empty and k = 0 products."""
    cp = on_gpu
    from mpidl.engine.gemm import matmul

    rng = np.random.default_rng(4)
    big = cp.asarray(rng.standard_normal((40, 50)).astype(dtype))
    cases = [(big[:7, :9], big[:9, :5]), (big[:7, :9].T, big[:7, :3]),
             (cp.asfortranarray(big[:6, :8]), big[:8, :4].T.copy().T),
             (big[:5, 3:11], big[10:18, 2:6]), (big[::2, :6], big[:6, ::3]),
             (big[:0, :4], big[:4, :3]), (big[:3, :0], big[:0, :2]), (big[:1, :1], big[:1, :1])]
    for a, b in cases:
        got, want = matmul(a, b), a @ b
        assert got.shape == want.shape and got.flags.c_contiguous
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got.get(), want.get(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="do not align"):
        matmul(big[:3, :4], big[:5, :2])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 3), (300, 32), (100352, 32), (513, 1000)])
def test_column_sums_match_numpy(on_gpu, rows, cols):
    cp = on_gpu
    from mpidl.engine._fused_gpu import column_sums

    rng = np.random.default_rng(5)
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    b = rng.standard_normal((rows, cols)).astype(np.float32)
    np.testing.assert_allclose(column_sums(cp.asarray(a)).get(),
                               a.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(column_sums(cp.asarray(a), cp.asarray(b)).get(),
                               (a.astype(np.float64) * b).sum(axis=0), rtol=1e-4, atol=1e-3)
    again = column_sums(cp.asarray(a))  # the same order every time: the same bits
    assert column_sums(cp.asarray(a)).tobytes() == again.tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 0)])
def test_maxpool_kernels_equal_the_array_sequence_bitwise(on_gpu, kernel, stride, padding):
    """The GPU kernels against MaxPool2d's own array path run on the host (ties and NaN
    included): the same outputs, argmax and input gradients, bit for bit."""
    cp = on_gpu
    from mpidl.engine.pooling import MaxPool2d

    rng = np.random.default_rng(6)
    x = rng.integers(-3, 4, (2, 3, 7, 6)).astype(np.float32)  # many ties
    x[0, 1, 2, 3] = np.nan
    dy_shape = None
    outs = []
    for xp_x in (x, cp.asarray(x)):
        layer = MaxPool2d(kernel, stride=stride, padding=padding)
        layer.needs_input_grad = True
        y = layer.forward(xp_x)
        dy_shape = y.shape
        dy = np.random.default_rng(7).standard_normal(dy_shape).astype(np.float32)
        dx = layer.backward(dy if xp_x is x else cp.asarray(dy))
        outs.append((backend.to_numpy(y), backend.to_numpy(dx)))
    (y0, dx0), (y1, dx1) = outs
    assert np.ascontiguousarray(y0).tobytes() == np.ascontiguousarray(y1).tobytes()
    assert np.ascontiguousarray(dx0).tobytes() == np.ascontiguousarray(dx1).tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_batchnorm_equals_the_array_sequence_bitwise(on_gpu, affine, dtype):
    """BatchNorm2d's two-launch GPU forward and backward against its array sequence on
    the same device: outputs, input gradients, parameter gradients and running statistics
    bit for bit, over three steps."""
    cp = on_gpu
    from mpidl.engine import _fused_gpu
    from mpidl.engine.normalization import BatchNorm2d

    runs = []
    for fused in (True, False):
        _fused_gpu.enabled = fused
        try:
            bn = BatchNorm2d(5, affine=affine, dtype=dtype)
            for _, p in bn.named_parameters():
                p.data = cp.asarray(p.data)
            for name, b in bn.named_buffers():
                bn.set_buffer(name, cp.asarray(b))
            if affine:
                bn.weight.data[...] = cp.asarray(np.linspace(0.5, 1.5, 5))
                bn.bias.data[...] = cp.asarray(np.linspace(-1, 1, 5))
            bn.needs_input_grad = True
            out = []
            for step in range(3):
                r = np.random.default_rng(step)
                x = cp.asarray((r.standard_normal((4, 5, 6, 7)) * 3 + 1).astype(dtype))
                dy = cp.asarray(r.standard_normal((4, 5, 6, 7)).astype(dtype))
                bn.zero_grad()
                y = bn.forward(x)
                dx = bn.backward(dy)
                out += [y, dx] + [p.grad for _, p in bn.named_parameters()] + [
                    b for _, b in bn.named_buffers()]
            runs.append([np.ascontiguousarray(a.get()).tobytes() for a in out])
        finally:
            _fused_gpu.enabled = True
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
@pytest.mark.parametrize("nesterov,momentum,wd", [(False, 0.9, 5e-4), (True, 0.9, 0.0),
                                                  (False, 0.0, 1e-3)])
def test_one_launch_sgd_equals_the_array_sequence_bitwise(on_gpu, nesterov, momentum, wd):
    """SGD.step over every parameter of a model in one launch against the array sequence
    per parameter, over three steps."""
    cp = on_gpu
    results = []
    for fused in (None, False):
        model = build_model("cnn", seed=1)
        opt = SGD(model.named_parameters(), lr=0.05, momentum=momentum, nesterov=nesterov,
                  weight_decay=wd, fused=fused)
        for step in range(3):
            for name, p in model.named_parameters():
                p.grad = cp.asarray(np.random.default_rng(step).standard_normal(p.shape)
                                    .astype(np.float32))
            opt.step()
        results.append(_state(model, opt))
    _assert_bitwise(results[0], results[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a GPU")
def test_trainer_with_cuda_graph_equals_eager_training_bitwise(on_gpu):
    """``--cuda-graph`` (the local runtime's option) through the Trainer: an epoch of
    replayed steps gives the eager run's parameters, optimizer state and BatchNorm
    statistics bit for bit, with the trainer's learning-rate schedule."""
    from mpidl.benchmarks.scaling import random_dataset
    from mpidl.runtime import build
    from mpidl.training.trainer import Trainer

    results = []
    for graph in (False, True):
        model = build_model("cnn", seed=2)
        opt = SGD(model.named_parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        runtime = build("local", cuda_graph=graph)
        data = random_dataset(64, 1, 12)
        Trainer(model, opt, data, runtime=runtime, epochs=1, batch_size=64, lr=0.05,
                schedule="cosine", seed=0, progress=False,
                eval_batch_size=len(data.test_y)).fit()
        if graph:
            assert runtime.graph.captured, runtime.graph.reason
            assert runtime.graph.replays >= 8
        results.append(_state(model, opt))
    _assert_bitwise(results[0], results[1])

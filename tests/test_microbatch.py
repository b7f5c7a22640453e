"""Micro-batch safety of the engine: per-call contexts, accumulation, hooks, placement.

The central check: for every layer type (float64), two micro-batches forwarded under keys
0 and 1 and then backpropagated in *reverse* order give bitwise the same outputs, input
gradients, parameter gradients and buffers as running them one after the other
(forward 0, backward 0, forward 1, backward 1) with accumulation. Two dense gradients add
commutatively, so only a layer that mixed up its micro-batches' contexts can fail.
"""

import numpy as np
import pytest

from mpidl.engine import (
    GELU, SGD, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten,
    GlobalAvgPool2d, Layer, LayerNorm, LeakyReLU, Linear, MaxPool2d, Parameter, Placement,
    ReLU, Reshape, Residual, Sequential, Sigmoid, SoftmaxCrossEntropy, SparseGrad, Tanh,
    basic_block, build_model,
)

F64 = "float64"


def randn(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def _bn(cls, c, train):
    bn = cls(c, dtype=F64)
    bn.weight.data[...] = randn(c, seed=5) + 1
    bn.bias.data[...] = randn(c, seed=6)
    bn.set_buffer("running_mean", randn(c, seed=7))
    bn.set_buffer("running_var", np.abs(randn(c, seed=8)) + 0.5)
    return bn.train(train)


def _stack():
    return Sequential(Conv2d(2, 3, 3, padding=1, rng=1, dtype=F64), BatchNorm2d(3, dtype=F64),
                      ReLU(), MaxPool2d(2), Flatten(), Linear(12, 5, rng=2, dtype=F64),
                      Dropout(0.3, seed=4), GELU(), LayerNorm(5, dtype=F64),
                      Linear(5, 3, rng=3, dtype=F64))


def _nested():
    inner = Sequential(Linear(4, 4, rng=1, dtype=F64), Tanh(), Linear(4, 4, rng=2, dtype=F64))
    return Sequential(Linear(3, 4, rng=3, dtype=F64),
                      Residual(inner, shortcut=Sequential(Linear(4, 4, rng=4, dtype=F64))),
                      Sigmoid(), Linear(4, 2, rng=5, dtype=F64))


# (name, factory, shape of micro-batch 0, shape of micro-batch 1): the batch sizes differ
CASES = [
    ("linear", lambda: Linear(5, 4, rng=1, dtype=F64), (3, 5), (4, 5)),
    ("linear-3d", lambda: Linear(4, 3, bias=False, rng=1, dtype=F64), (2, 3, 4), (1, 3, 4)),
    ("conv", lambda: Conv2d(3, 4, 3, stride=2, padding=1, rng=2, dtype=F64), (2, 3, 7, 6),
     (3, 3, 7, 6)),
    ("conv-1ch", lambda: Conv2d(1, 2, 3, padding=1, bias=False, rng=3, dtype=F64),
     (2, 1, 5, 5), (1, 1, 5, 5)),
    ("bn1d-train", lambda: _bn(BatchNorm1d, 4, True), (6, 4), (5, 4)),
    ("bn1d-3d-train", lambda: _bn(BatchNorm1d, 4, True), (3, 4, 5), (2, 4, 5)),
    ("bn1d-eval", lambda: _bn(BatchNorm1d, 4, False), (6, 4), (5, 4)),
    ("bn2d-train", lambda: _bn(BatchNorm2d, 3, True), (4, 3, 3, 2), (2, 3, 3, 2)),
    ("bn2d-eval", lambda: _bn(BatchNorm2d, 3, False), (4, 3, 3, 2), (2, 3, 3, 2)),
    ("bn2d-no-affine", lambda: BatchNorm2d(2, affine=False, dtype=F64), (3, 2, 2, 2),
     (2, 2, 2, 2)),
    ("layernorm", lambda: LayerNorm((3, 5), dtype=F64), (2, 3, 5), (4, 3, 5)),
    ("maxpool", lambda: MaxPool2d(2), (2, 3, 6, 6), (1, 3, 6, 6)),
    ("maxpool-overlap", lambda: MaxPool2d(3, 2, 1), (2, 3, 7, 6), (3, 3, 7, 6)),
    ("avgpool", lambda: AvgPool2d(3, 2, 1), (2, 3, 7, 6), (1, 3, 7, 6)),
    ("globalavgpool", lambda: GlobalAvgPool2d(), (2, 3, 4, 5), (3, 3, 4, 5)),
    ("relu", lambda: ReLU(), (4, 6), (3, 6)),
    ("leakyrelu", lambda: LeakyReLU(0.1), (4, 6), (3, 6)),
    ("tanh", lambda: Tanh(), (4, 6), (3, 6)),
    ("sigmoid", lambda: Sigmoid(), (4, 6), (3, 6)),
    ("gelu", lambda: GELU(), (4, 6), (3, 6)),
    ("dropout-train", lambda: Dropout(0.4, seed=3), (5, 6), (4, 6)),
    ("dropout-eval", lambda: Dropout(0.4, seed=3).eval(), (5, 6), (4, 6)),
    ("flatten", lambda: Flatten(), (2, 3, 4), (3, 3, 4)),
    ("reshape", lambda: Reshape(4, 3), (2, 3, 4), (3, 3, 4)),
    ("residual-block", lambda: basic_block(3, 4, 2, rng=4, dtype=F64), (2, 3, 6, 6),
     (3, 3, 6, 6)),
    ("residual-identity", lambda: Residual(Sequential(Linear(4, 4, rng=1, dtype=F64), Tanh()),
                                           activation=False), (3, 4), (2, 4)),
    ("sequential", _stack, (2, 2, 4, 4), (3, 2, 4, 4)),
    ("nested", _nested, (3, 3), (4, 3)),
]


def _inputs(shape0, shape1):
    return randn(*shape0, seed=11) * 2 + 0.5, randn(*shape1, seed=12) * 2 + 0.5


def _dy(y, key):
    return np.random.default_rng(100 + key).standard_normal(y.shape)


def _snapshot(layer):
    grads = {n: (None if p.grad is None else np.array(p.grad, copy=True))
             for n, p in layer.named_parameters()}
    buffers = {n: np.array(b, copy=True) for n, b in layer.named_buffers()}
    return grads, buffers


def _one_after_the_other(make, xs):
    layer = make()
    ys, dxs = [], []
    for key, x in enumerate(xs):
        with layer.micro_batch(key):
            y = layer(x)
            ys.append(y.copy())
            dxs.append(layer.backprop(_dy(y, key)))
    return layer, ys, dxs


def _interleaved(make, xs):
    layer = make()
    ys = []
    for key, x in enumerate(xs):
        with layer.micro_batch(key):
            ys.append(layer(x).copy())
    leaves = [m for _, m in layer.modules() if not m.children()]
    assert all(sorted(m._saved) == list(range(len(xs))) for m in leaves)  # all in flight
    dxs = [None] * len(xs)
    for key in reversed(range(len(xs))):
        with layer.micro_batch(key):
            dxs[key] = layer.backprop(_dy(ys[key], key))
    return layer, ys, dxs


@pytest.mark.parametrize("name,make,shape0,shape1", CASES, ids=[c[0] for c in CASES])
def test_reverse_order_backward_is_bitwise_sequential(name, make, shape0, shape1):
    xs = _inputs(shape0, shape1)
    a, ys_a, dxs_a = _one_after_the_other(make, xs)
    b, ys_b, dxs_b = _interleaved(make, xs)
    for k in range(2):
        assert np.array_equal(ys_a[k], ys_b[k]), f"{name}: output of micro-batch {k}"
        assert np.array_equal(dxs_a[k], dxs_b[k]), f"{name}: input gradient of micro-batch {k}"
    (ga, ba), (gb, bb) = _snapshot(a), _snapshot(b)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert ga[n] is not None and np.array_equal(ga[n], gb[n]), f"{name}: gradient of {n}"
    for n in ba:
        assert np.array_equal(ba[n], bb[n]), f"{name}: buffer {n}"
    assert a.activation_nbytes() == 0 and b.activation_nbytes() == 0


@pytest.mark.parametrize("name,make,shape0,shape1", CASES, ids=[c[0] for c in CASES])
def test_accumulated_gradient_is_the_sum_of_the_micro_batches(name, make, shape0, shape1):
    """Against independent runs: the gradient after two micro-batches is exactly the sum
    of each one's gradient alone (and a single micro-batch is today's plain backward)."""
    xs = _inputs(shape0, shape1)
    acc, _, _ = _one_after_the_other(make, xs)
    alone = []
    for key, x in enumerate(xs):
        layer = make()
        if key == 1:  # the second micro-batch alone: same Dropout mask / BN statistics
            layer(xs[0])
            layer.discard_saved()
        y = layer.forward(x)
        layer.backward(_dy(y, key))
        alone.append(_snapshot(layer)[0])
    for n, g in _snapshot(acc)[0].items():
        assert np.array_equal(g, alone[0][n] + alone[1][n]), f"{name}: gradient of {n}"


def _sparse_entries(g):
    """The rows of a SparseGrad as a canonical (sorted) set of (index, values) entries."""
    idx, vals = np.asarray(g.indices), np.asarray(g.values)
    order = np.lexsort(tuple(vals.T[::-1]) + (idx,))
    return idx[order], vals[order]


def test_embedding_with_repeated_ids():
    """Sparse gradients concatenate: both orders hold bitwise the same entries (only their
    order differs; to_dense then sums them in that order, so it agrees to rounding)."""
    ids = [np.array([[1, 3, 3], [6, 0, 1]]), np.array([[3, 3], [2, 1]])]
    a, _, dxs_a = _one_after_the_other(lambda: Embedding(7, 3, rng=1, dtype=F64), ids)
    b, _, dxs_b = _interleaved(lambda: Embedding(7, 3, rng=1, dtype=F64), ids)
    assert dxs_a == dxs_b == [None, None]
    ga, gb = a.weight.grad, b.weight.grad
    assert isinstance(ga, SparseGrad) and isinstance(gb, SparseGrad)
    assert len(ga.indices) == len(gb.indices) == 10
    for ea, eb in zip(_sparse_entries(ga), _sparse_entries(gb)):
        assert np.array_equal(ea, eb)
    np.testing.assert_allclose(ga.to_dense(), gb.to_dense(), rtol=1e-15, atol=1e-15)
    dense = ga.to_dense()
    rows = np.concatenate([i.ravel() for i in ids])
    expect = np.zeros((7, 3))
    for k, i in enumerate(ids):
        np.add.at(expect, i.ravel(), _dy(np.zeros(i.shape + (3,)), k).reshape(-1, 3))
    np.testing.assert_allclose(dense, expect, rtol=1e-14)
    assert set(rows.tolist()) == set(np.nonzero(dense[:, 0])[0].tolist())
    assert a.activation_nbytes() == b.activation_nbytes() == 0


def test_dropout_mask_per_call_and_calls_counter():
    d = Dropout(0.5, seed=2)
    x = np.ones((50, 40))
    with d.micro_batch(0):
        y0 = d(x)
    with d.micro_batch(1):
        y1 = d(x)
    assert int(d.state_dict()["calls"]) == 2  # one per training forward, as before
    assert not np.array_equal(y0 != 0, y1 != 0)
    with d.micro_batch(0):
        dx0 = d.backprop(np.ones_like(x))
    with d.micro_batch(1):
        dx1 = d.backprop(np.ones_like(x))
    np.testing.assert_array_equal(dx0, y0)  # each backward used its own forward's mask
    np.testing.assert_array_equal(dx1, y1)


def test_batchnorm_statistics_move_per_micro_batch_forward():
    xs = [randn(6, 3, seed=1) * 2 + 1, randn(4, 3, seed=2) - 1]
    a, b = BatchNorm1d(3, dtype=F64), BatchNorm1d(3, dtype=F64)
    for x in xs:
        a.forward(x)
        a.backward(np.ones_like(x))
    for key, x in enumerate(xs):
        with b.micro_batch(key):
            b(x)
    mean = 0.9 * (0.1 * xs[0].mean(0)) + 0.1 * xs[1].mean(0)
    np.testing.assert_allclose(b.state_dict()["running_mean"], mean, rtol=1e-14)
    np.testing.assert_array_equal(a.state_dict()["running_var"], b.state_dict()["running_var"])


# -- contexts: default key, overwrite, misuse, memory

def test_plain_calls_use_micro_batch_zero():
    lin = Linear(3, 2, rng=0, dtype=F64)
    x = randn(4, 3)
    lin.forward(x)
    assert list(lin._saved) == [0]
    with lin.micro_batch(0):
        dx = lin.backprop(np.ones((4, 2)))
    assert dx.shape == (4, 3) and lin.activation_nbytes() == 0


def test_micro_batch_keys_nest_and_restore():
    model = _nested()
    with model.micro_batch("a"):
        assert all(m._mb_key == "a" for _, m in model.modules())
        with model.layers[1].micro_batch(7):
            assert model.layers[1].body.layers[0]._mb_key == 7
            assert model.layers[0]._mb_key == "a"
        assert all(m._mb_key == "a" for _, m in model.modules())
    assert all(m._mb_key == 0 for _, m in model.modules())
    with pytest.raises(ZeroDivisionError):
        with model.micro_batch(3):
            1 / 0
    assert all(m._mb_key == 0 for _, m in model.modules())


def test_backward_without_forward_names_the_layer_and_key():
    lin = Linear(3, 2, rng=0, dtype=F64)
    with lin.micro_batch(0):
        lin(randn(4, 3))
    with pytest.raises(RuntimeError) as e:
        with lin.micro_batch(1):
            lin.backprop(np.ones((4, 2)))
    msg = str(e.value)
    assert msg.startswith("Linear(in_features=3, out_features=2): backward of micro-batch 1 "
                          "without its forward")
    assert "forwards waiting for backward: ['0']" in msg and "micro_batch key" in msg
    lin.backward(np.ones((4, 2)))  # key 0 still works
    with pytest.raises(RuntimeError, match="micro-batch 0 without its forward"):
        lin.backward(np.ones((4, 2)))  # ... once
    model = build_model("mlp", input_shape=(4,), hidden=(3,))
    with pytest.raises(RuntimeError, match=r"Linear\(in_features=3, out_features=10\): "
                                           r"backward of micro-batch 0"):
        model.backward(np.ones((2, 10), np.float32))


def test_forward_again_under_a_key_overwrites_its_context():
    lin = Linear(3, 2, rng=0, dtype=F64)
    x = randn(5, 3)
    for _ in range(3):  # evaluation forwards never run backward
        lin(x)
    assert lin.activation_nbytes() == x.nbytes
    lin.backprop(np.ones((5, 2)))
    assert lin.activation_nbytes() == 0


def test_activation_nbytes_counts_shared_memory_once():
    model = Sequential(Linear(6, 8, rng=0, dtype=F64), ReLU(), Linear(8, 2, rng=1, dtype=F64))
    x = randn(5, 6)
    model(x)
    # x for the first Linear; ReLU's output, kept by ReLU and the second Linear: once
    assert model.activation_nbytes() == x.nbytes + 5 * 8 * 8
    with model.micro_batch(1):
        model(x.copy())
    assert model.activation_nbytes() == 2 * (x.nbytes + 5 * 8 * 8)
    with model.micro_batch(2):
        model(x)  # the same input array as micro-batch 0: its memory counts once
    assert model.activation_nbytes() == 2 * x.nbytes + 3 * 5 * 8 * 8
    model.discard_saved(all_keys=True)
    assert model.activation_nbytes() == 0


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet-tiny"])
def test_models_leave_no_activation_after_backward(name):
    """build_model's root needs no input gradient: layers before the first parameter are
    skipped by backward, and their contexts must go too."""
    model = build_model(name, input_shape=(1, 8, 8), num_classes=3, dtype=F64)
    y = model(randn(2, 1, 8, 8))
    assert model.activation_nbytes() > 0
    assert model.backprop(np.ones_like(y)) is None
    assert model.activation_nbytes() == 0


# -- accumulation

def test_accumulate_rules():
    p = Parameter(np.zeros(3))
    g = np.ones(3)
    p.accumulate(g)
    assert p.grad is g  # no copy: one micro-batch is bitwise today's result
    p.accumulate(np.full(3, 2.0))
    assert p.grad is g and np.array_equal(g, [3, 3, 3])  # in place
    p.grad = None
    e = Parameter(np.zeros((4, 2)))
    e.accumulate(SparseGrad(np.array([1, 3]), np.ones((2, 2)), (4, 2)))
    e.accumulate(SparseGrad(np.array([3]), np.full((1, 2), 2.0), (4, 2)))
    assert isinstance(e.grad, SparseGrad)
    np.testing.assert_array_equal(e.grad.indices, [1, 3, 3])
    np.testing.assert_array_equal(e.grad.to_dense()[:, 0], [0, 1, 0, 3])
    e.accumulate(np.ones((4, 2)))  # mixed: dense
    np.testing.assert_array_equal(e.grad[:, 0], [1, 2, 1, 4])
    e.accumulate(SparseGrad(np.array([0, 0]), np.ones((2, 2)), (4, 2)))
    np.testing.assert_array_equal(e.grad[:, 0], [3, 2, 1, 4])


def test_zero_grad_drops_gradients_and_backward_accumulates_until_then():
    lin = Linear(3, 2, rng=0, dtype=F64)
    x = randn(4, 3)
    opt = SGD(lin.named_parameters(), lr=0.1)
    lin(x)
    lin.backward(np.ones((4, 2)))
    once = lin.weight.grad.copy()
    lin(x)
    lin.backward(np.ones((4, 2)))
    assert np.array_equal(lin.weight.grad, 2 * once)
    lin.zero_grad()
    assert lin.weight.grad is None and lin.bias.grad is None
    lin(x)
    lin.backward(np.ones((4, 2)))
    opt.zero_grad()
    assert lin.weight.grad is None


def test_whole_model_micro_batches_equal_the_full_batch():
    """Gradient accumulation: two halves with their losses scaled by 1/2 each give the
    gradient of the whole batch (to rounding: the sums are associated differently)."""
    x, labels = randn(8, 1, 8, 8), np.arange(8) % 3
    full, parts = (build_model("cnn", input_shape=(1, 8, 8), num_classes=3, dtype=F64,
                               channels=(4,), hidden=8) for _ in range(2))
    for bn in (m for model in (full, parts) for _, m in model.modules()
               if isinstance(m, BatchNorm2d)):
        bn.eval()  # per-micro-batch statistics would differ from the full batch's
    loss = SoftmaxCrossEntropy()
    loss.forward(full(x), labels)
    full.backprop(loss.backward())
    outs = []
    for key in (0, 1):
        with parts.micro_batch(key):
            outs.append(parts(x[4 * key:4 * key + 4]))
    for key in (1, 0):
        with parts.micro_batch(key):
            loss.forward(outs[key], labels[4 * key:4 * key + 4])
            parts.backprop(loss.backward() * 0.5)
    for (n, pf), (_, pp) in zip(full.named_parameters(), parts.named_parameters()):
        np.testing.assert_allclose(pp.grad, pf.grad, rtol=1e-11, atol=1e-13, err_msg=n)


# -- hooks

def _hook_root_cases():
    return [(name, make, s0) for name, make, s0, _ in CASES]


@pytest.mark.parametrize("name,make,shape", _hook_root_cases(), ids=[c[0] for c in CASES])
def test_hooks_fire_on_every_layer_type(name, make, shape):
    layer = make()
    seen = []
    layer.add_grad_ready_hook(seen.append)
    y = layer(randn(*shape, seed=3))
    layer.backprop(np.ones_like(y))
    fired = [n for names in seen for n in names]
    assert sorted(fired) == sorted(n for n, _ in layer.named_parameters()), name
    assert len(fired) == len(set(fired))  # each name once per pass
    seen.clear()
    y = layer(randn(*shape, seed=4))
    layer.backprop(np.ones_like(y))
    assert sorted(n for names in seen for n in names) == sorted(fired)  # again next pass


def test_embedding_hook():
    emb = Embedding(5, 2, rng=0)
    seen = []
    emb.add_grad_ready_hook(seen.append)
    emb.backprop(np.ones_like(emb(np.array([1, 1, 4]))))
    assert seen == [["weight"]]


def test_hooks_in_nested_containers_fire_in_backward_order():
    model = _nested()
    seen = []
    model.add_grad_ready_hook(seen.append)
    model.backprop(np.ones_like(model(randn(3, 3))))
    assert seen == [["3.weight", "3.bias"], ["1.shortcut.0.weight", "1.shortcut.0.bias"],
                    ["1.body.2.weight", "1.body.2.bias"], ["1.body.0.weight", "1.body.0.bias"],
                    ["0.weight", "0.bias"]]
    inner = []  # a hook on a sub-tree names relative to it
    model.layers[1].add_grad_ready_hook(inner.append)
    seen.clear()
    model.backprop(np.ones_like(model(randn(3, 3))))
    assert inner == [["shortcut.0.weight", "shortcut.0.bias"], ["body.2.weight", "body.2.bias"],
                     ["body.0.weight", "body.0.bias"]]
    assert len(seen) == 5


class Affine(Layer):
    """A user-written layer with its own parameters: ``y = x * scale + shift``."""

    def __init__(self, n):
        super().__init__()
        self.scale = self.add_param("scale", np.linspace(0.5, 1.5, n))
        self.shift = self.add_param("shift", np.zeros(n))

    def forward(self, x):
        self.save_for_backward(x)
        return x * self.scale.data + self.shift.data

    def backward(self, dy):
        (x,) = self.saved_for_backward()
        self.scale.accumulate((dy * x).sum(axis=0))
        self.shift.accumulate(dy.sum(axis=0))
        return dy * self.scale.data


def test_hook_on_a_user_layer_used_as_the_root():
    layer = Affine(3)
    seen = []
    layer.add_grad_ready_hook(seen.append)
    layer.backprop(np.ones_like(layer(randn(4, 3))))
    assert seen == [["scale", "shift"]]
    layer.backward(np.ones_like(layer(randn(4, 3))))  # plain backward: no hooks
    assert len(seen) == 1


class DirectContainer(Layer):
    """A user container that calls its children's forward/backward directly."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = list(layers)

    def children(self):
        return [(str(i), m) for i, m in enumerate(self.layers)]

    def forward(self, x):
        for m in self.layers:
            x = m.forward(x)
        return x

    def backward(self, dy):
        for m in reversed(self.layers):
            dy = m.backward(dy)
        return dy


def test_a_container_calling_backward_directly_trains_but_its_hooks_stay_silent():
    def make():
        return Sequential(Linear(3, 4, rng=1, dtype=F64),
                          DirectContainer(Tanh(), Linear(4, 2, rng=2, dtype=F64)))

    hooked, plain = make(), make()
    seen = []
    hooked.add_grad_ready_hook(seen.append)
    x = randn(5, 3)
    for model in (hooked, plain):
        model.backprop(np.ones_like(model(x)))
    for (n, a), (_, b) in zip(hooked.named_parameters(), plain.named_parameters()):
        assert np.array_equal(a.grad, b.grad), n
    assert seen == [["0.weight", "0.bias"]]  # "1.1.*" are computed, but not announced


def _tied():
    a, b = Linear(4, 4, rng=1, dtype=F64), Linear(4, 4, rng=2, dtype=F64)
    b.weight = b._params["weight"] = a.weight  # weight tying: one Parameter, two users
    return Sequential(a, Tanh(), b)


def test_tied_weights_fire_once_after_the_last_user():
    model = _tied()
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.bias"]
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.bias"]
    seen = []
    model.add_grad_ready_hook(seen.append)
    x = randn(3, 4)
    for _ in range(2):  # the count re-arms itself for the next pass
        seen.clear()
        model.zero_grad()
        model.backprop(np.ones_like(model(x)))
        assert seen == [["2.bias"], ["0.weight", "0.bias"]]
    # the tied gradient is the sum of both users' gradients
    a, b = Linear(4, 4, rng=1, dtype=F64), Linear(4, 4, rng=2, dtype=F64)
    b.weight.data[...] = a.weight.data
    untied = Sequential(a, Tanh(), b)
    untied.backprop(np.ones_like(untied(x)))
    assert np.array_equal(model.layers[0].weight.grad, b.weight.grad + a.weight.grad)


def test_tied_weights_across_micro_batches_fire_per_pass():
    model = _tied()
    seen = []
    model.add_grad_ready_hook(lambda names: seen.append(tuple(names)))
    outs = []
    for key in (0, 1):
        with model.micro_batch(key):
            outs.append(model(randn(3, 4, seed=key)))
    for key in (1, 0):
        with model.micro_batch(key):
            model.backprop(np.ones_like(outs[key]))
    assert seen == [("2.bias",), ("0.weight", "0.bias")] * 2


def test_sequential_hook_api_unchanged_for_data_parallelism():
    model = build_model("mlp", input_shape=(6,), hidden=(5, 4), num_classes=3)
    seen = []
    model.add_grad_ready_hook(seen.append)
    model.backward(np.ones_like(model(np.ones((2, 6), np.float32))))
    assert seen == [["5.weight", "5.bias"], ["3.weight", "3.bias"], ["1.weight", "1.bias"]]


def test_hook_rejects_a_non_callable():
    with pytest.raises(TypeError, match="needs a callable"):
        Linear(2, 2).add_grad_ready_hook("names")


# -- placement

def test_placement_constructors_and_repr():
    assert Placement() == Placement.replicated() == Placement.replicated("dp")
    s = Placement.sharded("tp", dim=1, index=2, count=4)
    assert (s.kind, s.axis, s.dim, s.index, s.count) == ("sharded", "tp", 1, 2, 4)
    assert repr(s) == "Placement.sharded('tp', dim=1, index=2, count=4)"
    assert repr(Placement.owned(3)) == "Placement.owned(3, axis='world')"
    assert repr(Placement.replicated("dp")) == "Placement.replicated('dp')"
    assert hash(s) == hash(Placement.sharded("tp", 1, 2, 4))
    with pytest.raises(AttributeError):
        s.dim = 0  # frozen


@pytest.mark.parametrize("make,message", [
    (lambda: Placement("mirrored"), "kind must be one of replicated, sharded, owned"),
    (lambda: Placement.replicated(""), "axis must be a mesh axis name"),
    (lambda: Placement.sharded("tp", 0, 4, 4), "index must be < count, got index 4 of count 4"),
    (lambda: Placement.sharded("tp", -1, 0, 2), "dim must be an int >= 0, got -1"),
    (lambda: Placement.sharded("tp", 0, 0, 0), "count must be an int >= 1"),
    (lambda: Placement.sharded("tp", 0, True, 2), "index must be an int"),
    (lambda: Placement.owned(-1), "rank must be an int >= 0"),
    (lambda: Placement("replicated", "dp", dim=0), "a replicated Placement takes no dim"),
    (lambda: Placement("owned", "pp", rank=0, count=2), "takes no count"),
])
def test_placement_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_parameter_placement_and_master_dtype():
    p = Parameter(np.zeros((4, 6), np.float32))
    assert p.placement == Placement.replicated("dp") and p.master_dtype is None
    p.placement = Placement.sharded("tp", dim=1, index=0, count=2)
    p.master_dtype = np.float64
    assert p.placement.axis == "tp"
    q = Parameter(np.zeros(3), placement=Placement.owned(1, "pp"), master_dtype="float32")
    assert q.master_dtype == np.dtype("float32")
    with pytest.raises(ValueError, match="shards dimension 2, but the tensor has shape"):
        Parameter(np.zeros((2, 2)), placement=Placement.sharded("tp", 2, 0, 2))
    with pytest.raises(TypeError, match="placement must be a Placement"):
        Parameter(np.zeros(2), placement="dp")
    with pytest.raises(AttributeError):
        p.other = 1  # still slotted
    model = Sequential(Linear(2, 2))
    model.layers[0].weight.placement = Placement.owned(0)
    assert list(model.state_dict()) == ["0.weight", "0.bias"]  # checkpoints unaffected

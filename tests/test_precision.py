"""Mixed precision (``--precision bf16|fp16``): bfloat16 emulation, float32 masters, fp16
dynamic loss scaling, 2-byte gradient reductions, bad input.

Multi-rank checks run tests/ranks/precision_check.py on real ranks (its docstring states
the all-reduce tolerance and why).
"""

import json
import math
import os
import sys

import numpy as np
import pytest

from mpirun import (assert_bitwise_equal, fashion_available, model_arrays, run_command,
                    run_ranks)
from mpidl import bfloat16
from mpidl.engine import (SGD, Adam, Embedding, Flatten, Layer, Linear, ReLU, Sequential,
                          SoftmaxCrossEntropy)
from mpidl.errors import AgreedUserError, ConfigError
from mpidl.runtime import build
from mpidl.runtime.precision import ROUND, Precision, Wire, check_model

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks", "precision_check.py")


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def f32(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


# -- bfloat16 rounding ---------------------------------------------------------------------
@pytest.mark.parametrize("x, expected", [
    (0x3F800000, 0x3F800000),   # 1.0: on the grid
    (0x3F808000, 0x3F800000),   # 1 + 2**-8: a tie, kept bit 0 (even): down
    (0x3F818000, 0x3F820000),   # 1 + 3 * 2**-8: a tie, kept bit 1 (odd): up to even
    (0x3F808001, 0x3F810000),   # just above the tie: up
    (0x3F807FFF, 0x3F800000),   # just below the tie: down
    (0xBF818000, 0xBF820000),   # negative values round the same way (magnitudes)
    (0x3FFF8000, 0x40000000),   # carry into the exponent: 1.99609375 -> 2.0
    (0x7F7F0000, 0x7F7F0000),   # the largest finite bfloat16
    (0x7F7F7FFF, 0x7F7F0000),   # just below the overflow tie: stays finite
    (0x7F7F8000, 0x7F800000),   # the tie above the largest: odd, rounds up to +inf
    (0x7F7FFFFF, 0x7F800000),   # float32's largest: +inf
    (0xFF7FFFFF, 0xFF800000),   # and -inf
    (0x7F800000, 0x7F800000),   # +inf stays
    (0xFF800000, 0xFF800000),   # -inf stays
    (0x00000000, 0x00000000),   # +0
    (0x80000000, 0x80000000),   # -0 keeps its sign
    (0x00000001, 0x00000000),   # the smallest subnormal: to 0
    (0x00008000, 0x00000000),   # subnormal tie, kept bit 0: down
    (0x00018000, 0x00020000),   # subnormal tie, kept bit 1: up
    (0x00010000, 0x00010000),   # the smallest bfloat16 subnormal: on the grid
    (0x007FFFFF, 0x00800000),   # the largest float32 subnormal: to the smallest normal
])
def test_bf16_rounding_exact_cases(x, expected):
    got = bfloat16.round_(f32([x]))
    assert bits(got)[0] == expected, f"{x:#010x} -> {bits(got)[0]:#010x}, expected {expected:#010x}"
    assert bfloat16.to_words(f32([x]))[0] == expected >> 16


@pytest.mark.parametrize("nan", [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001])
def test_bf16_nan_stays_nan(nan):
    assert np.isnan(bfloat16.round_(f32([nan]))[0])
    assert np.isnan(bfloat16.from_words(bfloat16.to_words(f32([nan])))[0])


def test_bf16_in_place_on_non_contiguous_arrays():
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32).T
    expected = bfloat16.round_(np.ascontiguousarray(x))
    bfloat16.round_(x, out=x)
    assert np.array_equal(x, expected)


def test_bf16_matches_torch_bitwise():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    normal = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-38, 38, 200_000))
    patterns = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = np.concatenate([normal.astype(np.float32), f32(patterns)])
    theirs = torch.from_numpy(x).to(torch.bfloat16)
    ours = bfloat16.to_words(x)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], theirs.view(torch.int16).numpy().view(np.uint16)[~nan])
    assert np.isnan(bfloat16.from_words(ours[nan])).all()
    assert np.array_equal(bits(bfloat16.round_(x))[~nan],
                          bits(theirs.to(torch.float32).numpy())[~nan])


def test_bf16_words_round_trip_and_add_is_correctly_rounded():
    rng = np.random.default_rng(2)
    a = bfloat16.to_words(rng.standard_normal(50_000).astype(np.float32))
    b = bfloat16.to_words((rng.standard_normal(50_000) * 10.0 ** rng.uniform(-6, 6, 50_000))
                          .astype(np.float32))
    assert np.array_equal(bfloat16.to_words(bfloat16.from_words(a)), a)
    out = np.empty_like(a)
    bfloat16.add(a, b, out)
    exact = bfloat16.from_words(a).astype(np.float64) + bfloat16.from_words(b)
    # nearest bfloat16 of the exact sum: no other grid point is closer
    got = bfloat16.from_words(out).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(got), 1e-38))) - 7)
    assert np.all(np.abs(got - exact) <= ulp / 2)
    assert bfloat16.add(a, b, a) is a and np.array_equal(a, out)  # in place


def test_large_tensors_convert_piece_by_piece_with_the_same_bits():
    # into a given array, more than bfloat16.CHUNK elements go a piece at a time (small
    # temporaries): the bits are the whole-array conversion's (and sum's), NaN and
    # infinities too
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(2 * bfloat16.CHUNK + 3) * 1e4).astype(np.float32)
    x[[0, 5, -1]] = [np.nan, np.inf, 3.4e38]
    whole = bfloat16.round_bits(x)
    rounded = x.copy()
    bfloat16.round_(rounded, out=rounded)
    assert np.array_equal(rounded.view(np.uint32), whole)
    words = np.empty(x.size, np.uint16)
    bfloat16.to_words(x, out=words)
    assert np.array_equal(words, (whole >> 16).astype(np.uint16))
    back = np.empty_like(x)
    bfloat16.from_words(words, out=back)
    assert np.array_equal(back.view(np.uint32), whole)
    other = np.roll(words, 7)
    total = bfloat16.to_words(bfloat16.from_words(words) + bfloat16.from_words(other))
    assert np.array_equal(bfloat16.add(words, other, other), total)  # (in place)
    halved = np.empty_like(words)  # (a bucket's encoding, times 1/N)
    Wire("bf16").encode(x, 0.5, halved)
    assert np.array_equal(halved, bfloat16.to_words(x * np.float32(0.5)))
    half = x.copy()
    ROUND["fp16"](half)
    with np.errstate(over="ignore"):
        assert np.array_equal(half, x.astype(np.float16).astype(np.float32), equal_nan=True)


def test_fp16_rounding_overflows_to_inf():
    x = np.array([65504.0, 65519.0, 65520.0, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11],
                 dtype=np.float32)
    ROUND["fp16"](x)
    assert x.tolist() == [65504.0, 65504.0, math.inf, 1.0, 1 + 2.0 ** -9]


# -- training with a Precision part ---------------------------------------------------------
def mlp(seed=3):
    rng = np.random.default_rng(seed)
    return Sequential(Flatten(), Linear(12, 32, rng=rng), ReLU(),
                      Linear(32, 4, init="glorot_uniform", rng=rng))


def problem(steps, n=32, seed=4):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((12, 4))
    x = rng.standard_normal((steps, n, 12)).astype(np.float32)
    return x, np.argmax(x @ w, axis=-1)


def on_grid(fmt, a):
    return np.array_equal(a, ROUND[fmt](a.copy()))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["local", "allreduce"])
def test_training_loss_falls_with_masters_and_working_copies_on_the_grid(fmt, strategy):
    model, loss = mlp(), SoftmaxCrossEntropy()
    opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    rt = build(strategy, None, precision=fmt)
    rt.setup(model, opt, loss)
    prec = rt.precision
    assert all(opt.params[n] is prec.masters[n] for n in opt.params)
    x, y = problem(40)
    losses = [rt.train_step(x[s], y[s]) for s in range(40)]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    # between steps the working copies are 2-byte only; reading them needs a gather
    words = prec.low.words
    for name, p in model.named_parameters():
        assert words[name].dtype == prec.wire.storage and words[name].shape == p.data.shape
        with pytest.raises(AgreedUserError, match=f"{name!r} was used while not decoded"):
            p.data.copy()
    rt.gather_params()
    for name, p in model.named_parameters():
        assert np.array_equal(p.data, prec.wire.decode(words[name]))
        master = prec.masters[name].data
        assert master.dtype == np.float32 and p.data.dtype == np.float32
        assert on_grid(fmt, p.data), name
        assert not on_grid(fmt, master), f"{name}: the master keeps float32 precision"
        assert np.array_equal(p.data, ROUND[fmt](master.copy()))
        assert opt.state[name]["momentum"].dtype == np.float32
    out = model(x[0])
    assert on_grid(fmt, out), "layer outputs are rounded to the format"
    assert np.array_equal(x[0], problem(40)[0][0]), "the input batch is never modified"


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_two_byte_working_copies_change_no_bit(fmt, zero, monkeypatch):
    """The working copies held in the 2-byte format between passes and decoded layer by
    layer (``working_copy``) train bitwise as float32 working copies holding the same
    values (the runtime without them), Adam, 12 steps, with an evaluation between steps
    (which decodes them all until the next step); the update's scratch holding one
    gradient at a time steps as the whole gradient at once does."""
    from mpidl.runtime import precision
    from mpidl.runtime.runtime import Runtime

    def train(low):
        # (low: the scratch holds the largest gradient only, so the update steps in groups)
        monkeypatch.setattr(precision, "SCRATCH_ELEMENTS", 1 if low else 1 << 22)
        with monkeypatch.context() as patch:
            if not low:
                patch.setattr(Runtime, "_keep_working_copies", lambda self: None)
            model = mlp()
            opt = Adam(model.named_parameters(), lr=1e-2)
            rt = build("allreduce", None, precision=fmt, zero=zero, bucket_mb=0.001)
            rt.setup(model, opt, SoftmaxCrossEntropy())
        assert (rt.precision.low is not None) == low
        x, y = problem(12)
        for s in range(12):
            rt.train_step(x[s], y[s])
            if s == 5:
                rt.prepare_eval()
                model(x[0])
        rt.gather_params()
        return {n: p.data.copy() for n, p in model.named_parameters()}, rt

    got, rt = train(True)
    want, _ = train(False)
    assert got.keys() == want.keys()
    for n in got:
        assert np.array_equal(got[n], want[n]), n
    assert rt.metrics()["mem_params"] == sum(a.size for a in got.values()) * 2


def test_a_layer_decodes_only_its_own_working_copies():
    """In forward and backward each layer holds float32 copies of its own parameters
    only; the pass's other layers' are freed (and nothing is held after the step)."""
    model, loss = mlp(), SoftmaxCrossEntropy()
    rt = build("allreduce", None, precision="bf16")
    rt.setup(model, SGD(model.named_parameters(), lr=0.1), loss)
    low = rt.precision.low
    x, y = problem(2)
    rt.train_step(x[0], y[0])
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def probe(layer, phase):  # (added after the working copies' hook: runs after it)
        own = sorted(names[id(p)] for p in layer._params.values())
        seen.append((phase, own, sorted(low.decoded)))

    for _, m in model.modules():
        if m._params:
            m.add_pre_hook(probe)
    rt.train_step(x[1], y[1])
    assert [phase for phase, _, _ in seen] == ["forward"] * 2 + ["backward"] * 2
    assert all(own == held for _, own, held in seen), seen
    assert not low.decoded and not low.pinned


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_gpt_tiny_trains_with_its_embeddings_gradient_rounded_once_per_row(fmt):
    # the token Embedding's row-sparse gradient: duplicate rows summed, then rounded (as
    # a dense gradient would be), and given to the optimizer dense; the attention and
    # position embedding round like any layer
    from mpidl.engine.losses import TokenCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.engine.module import SparseGrad
    from mpidl.engine.optim import make_optimizer

    model = build_model("gpt-tiny", (8,), 7, seed=0, layers=1, heads=2, width=16, context=8)
    opt = make_optimizer("adam", model.named_parameters(), lr=3e-3)
    rt = build("local", None, precision=fmt)
    rt.setup(model, opt, TokenCrossEntropy())
    rng = np.random.default_rng(0)
    x = rng.integers(0, 7, size=(6, 8))  # (every id many times: duplicate rows)
    y = np.roll(x, -1, axis=1)
    losses = [rt.train_step(x, y) for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    sparse = [(n, p.grad) for n, p in model.named_parameters()
              if isinstance(p.grad, SparseGrad)]
    assert len(sparse) == 1, [n for n, _ in sparse]
    _, g = sparse[0]
    assert np.array_equal(g.indices, np.unique(x)) and on_grid(fmt, g.values)
    rt.gather_params()
    for name, p in model.named_parameters():
        assert on_grid(fmt, p.data), name
    # data parallelism exchanges those rows in the 2-byte buckets only
    rt = build("allreduce", None, precision=fmt)
    with pytest.raises(ConfigError, match="row-sparse gradients, which --sparse-grads "
                                          "allgather .* add --sparse-grads dense"):
        rt.setup(build_model("gpt-tiny", (8,), 7, seed=0, layers=1, heads=2, width=16,
                             context=8), opt, TokenCrossEntropy())


def test_fp32_has_no_precision_part():
    assert build("local", None).precision is None
    assert build("allreduce", None, precision="fp32").precision is None


def test_buckets_hold_two_byte_gradients():
    sizes = {}
    for fmt in ("fp32", "bf16", "fp16"):
        rt = build("allreduce", None, precision=fmt)
        rt.setup(mlp(), SGD(mlp().named_parameters(), lr=0.1), SoftmaxCrossEntropy())
        fused = rt.syncs[0][1]
        sizes[fmt] = fused.fusion.nbytes
        assert fused.fusion.buckets[0].dtype == {"fp32": np.float32, "fp16": np.float16,
                                                 "bf16": bfloat16.BFLOAT16}[fmt]
    assert sizes["bf16"] == sizes["fp16"] == sizes["fp32"] // 2


def snapshot(rt):
    rt.gather_params()  # (the working copies are 2-byte between steps)
    return ({n: p.data.copy() for n, p in rt.model.named_parameters()},
            {n: m.data.copy() for n, m in rt.precision.masters.items()},
            {n: {k: v.copy() if hasattr(v, "copy") else v for k, v in st.items()}
             for n, st in rt.optimizer.state.items()})


def assert_same(a, b):
    if isinstance(a, (tuple, dict)):
        keys = range(len(a)) if isinstance(a, tuple) else a.keys()
        assert (len(a) == len(b)) if isinstance(a, tuple) else (a.keys() == b.keys())
        for k in keys:
            assert_same(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


def test_forced_overflow_skips_the_step_and_halves_the_scale_then_growth():
    model, loss = mlp(), SoftmaxCrossEntropy()
    opt = Adam(model.named_parameters(), lr=1e-2)
    rt = build("local", None, precision="fp16", loss_scale=2.0 ** 8, loss_scale_window=3)
    rt.setup(model, opt, loss)
    prec = rt.precision
    x, y = problem(8)
    rt.train_step(x[0], y[0])
    assert prec.scale == 2.0 ** 8 and prec.good_steps == 1
    before = snapshot(rt)
    prec.scale = 2.0 ** 60  # the scaled loss gradient overflows float16: inf gradients
    with np.errstate(all="ignore"):
        rt.train_step(x[1], y[1])
    assert_same(before, snapshot(rt))  # parameters, masters and Adam's moments untouched
    assert opt.step_count == 1
    assert prec.scale == 2.0 ** 59 and prec.good_steps == 0 and prec.skipped_total == 1
    m = rt.metrics()
    assert m["loss_scale"] == 2.0 ** 59 and m["skipped_steps"] == 1
    prec.scale = 2.0 ** 8
    for s in range(2, 5):  # three clean steps: the scale doubles once
        rt.train_step(x[s], y[s])
        rt.gather_params()
        assert not np.array_equal(before[0]["1.weight"], model.named_parameters()[0][1].data)
    assert prec.scale == 2.0 ** 9 and prec.good_steps == 0 and opt.step_count == 4
    assert rt.metrics()["skipped_steps"] == 0


def test_state_round_trip_keeps_masters_and_scale():
    rt = build("local", None, precision="fp16", loss_scale=2.0 ** 5)
    model = mlp()
    rt.setup(model, SGD(model.named_parameters(), lr=0.1), SoftmaxCrossEntropy())
    x, y = problem(2)
    rt.train_step(x[0], y[0])
    rt.gather_params()
    state = rt.precision.state_dict()
    other = Precision("fp16")
    m2 = mlp(seed=9)
    other.setup(m2, SGD(m2.named_parameters(), lr=0.1), SoftmaxCrossEntropy())
    other.load_state_dict(state)
    assert other.scale == 2.0 ** 5
    for n, m in rt.precision.masters.items():
        assert np.array_equal(other.masters[n].data, m.data)
        assert np.array_equal(dict(m2.named_parameters())[n].data,
                              dict(model.named_parameters())[n].data)
    with pytest.raises(ConfigError, match="--precision fp16"):
        Precision("bf16").load_state_dict(state)


# -- bad input -------------------------------------------------------------------------------
class MyLayer(Layer):
    def forward(self, x):
        return x

    def backward(self, dy):
        return dy


@pytest.mark.parametrize("model, needle", [
    (lambda: Sequential(Embedding(10, 4), Flatten(), Sequential(MyLayer())),
     "layer '2.0' (MyLayer)"),
    (lambda: Sequential(Linear(4, 4), MyLayer()), "layer '1' (MyLayer)"),
])
def test_layers_without_a_low_precision_path_are_refused(model, needle):
    with pytest.raises(ConfigError, match=r"--precision fp16: .* has no fp16 path") as e:
        check_model(model(), "fp16")
    assert needle in str(e.value)
    check_model(model(), "fp32")


@pytest.mark.parametrize("name, options, needle", [
    ("ps", {"precision": "fp16"}, "--precision fp16 cannot be used with --strategy ps"),
    ("allreduce", {"precision": "bf16", "compression": "topk"},
     "--precision bf16 cannot be used with --compression topk"),
    ("allreduce", {"precision": "fp16", "sync": "local-sgd", "period": 4},
     "--precision fp16 cannot be used with --sync local-sgd"),
    ("local", {"precision": "bf16", "loss_scale": 1024.0}, "--loss-scale is for --precision fp16"),
    ("local", {"precision": "fp8"}, "--precision must be one of fp32, bf16, fp16"),
])
def test_strategies_that_cannot_serve_a_precision(name, options, needle):
    with pytest.raises(ConfigError) as e:
        build(name, None, **options)
    assert needle in str(e.value)


MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
FAST = ["--no-progress", "--dataset", "synthetic", "--limit-train", "256", "--limit-test",
        "64", "--epochs", "1"]


def one_line_error(args, *needles, tmp_path=None):
    launch = run_command(MPIDL + [str(a) for a in args], timeout=120, cwd=tmp_path)
    assert launch.returncode == 2 and "Traceback" not in launch.output, launch.output
    lines = [ln for ln in launch.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mpidl: error: "), launch.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_float64_with_a_low_precision(tmp_path):
    one_line_error(["train", "--precision", "bf16", "--dtype", "float64"] + FAST,
                   "--precision bf16", "--dtype float64", tmp_path=tmp_path)


def test_cli_layer_without_fp16_path(tmp_path):
    (tmp_path / "mine.py").write_text(
        "from mpidl.engine import Flatten, Layer, Linear, Sequential\n"
        "class Double(Layer):\n"
        "    def forward(self, x):\n"
        "        return 2 * x\n"
        "    def backward(self, dy):\n"
        "        return 2 * dy\n"
        "def build(input_shape, num_classes, rng, dtype):\n"
        "    return Sequential(Flatten(), Double(), Linear(784, num_classes, rng=rng))\n")
    one_line_error(["train", "--precision", "fp16", "--model", f"{tmp_path}/mine.py:build"]
                   + FAST, "--precision fp16", "layer '1' (Double) has no fp16 path",
                   tmp_path=tmp_path)


def test_cli_gpt_tiny_over_ranks_needs_its_rows_in_the_buckets(tmp_path):
    # (one process trains it as it is: test_gpt_tiny_trains_with_...)
    from mpirun import assert_one_line_error, mpiexec_cmd

    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + [
        "train", "--model", "gpt-tiny", "--precision", "bf16", "--no-progress",
        "--limit-train", "64", "--limit-test", "32", "--epochs", "1", "--out-dir",
        str(tmp_path / "out")], timeout=120)
    assert_one_line_error(launch, "--precision bf16", "row-sparse gradients",
                          "add --sparse-grads dense")


def test_cli_parameter_server(tmp_path):
    one_line_error(["train", "--precision", "fp16", "--strategy", "ps"] + FAST,
                   "--precision fp16 cannot be used with --strategy ps", tmp_path=tmp_path)


def test_cli_loss_scale_not_a_power_of_two(tmp_path):
    one_line_error(["train", "--precision", "fp16", "--loss-scale", "1000"] + FAST,
                   "--loss-scale must be a power of two", tmp_path=tmp_path)


def test_cli_epoch_line_carries_the_loss_scale(tmp_path):
    launch = run_command(MPIDL + ["train", "--precision", "fp16", "--out-dir", tmp_path]
                         + FAST, timeout=120)
    assert launch.returncode == 0, launch.output
    with open(tmp_path / "metrics.jsonl") as f:
        record = json.loads(f.readline())
    # (the first steps may overflow at the initial 2**16: each skip halved the scale)
    assert record["loss_scale"] == 2.0 ** (16 - record["skipped_steps"]), record


# -- real ranks ------------------------------------------------------------------------------
@pytest.mark.mpi_matrix
def test_two_ranks_allreduce_overflow_agreement_and_replicas():
    launch = run_ranks(2, [SCRIPT], timeout=120).check()
    for line in ("section allreduce: p=2", "section overflow: p=2 every rank skipped step",
                 "section replicas: p=2", "PRECISION OK p=2"):
        assert line in launch.output, launch.output


@pytest.mark.parametrize("p", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_allreduce_tolerance_and_overflow_agreement(p):  # (the other MPIs: p = 2's, above)
    launch = run_ranks(p, [SCRIPT, "--sections", "allreduce,overflow"], timeout=180).check()
    assert f"PRECISION OK p={p}" in launch.output, launch.output


@pytest.mark.skipif(not __import__("importlib").util.find_spec("cupy"),
                    reason="needs CuPy and a GPU")
def test_bf16_rounding_on_gpu_matches_cpu():
    import cupy as cp

    x = np.random.default_rng(5).standard_normal(10_000).astype(np.float32)
    assert np.array_equal(cp.asnumpy(bfloat16.round_(cp.asarray(x))), bfloat16.round_(x))


# -- the accuracy runs (long: bench/results/precision.json holds their figures) ---------------
@pytest.mark.slow
@pytest.mark.skipif(not fashion_available(), reason="needs Fashion-MNIST")
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_ten_epochs_within_half_a_point_of_fp32(model, tmp_path):
    acc = {}
    for fmt in ("fp32", "bf16", "fp16"):
        out = tmp_path / fmt
        launch = run_command(MPIDL + ["train", "--no-progress", "--model", model,
                                      "--precision", fmt, "--out-dir", out], timeout=7200)
        assert launch.returncode == 0, launch.output
        with open(out / "metrics.jsonl") as f:
            acc[fmt] = [json.loads(line) for line in f][-1]["test_acc"]
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.005 and abs(acc["fp16"] - acc["fp32"]) <= 0.005


# -- checkpoints -----------------------------------------------------------------------------
def test_fp16_resume_after_failure_is_bitwise_equal(tmp_path):
    """Masters, the loss scale and its counters come back with the checkpoint: a run
    killed mid-epoch and resumed ends bitwise where an uninterrupted one does (the
    working copies alone would lose the masters' float32 bits)."""
    pytest.importorskip("sklearn")
    args = ["train", "--no-progress", "--precision", "fp16", "--loss-scale-window", "3",
            "--model", "cnn", "--dataset", "digits", "--limit-train", "256",
            "--limit-test", "64", "--epochs", "2", "--batch-size", "32", "--seed", "7",
            "--checkpoint-every", "3"]
    full = run_command(MPIDL + args + ["--out-dir", tmp_path / "full"], timeout=120)
    assert full.returncode == 0, full.output
    run = tmp_path / "run"
    failed = run_command(MPIDL + args + ["--out-dir", run], timeout=120,
                         env={"MPIDL_FAIL_AT": "0:11"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    resumed = run_command(MPIDL + args + ["--out-dir", run, "--resume"], timeout=120)
    assert resumed.returncode == 0 and "step 9" in resumed.output, resumed.output
    assert_bitwise_equal(model_arrays(run / "model.npz"),
                         model_arrays(tmp_path / "full" / "model.npz"))
    last = [json.loads(ln) for ln in resumed.output.splitlines() if ln.startswith("{")][-1]
    first = [json.loads(ln) for ln in full.output.splitlines() if ln.startswith("{")][-1]
    for key in ("test_acc", "train_loss", "loss_scale", "skipped_steps_total"):
        assert last[key] == first[key], (key, last, first)

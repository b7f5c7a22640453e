"""``--clip-grad-norm``: gradients clipped to a global L2 norm (``mpidl/runtime/clip.py``).

* the norm: its sum of squares is the same bits however the elements are cut into pieces
  (ranks), and within a rounding of the exactly rounded sum;
* one process: a step equals the textbook clip (NumPy's norm, ``min(1, MAX / (norm +
  1e-6))``) followed by the optimizer, within float64 rounding;
* on real ranks, with the gradients clipped on most steps: data parallelism, tensor
  parallelism (a tensor every rank of the group holds whole, counted on each, would clip
  too early and fail it) and the conv-DP/FC-MP hybrid (slow) equal one process within
  1e-12; a pipeline is bitwise one process; ZeRO stages 1-3 (fp32, bf16; fp16 and under
  tensor or pipeline parallelism: slow) are bitwise stage 0;
* what clipping cannot serve, and a bad value, are one line each.
"""

import json
import math

import numpy as np
import pytest

from mpirun import (assert_bitwise_equal, assert_one_line_error, model_arrays,
                    run_cli_cases, run_command, train_cmd)

from test_tensor_parallel import max_relative_difference

from mpidl.errors import ConfigError
from mpidl.runtime import clip


def squares_sum(arrays):
    """The exactly rounded sum of the float64 squares of ``arrays``' elements."""
    return math.fsum(float(v) for a in arrays for v in np.square(a.astype(np.float64)).ravel())


def pieces_norm(parts, count):
    """The norm as ranks holding ``parts`` (one list of arrays each) compute it: the
    largest square over all, each part's fold sums, the sums added over the parts."""
    largest = max(clip.local_max(p) for p in parts)
    folds, bits = clip.folds_for(count)
    sums = np.zeros(folds)
    for p in parts:
        sums += np.array(clip.fold_sums(p, clip.sigmas(largest, folds, bits)))
    total = 0.0
    for v in sums:
        total += float(v)
    return math.sqrt(total)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_norm_is_the_same_bits_however_the_elements_are_spread(dtype):
    rng = np.random.default_rng(3)
    arrays = [(rng.standard_normal(n) * scale).astype(dtype)
              for n, scale in [(70_000, 1e-3), (40_001, 2.0), (17, 1e-9), (5, 300.0)]]
    n = sum(a.size for a in arrays)
    one = clip.global_norm(lambda: iter(arrays), n)
    assert abs(one - math.sqrt(squares_sum(arrays))) <= 1e-15 * one
    flat = np.concatenate(arrays)
    for k in (2, 3, 7):  # whole tensors on ranks, shuffled elements cut into chunks
        assert pieces_norm([arrays[i::k] for i in range(k)], n) == one
        shuffled = rng.permutation(flat)
        assert pieces_norm([[c] for c in np.array_split(shuffled, k)], n) == one


def test_norm_edge_cases():
    zeros = [np.zeros(10, dtype=np.float32)]
    assert clip.global_norm(lambda: iter(zeros), 10) == 0.0
    bad = [np.array([1.0, np.inf, 2.0]), np.array([np.nan])]
    assert clip.global_norm(lambda: iter(bad), 4) == math.inf
    for values in ([1e-160, 3e-170, 2e-161], [1.3e154, 1e200, -3e190], [5e-300, 1e-310]):
        a = [np.array(values)]  # (float64 beyond 2**+-400: scaled by a power of two)
        exact = math.fsum((v / values[0]) ** 2 for v in values)
        want = abs(values[0]) * math.sqrt(exact)
        assert abs(clip.global_norm(lambda: iter(a), 3) - want) <= 1e-15 * want, values
    with pytest.raises(ConfigError, match="more than"):
        clip.folds_for(2 ** 40)
    assert clip.coefficient(3.0, 1.0) == 1.0 / (3.0 + 1e-6)
    assert clip.coefficient(0.5, 1.0) == 1.0 and clip.coefficient(math.inf, 1.0) == 1.0
    assert clip.coefficient(1.0, 1.0) == 1.0 / (1.0 + 1e-6)  # (PyTorch's: min(1, ...))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_process_step_is_the_textbook_clip(optimizer):
    """A step of the local runtime with --clip-grad-norm equals: gradients by hand,
    scaled by min(1, MAX / (||g|| + 1e-6)) with NumPy's norm, then the optimizer."""
    from mpidl.engine import SGD, AdamW, Linear, ReLU, Sequential, SoftmaxCrossEntropy
    from mpidl.runtime import build

    def model():
        rng = np.random.default_rng(0)
        return Sequential(Linear(6, 16, rng=rng, dtype="float64"), ReLU(),
                          Linear(16, 3, rng=rng, dtype="float64"))

    def opt(m):
        if optimizer == "sgd":
            return SGD(m.named_parameters(), lr=0.1, momentum=0.9)
        return AdamW(m.named_parameters(), lr=0.01, weight_decay=0.1)

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((32, 6)) * 3, rng.integers(0, 3, 32)
    a = model()
    rt = build("local", clip_grad_norm=0.05)
    rt.setup(a, opt(a), SoftmaxCrossEntropy())
    b, loss = model(), SoftmaxCrossEntropy()
    ob = opt(b)
    for _ in range(3):
        rt.train_step(x, y)
        b.zero_grad()
        loss.forward(b.forward(x), y)
        b.backward(loss.backward())
        grads = [p.grad for _, p in b.named_parameters()]
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
        assert norm > 0.05  # (the test clips every step)
        for g in grads:
            g *= min(1.0, 0.05 / (norm + 1e-6))
        ob.step()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=0, atol=1e-15, err_msg=name)
    got = rt.metrics()
    assert got["clipped_steps"] == 3 and got["grad_norm"] > 0.05


# -- real ranks, through mpidl train ---------------------------------------------------------

SYNTHETIC = ["--model", "mlp", "--dataset", "synthetic", "--limit-train", "256",
             "--limit-test", "32", "--clip-grad-norm", "4"]


def run(tmp_path, name, n, *args, dtype="float64", epochs=2):
    out = tmp_path / name
    run_command(train_cmd(n, out, *SYNTHETIC, "--epochs", str(epochs), *args, dtype=dtype),
                timeout=300).check()
    lines = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    # the gradients were clipped on some steps (not on all: both branches run)
    clipped = sum(ln["clipped_steps"] for ln in lines)
    assert 0 < clipped < lines[-1]["step"], lines
    return out / "model.npz"


@pytest.mark.mpi_matrix_extra
def test_data_parallel_equals_one_process_at_the_global_batch(tmp_path):
    one = run(tmp_path, "one", None, "--batch-size", "32")
    two = run(tmp_path, "two", 2, "--batch-size", "16")
    assert max_relative_difference(one, two) <= 1e-12


def test_tensor_parallel_counts_each_element_once(tmp_path):
    """T = 2 (and DP 2 x TP 2 slow): the row-parallel biases every tp rank holds whole are
    counted on the first only; within 1e-12 of one process."""
    one = run(tmp_path, "one", None, "--batch-size", "32")
    tp = run(tmp_path, "tp", 2, "--batch-size", "32", "--tensor-parallel", "2")
    assert max_relative_difference(one, tp) <= 1e-12


@pytest.mark.slow
def test_hybrid_equals_one_process(tmp_path):
    """The conv-DP/FC-MP hybrid on 2 ranks: the convolutions' gradients (whole on both)
    counted once, the FC slices on each; within 1e-12 of one process (--sync-bn)."""
    args = ["--model", "cnn", "--sync-bn", "--clip-grad-norm", "10"]
    one = run(tmp_path, "one", None, "--batch-size", "32", *args)
    two = run(tmp_path, "two", 2, "--batch-size", "16", "--hybrid", "conv-dp-fc-mp", *args)
    assert max_relative_difference(one, two) <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-parallel", "2"], ["--pipeline-stages", "2"]])
def test_zero_with_tensor_or_pipeline_parallelism_is_bitwise_stage_0(tmp_path, layout):
    """DP 2 x TP 2 and DP 2 x PP 2 on 4 ranks, Adam: ZeRO's chunks of the slices (a
    tensor whole on both tp ranks counted by the first) or of a stage's buckets."""
    args = ["--batch-size", "16", "--optimizer", "adam", "--lr", "0.001", *layout]
    ref = model_arrays(run(tmp_path, "zero0", 4, *args))
    for stage in (1, 3) if layout[0] == "--tensor-parallel" else (2,):
        got = run(tmp_path, f"zero{stage}", 4, *args, "--zero", str(stage))
        assert_bitwise_equal(model_arrays(got), ref)


def test_pipeline_is_bitwise_one_process(tmp_path):
    one = run(tmp_path, "one", None, "--batch-size", "32", "--micro-batches", "2", epochs=3)
    pp = run(tmp_path, "pp", 2, "--batch-size", "32", "--micro-batches", "2",
             "--pipeline-stages", "2", epochs=3)
    assert_bitwise_equal(model_arrays(one), model_arrays(pp))


@pytest.mark.parametrize("precision, stages, n", [
    ("fp32", (1, 2, 3), 3),
    ("bf16", (2,), 2),
    pytest.param("fp16", (1, 3), 2, marks=pytest.mark.slow),
])
def test_zero_stages_are_bitwise_stage_0(tmp_path, precision, stages, n):
    """Adam; the norm summed over the ranks' chunks (decoded and unscaled in bf16/fp16)
    gives stage 0's bits, so every stage's parameters are stage 0's."""
    args = ["--batch-size", "16", "--optimizer", "adam", "--lr", "0.001",
            "--precision", precision]
    dtype = "float64" if precision == "fp32" else "float32"
    ref = model_arrays(run(tmp_path, "zero0", n, *args, dtype=dtype))
    for stage in stages:
        got = run(tmp_path, f"zero{stage}", n, *args, "--zero", str(stage), dtype=dtype)
        assert_bitwise_equal(model_arrays(got), ref)


def test_what_clipping_cannot_serve_is_one_line(tmp_path):
    base = ["train", "--model", "mlp", "--dataset", "synthetic", "--limit-train", "64",
            "--limit-test", "32", "--epochs", "1", "--no-progress", "--out-dir",
            str(tmp_path / "x")]
    cases = [
        (base + ["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive number"),
        (base + ["--clip-grad-norm", "-1"], "--clip-grad-norm must be a positive number"),
        (base + ["--clip-grad-norm", "1", "--optimizer", "lbfgs"], "drop --clip-grad-norm"),
    ]
    for launch, (_, needle) in zip(run_cli_cases([c for c, _ in cases]), cases):
        assert_one_line_error(launch, needle)
    on_ranks = [
        (base + ["--clip-grad-norm", "1", "--strategy", "ps"],
         "--clip-grad-norm cannot be used with --strategy ps"),
        (base + ["--clip-grad-norm", "1", "--pipeline-stages", "3", "--pipeline-schedule",
                 "async", "--micro-batches", "2"], "--pipeline-schedule async"),
        (base + ["--clip-grad-norm", "1", "--compression", "dgc"],
         "--clip-grad-norm with --compression dgc is not built"),
    ]
    for launch, (_, needle) in zip(run_cli_cases([c for c, _ in on_ranks], n=3), on_ranks):
        assert_one_line_error(launch, needle)

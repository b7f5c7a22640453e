"""The conv-DP/FC-MP hybrid (``--hybrid conv-dp-fc-mp``, ``mpidl.runtime.hybrid``).

* On p = 2, 3, 4 real ranks (tests/ranks/hybrid_check.py), float64, a small cnn with
  BatchNorm and dropout in the FC block (and a net whose one FC layer is split by classes:
  sliced logits, the parallel cross-entropy), 20 steps: the whole model (gathered from the
  slices) equals one process at the global batch within 1e-12 relative, for even and
  uneven batch pieces; the FC block's replicated biases are bitwise identical on every
  rank; the evaluation (test set split over the ranks, some running empty batches) sums
  to one process's loss and correct count.
* With --algorithm ring the bytes the communicator counts in a step equal the formula
  exactly, on every rank (uneven widths at p = 3 and 4, uneven pieces, micro-batches).
* Through ``mpidl train --save`` on 3 ranks: the saved model equals a one-process run's
  at the global batch, the start line gives the formula, and the epoch line's
  ``bytes_sent_per_step`` is the same formula.
* What the hybrid cannot do is one line: a ConfigError from Python, exit status 2 from
  the command line.
* bench/hybrid.py --quick writes its JSON (formula == counters at every width).
* slow: the zoo's cnn (with dropout) on 4 ranks through the command line, 60 steps.
"""

import json
import os
import re
import sys

import numpy as np
import pytest

from mpidl.engine import BatchNorm1d, Conv2d, Flatten, Linear, ReLU, Sequential
from mpidl.engine.models import cnn, mlp, resnet_tiny
from mpidl.errors import ConfigError
from mpidl.runtime import build
from mpidl.runtime.hybrid import (Hybrid, ring_allgather_bytes, ring_allreduce_bytes,
                                  ring_reduce_scatter_bytes)
from mpirun import mpiexec_cmd, run_command, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "ranks", "hybrid_check.py")
MPIDL = [sys.executable, "-m", "mpidl.cli.main", "train", "--no-progress"]
SMALL_CNN = '''from mpidl.engine.models import cnn


def small(input_shape, num_classes, rng, dtype):
    return cnn(input_shape, num_classes, rng, dtype, channels=(3, 4), hidden=10)
'''


@pytest.mark.parametrize("p", [pytest.param(2, marks=pytest.mark.mpi_matrix_extra), 3,
                               pytest.param(4, marks=pytest.mark.slow)])
def test_equals_one_process_and_counted_bytes_equal_the_formula(p):
    out = run_ranks(p, [CHECK], timeout=180).check().output
    for kind, n in (("cnn", 4 * p), ("cnn", 3 * p + 1), ("head", 3 * p + 1)):
        assert re.search(rf"equivalence {kind} p={p} global batch {n} .* over 20 steps",
                         out), out
    assert out.count(f"eval p={p}: 11 samples") == 2, out
    assert out.count(f"bytes cnn p={p} ") == 3 and f"bytes head p={p} " in out, out
    assert "counted == formula" in out, out


def test_ring_byte_formulas_by_hand():
    # 10 elements on 4 ranks: chunks 3 3 2 2; rank 1 sends all but its own (3) in the
    # reduce-scatter phase and all but rank 2's (2) in the all-gather phase
    assert ring_allreduce_bytes(10, 4, 1, 8) == (7 + 8) * 8
    assert ring_allreduce_bytes(10, 1, 0, 8) == 0
    assert ring_allgather_bytes([4, 3, 3], 0, 8) == (10 - 3) * 8
    assert ring_allgather_bytes([4, 3, 3], 2, 8) == (10 - 4) * 8
    assert ring_reduce_scatter_bytes([4, 3, 3], 0, 8) == (10 - 4) * 8


def _flags(out):
    """The bytes from the start line: (hybrid total, data parallel)."""
    line = next(ln for ln in out.splitlines() if "bytes per step on rank 0" in ln)
    total = re.search(r"= ([\d,]+) B; plain", line).group(1)
    dp = re.search(r"all-reduced\): ([\d,]+) B", line).group(1)
    return int(total.replace(",", "")), int(dp.replace(",", ""))


def test_cli_save_equals_one_process_and_logs_the_formula(tmp_path):
    model = tmp_path / "small.py"
    model.write_text(SMALL_CNN)
    common = ["--model", f"{model}:small", "--dataset", "synthetic", "--limit-train", "120",
              "--limit-test", "50", "--epochs", "2", "--dtype", "float64"]
    hybrid = run_command([*mpiexec_cmd(), "-n", "3"] + MPIDL + common + [
        "--batch-size", "4", "--hybrid", "conv-dp-fc-mp", "--sync-bn", "--algorithm", "ring",
        "--save", tmp_path / "h.npz", "--metrics", tmp_path / "h.jsonl",
        "--out-dir", tmp_path / "h"], timeout=180).check()
    one = run_command(MPIDL + common + ["--batch-size", "12", "--save", tmp_path / "one.npz",
                                       "--out-dir", tmp_path / "one"], timeout=180).check()
    assert "hybrid conv-dp-fc-mp: convolutions data parallel" in hybrid.output
    total, dp = _flags(hybrid.output)
    last = [json.loads(ln) for ln in open(tmp_path / "h.jsonl") if ln.strip()][-1]
    assert last["bytes_sent_per_step"] == total and dp > 0, (last, hybrid.output)
    a, b = np.load(tmp_path / "h.npz"), np.load(tmp_path / "one.npz")
    assert set(a.files) == set(b.files)
    worst = 0.0
    for k in b.files:
        if k == "__meta__":
            continue
        if b[k].dtype.kind == "f" and b[k].size:
            worst = max(worst, float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()))
        else:
            assert np.array_equal(a[k], b[k]), k
    assert worst <= 1e-12, (worst, hybrid.output, one.output)


@pytest.mark.slow
def test_cli_full_cnn_on_4_ranks_equals_one_process(tmp_path):
    """The zoo's cnn as it is (hidden 128: 32 columns per rank), 60 steps, float64."""
    common = ["--model", "cnn", "--dataset", "synthetic", "--limit-train", "480",
              "--limit-test", "100", "--epochs", "2", "--dtype", "float64", "--dropout", "0.25"]
    run_command([*mpiexec_cmd(), "-n", "4"] + MPIDL + common + [
        "--batch-size", "4", "--hybrid", "conv-dp-fc-mp", "--sync-bn", "--save",
        tmp_path / "h.npz", "--out-dir", tmp_path / "h"], timeout=900).check()
    run_command(MPIDL + common + ["--batch-size", "16", "--save", tmp_path / "one.npz",
                                  "--out-dir", tmp_path / "one"], timeout=900).check()
    a, b = np.load(tmp_path / "h.npz"), np.load(tmp_path / "one.npz")
    worst = max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b.files
                if k != "__meta__" and b[k].dtype.kind == "f" and b[k].size)
    assert worst <= 1e-12, worst


# -- refusals ---------------------------------------------------------------------------

class _Comm:
    """Enough of a communicator for ``build`` (which never communicates)."""

    def __init__(self, size):
        self.rank, self.size = 0, size


@pytest.mark.parametrize("options, match", [
    ({"tensor_parallel": 2}, r"--hybrid conv-dp-fc-mp with --tensor-parallel 2: the fully "
                             "connected layers are already split"),
    ({"zero": 1}, r"with --zero 1: .*drop one of them"),
    ({"compression": "topk", "ratio": 0.1}, r"with --compression topk"),
    ({"sync": "local-sgd", "period": 4}, r"with --sync local-sgd"),
    ({"precision": "bf16"}, r"with --precision bf16"),
    ({"hybrid": "conv-fc"}, r"--hybrid 'conv-fc': the one hybrid layout is conv-dp-fc-mp"),
])
def test_what_the_hybrid_cannot_do_is_one_configerror(options, match):
    options = {"hybrid": "conv-dp-fc-mp", **options}
    with pytest.raises(ConfigError, match=match):
        build("allreduce", _Comm(2), **options)


def test_other_strategies_are_refused():
    with pytest.raises(ConfigError, match="cannot be used with --strategy ps"):
        build("ps", _Comm(3), hybrid="conv-dp-fc-mp")


def _rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("model, match", [
    (lambda: mlp((1, 8, 8), 5, _rng(), "float64", hidden=(16,)),
     "no convolution before its first fully connected layer"),
    (lambda: Sequential(Conv2d(1, 2, 3, rng=_rng()), ReLU()),
     "no fully connected .* layer"),
    (lambda: Sequential(Conv2d(1, 2, 3, rng=_rng()), Flatten(), Linear(72, 8, rng=_rng()),
                        BatchNorm1d(8), Linear(8, 3, rng=_rng())),
     "must be the last layer or be followed .* layer 3 is a BatchNorm1d"),
    (lambda: Sequential(Conv2d(1, 2, 3, rng=_rng()), Flatten(), Linear(72, 2, rng=_rng()),
                        ReLU(), Linear(2, 5, rng=_rng())),
     r"^--hybrid conv-dp-fc-mp on 3 ranks: Linear 2 has 2 output features, fewer than the 3 "
     "ranks to split it over; launch fewer ranks or widen it$"),
])
def test_models_without_a_conv_fc_boundary_are_refused(model, match):
    with pytest.raises(ConfigError, match=match):
        Hybrid(3).check(model())


def test_cnn_and_resnet_have_a_boundary():
    assert Hybrid(4).find_boundary(cnn((1, 8, 8), 10, _rng(), "float32")) == 9
    Hybrid(4).check(resnet_tiny((3, 8, 8), 10, _rng(), "float32"))


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + [
        "--model", "mlp", "--dataset", "synthetic", "--limit-train", "64", "--epochs", "1",
        "--hybrid", "conv-dp-fc-mp", "--out-dir", tmp_path], timeout=120)
    assert launch.returncode == 2, launch.output
    errors = [ln for ln in launch.output.splitlines() if "error" in ln.lower()]
    assert errors and all("no convolution before its first fully connected layer" in ln
                          for ln in errors), launch.output


def test_bench_quick_run_writes_json_and_png(tmp_path):
    out = tmp_path / "hybrid.json"
    launch = run_command([sys.executable, os.path.join(os.path.dirname(HERE), "bench",
                                                       "hybrid.py"), "--quick", "--out", out],
                         timeout=180).check()
    res = json.loads(out.read_text())
    assert res["formula_equals_counters"] is True, launch.output
    assert [r["width"] for r in res["rows"]] == [64, 256] and len(res["launches"]) == 1
    assert res["latency_s"] > 0 and res["bandwidth_Bps"] > 0
    assert "crossover width measured" in launch.output
    pytest.importorskip("matplotlib")
    assert (tmp_path / "hybrid.png").stat().st_size > 0

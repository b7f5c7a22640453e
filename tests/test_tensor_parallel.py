"""Tensor parallelism (``--tensor-parallel T``): slices, planning, refusals, and real ranks.

The multi-rank cases launch ``tests/ranks/tp_check.py`` (one process's reference beside
T x DP ranks, replicated parameters checked bitwise across the tensor-parallel group
after every step) and ``mpidl train`` itself (the saved whole model against a
one-process run, 100 steps, float64; a checkpoint written at T = 2 x DP = 2 resumed at
T = 1 and T = 4).
"""

import json
import os
import shutil

import numpy as np
import pytest

from mpirun import assert_bitwise_equal, model_arrays, needs_fashion, run_command, run_ranks, \
    train_cmd
from conftest import slow_run
from mpidl.engine import Linear, ReLU, Sequential
from mpidl.engine.models import build_model
from mpidl.errors import ConfigError
from mpidl.runtime import build
from mpidl.runtime.tensor_parallel import Slice, TensorParallel, check_degree

HERE = os.path.dirname(os.path.abspath(__file__))
TP_CHECK = os.path.join(HERE, "ranks", "tp_check.py")


# -- slices and planning (one process) -------------------------------------------------------

def test_uneven_slices_cover_the_width_in_order():
    pieces = [Slice(1, 1024, 1, 3, i) for i in range(3)]
    assert [(s.lo, s.hi) for s in pieces] == [(0, 342), (342, 683), (683, 1024)]
    a = np.arange(2 * 1024).reshape(2, 1024)
    taken = [s.take(a) for s in pieces]
    assert all(t.flags.c_contiguous and t.base is None for t in taken)  # copies, not views
    np.testing.assert_array_equal(pieces[0].join(taken), a)


def test_slices_of_whole_heads():
    # 5 heads of 3 (q, k, v) x 4 columns over 2 ranks: 3 heads and 2 heads
    pieces = [Slice(1, 5, 12, 2, i) for i in range(2)]
    assert [(s.lo, s.hi) for s in pieces] == [(0, 36), (36, 60)]


@pytest.mark.parametrize("t, ranks", [(0, 4), (3, 4), (2, 3)])
def test_degree_must_divide_the_ranks(t, ranks):
    with pytest.raises(ConfigError, match="tensor-parallel"):
        check_degree(t, ranks)


def test_plan_refuses_a_layer_narrower_than_the_degree():
    model = build_model("mlp", input_shape=(1, 4, 4), num_classes=3, hidden=(8, 8))
    TensorParallel(3).check(model)  # 8 hidden units and 3 classes: fine
    with pytest.raises(ConfigError, match=r"the output Linear 5 has 3 classes, fewer than the 4"):
        TensorParallel(4).check(model)


def test_plan_refuses_more_ranks_than_attention_heads():
    model = build_model("gpt-tiny", input_shape=(8,), num_classes=20, layers=1, heads=4,
                        width=16, context=8)
    TensorParallel(3).check(model)  # 2, 1 and 1 heads
    with pytest.raises(ConfigError, match=r"layer 3\.body\.1 has 4 attention heads, fewer "
                                          r"than the 8 ranks"):
        TensorParallel(8).check(model)


def test_refused_combinations_are_one_line():
    with pytest.raises(ConfigError, match="--tensor-parallel 2 cannot be used with --strategy ps"):
        build("ps", None, tensor_parallel=2)
    with pytest.raises(ConfigError, match="does not divide the 1 rank"):
        build("local", None, tensor_parallel=2)


def test_pairs_are_column_then_row_and_the_last_linear_slices_the_classes():
    rng = np.random.default_rng(0)
    model = Sequential(Linear(6, 8, rng=rng), ReLU(), Linear(8, 8, rng=rng), ReLU(),
                       Linear(8, 4, rng=rng))

    class Group:  # the planner only reads size and rank when it cuts
        size, rank = 2, 1

    part = TensorParallel(2)
    part._plan(model, Group())
    assert part.layers == [("0", "column"), ("2", "row"), ("4", "column, logits sliced")]
    assert model.layers[0].weight.data.shape == (6, 4)
    assert model.layers[2].weight.data.shape == (4, 8)
    assert model.layers[2].bias.placement.kind == "replicated"
    assert model.layers[4].weight.data.shape == (8, 2)
    assert part.output_slice.lo == 2


# -- real ranks --------------------------------------------------------------------------------

CASES = [  # (ranks, model, T, steps, optimizer, dropout)
    pytest.param(2, "mlp", 2, 100, "sgd", 0.0, marks=pytest.mark.mpi_matrix_extra),
    (3, "mlp", 3, 100, "adam", 0.2),   # uneven slices, dropout inside the pairs
    (4, "cnn", 4, 30, "sgd", 0.0),
    (4, "mlp", 2, 50, "adam", 0.0),    # DP x TP = 2 x 2
    (4, "cnn", 2, 30, "sgd", 0.0),     # DP x TP = 2 x 2, BatchNorm synchronized
    (3, "gpt-tiny", 3, 100, "sgd", 0.0),   # 4 heads over 3 ranks, vocabulary 11
    (4, "gpt-tiny", 2, 30, "adam", 0.0),   # DP x TP = 2 x 2
    (2, "gpt-tied", 2, 30, "adam", 0.1),   # the head tied to the vocabulary-parallel embedding
]


@pytest.mark.parametrize("ranks, model, t, steps, optimizer, dropout", CASES)
def test_tensor_parallel_equals_one_process(ranks, model, t, steps, optimizer, dropout):
    launch = run_ranks(ranks, [TP_CHECK, model, t, steps, optimizer, dropout], timeout=240)
    launch.check()
    assert f"tp_check {model} T={t}" in launch.output, launch.output



def max_relative_difference(a_path, b_path, heads=None):
    """The largest difference of two saved models, relative to each tensor's largest
    value. ``heads``: for a gpt-tiny of that many heads, the attention's key biases are
    left out and returned apart (see ``test_cli_gpt_tiny_equals_one_process``)."""
    a, b = np.load(a_path), np.load(b_path)
    names = [k for k in a.files if k != "__meta__"]
    assert sorted(names) == sorted(k for k in b.files if k != "__meta__")
    worst = key_bias = 0.0
    for k in names:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        if a[k].dtype.kind != "f":
            assert np.array_equal(a[k], b[k]), k
            continue
        scale = np.abs(a[k]).max()
        if scale == 0:
            assert np.array_equal(a[k], b[k]), k
            continue
        diff = np.abs(a[k] - b[k]) / scale
        qkv_bias = heads and k.endswith(".body.1.bias") and k.replace(
            "bias", "weight") in names and b[k.replace("bias", "weight")].shape[1] == \
            3 * b[k.replace("bias", "weight")].shape[0]
        if qkv_bias:
            per_head = diff.reshape(heads, 3, -1)
            key_bias = max(key_bias, float(per_head[:, 1].max()))
            diff = per_head[:, [0, 2]]
        worst = max(worst, float(diff.max()))
    return (worst, key_bias) if heads else worst



MLP_100 = ["--model", "mlp", "--batch-size", "32", "--limit-train", "3200", "--limit-test",
           "500", "--epochs", "1"]


def test_cli_mlp_t3_uneven_equals_one_process(tmp_path):
    """The 1024-wide MLP over 3 ranks (342/341/341 columns), 100 steps, float64."""
    needs_fashion()
    run_command(train_cmd(1, tmp_path / "one", *MLP_100), timeout=300).check()
    launch = run_command(train_cmd(3, tmp_path / "tp3", *MLP_100, "--tensor-parallel", "3"),
                         timeout=300).check()
    assert "tensor parallel 3 x data parallel 1" in launch.output, launch.output
    last = json.loads(open(tmp_path / "tp3" / "metrics.jsonl").readlines()[-1])
    assert last["tensor_parallel"] == 3 and last["step"] == 100
    assert max_relative_difference(tmp_path / "one" / "model.npz",
                                   tmp_path / "tp3" / "model.npz") <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("model, t", [("mlp", 2), ("mlp", 4), ("cnn", 2), ("cnn", 3),
                                      ("cnn", 4), ("gpt-tiny", 2), ("gpt-tiny", 3),
                                      ("gpt-tiny", 4)])
def test_cli_equals_one_process_grid(tmp_path, model, t):
    """Issue 14, point 1 in full: the zoo's models at their default sizes, 100 steps of
    SGD with momentum (gpt-tiny's own AdamW: ``test_cli_gpt_tiny_adamw_default_size``)."""
    needs_fashion()
    args = ["--model", model, "--batch-size", "32", "--limit-train", "3200",
            "--limit-test", "200", "--epochs", "1"]
    if model == "gpt-tiny":
        args += ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
                 "--weight-decay", "0"]
    run_command(train_cmd(1, tmp_path / "one", *args), timeout=1800).check()
    run_command(train_cmd(t, tmp_path / "tp", *args, "--tensor-parallel", str(t)),
                timeout=1800).check()
    worst = max_relative_difference(tmp_path / "one" / "model.npz",
                                    tmp_path / "tp" / "model.npz")
    print(f"{model} T={t}: worst relative difference {worst:.3g}")
    assert worst <= 1e-12


@pytest.mark.slow
def test_cli_gpt_tiny_adamw_default_size(tmp_path):
    """gpt-tiny at its default size and recipe (AdamW), T = 3, 100 steps: within 1e-10.
    Adam divides each step by the root of the gradient's running square, so where a
    gradient is near zero (the keys' bias, whose exact gradient is zero; rarely-used
    rows) the rounding of reordered sums becomes a step of its own size; the measured
    differences are in the README."""
    args = ["--model", "gpt-tiny", "--batch-size", "32", "--limit-train", "3200",
            "--limit-test", "200", "--epochs", "1"]
    run_command(train_cmd(1, tmp_path / "one", *args), timeout=1800).check()
    run_command(train_cmd(3, tmp_path / "tp", *args, "--tensor-parallel", "3"),
                timeout=1800).check()
    worst, key_bias = max_relative_difference(tmp_path / "one" / "model.npz",
                                              tmp_path / "tp" / "model.npz", heads=4)
    print(f"gpt-tiny AdamW T=3: worst {worst:.3g}, keys' bias {key_bias:.3g}")
    assert worst <= 1e-10 and key_bias <= 1e-10


CKPT = ["--model", "mlp", "--batch-size", "16", "--limit-train", "3200", "--limit-test", "200",
        "--epochs", "1", "--checkpoint-every", "10"]


def test_checkpoint_of_t2_dp2_resumes_at_t1_and_t4(tmp_path, request):
    """Saved at T = 2 x DP = 2 (two shard files and an index per checkpoint) and killed
    after step 55, resumed from step 50 at T = 1 x DP = 2 and (with -m slow: 8 ranks) at
    T = 4 x DP = 2: both equal an uninterrupted T = 1 run. With a shard of step 50
    deleted, the resume names it and goes back to step 40."""
    needs_fashion()
    args = CKPT + ["--limit-train", "1920"]  # 60 steps of 2 x 16 (the last one counts)
    run_command(train_cmd(2, tmp_path / "ref", *args), timeout=300).check()
    crashed = run_command(train_cmd(4, tmp_path / "saved", *args, "--tensor-parallel", "2"),
                          env={"MPIDL_FAIL_AT": "1:55"}, timeout=300)
    assert crashed.returncode != 0
    saved = tmp_path / "saved" / "checkpoints"
    index = np.load(saved / "ckpt-000000050.npz")
    shard = np.load(saved / "ckpt-000000050-shard-1-of-2.npz")
    assert "model/1.weight" not in index.files and "model/1.weight" in shard.files
    assert shard["model/1.weight"].shape == (784, 512)  # its columns of the whole 1024
    for ranks, t in ((2, 1), (8, 4)) if slow_run(request.config) else ((2, 1),):
        out = tmp_path / f"t{t}"
        shutil.copytree(saved, out / "checkpoints")
        launch = run_command(train_cmd(ranks, out, *args, "--tensor-parallel", str(t),
                                       "--resume"), timeout=300).check()
        assert "step 50" in launch.output, launch.output
        assert max_relative_difference(tmp_path / "ref" / "model.npz",
                                       out / "model.npz") <= 1e-12
    out = tmp_path / "lost"
    shutil.copytree(saved, out / "checkpoints")
    os.unlink(out / "checkpoints" / "ckpt-000000050-shard-1-of-2.npz")
    launch = run_command(train_cmd(4, out, *args, "--tensor-parallel", "2", "--resume"),
                         timeout=300).check()
    assert ("its index names shard ckpt-000000050-shard-1-of-2.npz, which is missing"
            in launch.output), launch.output
    assert "resumed from" in launch.output and "step 40" in launch.output, launch.output


@pytest.mark.slow  # (CI: test_zero.py's crash while writing shards: the same shard write
# and resume; tensor-parallel shards are written and resumed in the test above)
def test_crash_while_writing_shards_keeps_the_previous_checkpoint(tmp_path):
    """Killed in the middle of writing checkpoint 3's shards (step 30): no index of step
    30 exists, the resume starts from step 20, and the run ends as an uninterrupted one."""
    needs_fashion()
    args = CKPT + ["--limit-train", "960"]  # 60 steps of 16
    run_command(train_cmd(2, tmp_path / "ref", *args, "--tensor-parallel", "2"),
                timeout=300).check()
    crashed = run_command(train_cmd(2, tmp_path / "run", *args, "--tensor-parallel", "2"),
                          env={"MPIDL_CRASH_IN_CHECKPOINT": "3:2000"}, timeout=300)
    assert crashed.returncode != 0
    names = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    assert "ckpt-000000020.npz" in names and "ckpt-000000030.npz" not in names, names
    launch = run_command(train_cmd(2, tmp_path / "run", *args, "--tensor-parallel", "2",
                                   "--resume"), timeout=300).check()
    assert "step 20" in launch.output, launch.output
    assert max_relative_difference(tmp_path / "ref" / "model.npz",
                                   tmp_path / "run" / "model.npz") == 0.0


def test_tensor_parallel_model_loads_into_one_process(tmp_path):
    """--save of a T = 2 run is the whole model: --init gives one process the same test
    loss (its one step at lr 1e-30 leaves every float64 weight's bits as they are)."""
    needs_fashion()
    args = ["--model", "mlp", "--batch-size", "32", "--limit-train", "640", "--limit-test",
            "300", "--epochs", "1"]
    run_command(train_cmd(2, tmp_path / "tp", *args, "--tensor-parallel", "2"),
                timeout=300).check()
    trained = json.loads(open(tmp_path / "tp" / "metrics.jsonl").readlines()[-1])
    run_command(train_cmd(1, tmp_path / "one", "--model", "mlp", "--batch-size", "32",
                          "--limit-train", "32", "--limit-test", "300", "--epochs", "1",
                          "--init", str(tmp_path / "tp" / "model.npz"), "--lr", "1e-30"),
                timeout=300).check()
    reloaded = json.loads(open(tmp_path / "one" / "metrics.jsonl").readlines()[-1])
    assert reloaded["test_loss"] == pytest.approx(trained["test_loss"], rel=1e-12)
    assert reloaded["test_acc"] == trained["test_acc"]


def test_degree_not_dividing_the_ranks_is_one_line(tmp_path):
    launch = run_command(train_cmd(3, tmp_path / "bad", "--model", "mlp", "--dataset",
                                   "synthetic", "--tensor-parallel", "2", dtype="float32"),
                         timeout=120)
    assert launch.returncode == 2, launch.output
    lines = [ln for ln in launch.output.splitlines() if "tensor-parallel 2 does not divide" in ln]
    assert lines and "launch a multiple of 2 ranks" in lines[0], launch.output


# (slow: CI runs the same averaging of each rank's own parameters over its data-parallel
# group, DiLoCo with a warm-up, in test_pipeline.py's averaging test, with the resume)
@pytest.mark.parametrize("resume", [pytest.param(False, marks=pytest.mark.slow),
                                    pytest.param(True, marks=pytest.mark.slow)],
                         ids=["equal", "resume"])
def test_model_averaging_over_tensor_parallelism(tmp_path, resume):
    """--sync diloco (with a post-local-SGD warm-up) on 2 replicas of a 2-way
    tensor-parallel mlp (4 ranks, float64) ends within 1e-12 of 2 plain data-parallel
    ranks: each rank averages its own slices over its data-parallel group. Slow: a run
    killed after step 11 resumes from its step-9 checkpoint, mid-period with every rank's
    own slices and outer state, bitwise; without tensor parallelism that checkpoint is
    one line (the pipeline's averaging test does the same in CI)."""
    common = ["--model", "mlp", "--dataset", "synthetic", "--epochs", "2", "--limit-train",
              "512", "--limit-test", "128", "--batch-size", "16", "--sync", "diloco",
              "--period", "4", "--warmup-steps", "2"]
    tp = ["--tensor-parallel", "2"]
    run_command(train_cmd(2, tmp_path / "dp", *common), timeout=300).check()
    run_command(train_cmd(4, tmp_path / "tp", *common, *tp), timeout=300).check()
    a = model_arrays(tmp_path / "dp" / "model.npz")
    b = model_arrays(tmp_path / "tp" / "model.npz")
    worst = max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k]))) for k in a)
    assert worst <= 1e-12, worst
    if not resume:
        return
    out = tmp_path / "crashed"
    crashed = run_command(train_cmd(4, out, *common, *tp, "--checkpoint-every", "3"),
                          env={"MPIDL_FAIL_AT": "3:11"}, timeout=300)
    assert crashed.returncode != 0, crashed.output
    refused = run_command(train_cmd(2, out, *common, "--resume"), timeout=300)
    assert refused.returncode == 2 and "written under 1 pipeline stage x 2 tensor-parallel " \
        "on 4 ranks, this run has plain data parallelism" in refused.output, refused.output
    launch = run_command(train_cmd(4, out, *common, *tp, "--resume", "--checkpoint-every",
                                   "3"), timeout=300).check()
    assert "resumed from" in launch.output and "step 9" in launch.output, launch.output
    assert_bitwise_equal(b, model_arrays(out / "model.npz"))

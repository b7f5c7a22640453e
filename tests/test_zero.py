"""ZeRO stages (``--zero 0|1|2|3``, ``mpidl.runtime.zero``).

* Bitwise: every stage gives stage 0's parameters after every step, on real ranks
  (tests/ranks/zero_check.py): SGD + momentum (and Nesterov), Adam, AdamW, float32 and
  float64, p = 2, 3 (uneven shards) and 4, mlp, cnn and gpt-tiny, several buckets, with
  and without overlap, with --accumulate, with every algorithm (those whose reduce-scatter
  sums in another order all-reduce instead). The full grid (200 steps) is ``slow``; a
  slice runs always. Stage 3 reuses freed gather buffers, which gpt-tiny's equal-sized
  blocks exercise. With tensor parallelism and pipelines, each rank's slices or stage
  sharded over its data-parallel group are the same layout's stage-0 bits, and a
  tensor-parallel run stopped at --zero 3 resumes as if never stopped.
* Mixed precision (``--precision bf16|fp16``): every stage against stage 0 in the same
  precision, bitwise, with 2-byte reduce-scatters and gathers (the same ring bytes
  formula at itemsize 2), fp16 skipping the same steps (a scale that overflows on some
  ranks' chunks only: the ranks must agree), pipelines too; a run stopped at --zero 3
  resumes at --zero 1 bitwise, its sharded masters and loss scale carried over.
* Traffic with --algorithm ring, from the counters: per rank exactly stage 0's bytes for
  stages 1-2, and summed over the ranks exactly 2(N-1)·Ψ·itemsize per step (3(N-1)·Ψ for
  stage 3); ``bytes_sent_per_step`` equals the counters.
* Reduce-scatter against all-reduce, algorithm by algorithm: the exactness table.
* Bad input is one line and exit status 2 (CLI), or one ConfigError (Python).
"""

import os
import re
import sys

import numpy as np

import pytest

from mpidl.errors import ConfigError
from mpidl.runtime import build
from mpidl.runtime.zero import exact_reduce_scatter
from mpirun import assert_one_line_error, mpiexec_cmd, run_command, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "ranks", "zero_check.py")
MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
FAST = ["--no-progress", "--dataset", "synthetic", "--limit-train", "64", "--limit-test",
        "32", "--epochs", "1", "--batch-size", "16"]


def check(n, *args, timeout=240):
    out = run_ranks(n, [CHECK] + [str(a) for a in args], timeout=timeout).check().output
    assert "zero checks passed" in out, out
    return out


# -- the slice that always runs ---------------------------------------------------------------
@pytest.mark.mpi_matrix_extra
def test_stages_1_2_3_bitwise_on_3_ranks_uneven_shards_and_ring_bytes():
    out = check(3, "--model", "mlp", "--optimizers", "adam", "--dtypes", "float32",
                "--stages", "1,2,3", "--steps", "16", "--bucket-mb", "0.001")
    assert "--zero 3 == --zero 0 bitwise over 16 steps" in out
    assert "ring reduce-scatter for bucket(s) 0, 1, 2, 3" in out


@pytest.mark.parametrize("n, args", [
    # (CI: mpidl train --zero 3 builds lazily and trains bitwise --zero 0 in
    # test_cli_run_stopped_and_resumed_at_another_stage_as_if_never_stopped[1-3-fp32];
    # each rank's lazily drawn chunks are bitwise the eager model's in test_lazy_init.py,
    # and the lazily built model's evaluation is stage 0's in the test below)
    pytest.param(3, ["--model", "mlp", "--optimizers", "adam", "--bucket-mb", "0.001"],
                 marks=pytest.mark.slow, id="mlp-p3"),
    pytest.param(4, ["--model", "gpt-tiny", "--optimizers", "adam", "--accumulate", "2",
                     *["--tensor-parallel", "2"]], marks=pytest.mark.slow, id="gpt-tp2"),
    pytest.param(4, ["--model", "gpt-tiny", "--optimizers", "adam", "--accumulate", "2",
                     "--pipeline-stages", "2", "--schedule", "zb"], marks=pytest.mark.slow,
                 id="gpt-pp2-zb"),
])
def test_stage_3_of_a_lazily_built_model_is_bitwise_stage_0(n, args):
    """A lazily built model (``mpidl train --zero 3`` builds it so): each rank draws its
    chunks only and holds nothing else from set-up on (tests/test_lazy_init.py measures
    it); the trajectory is still the eager stage 0's, bit for bit."""
    out = check(n, *args, "--stages", "3", "--steps", "12", "--lazy")
    assert "--zero 3 == --zero 0 bitwise over 12 steps" in out, out


def test_stage_3_of_a_lazily_built_model_evaluates_layer_by_layer():
    """On 3 ranks, a test set that does not split evenly: evaluation gathers bucket by
    bucket as a training forward does (a rank with fewer samples runs an empty batch to
    keep in step), takes a few buckets' worth of memory where pinning every bucket took
    the whole model, and gives stage 0's outputs bit for bit (tests/ranks/zero3_lazy.py)."""
    out = run_ranks(3, [os.path.join(HERE, "ranks", "zero3_lazy.py")], timeout=300).check()
    # (the ranks' lines may run together in the launcher's output)
    assert out.output.count("zero3_lazy rank") == 3, out.output
    assert out.output.count("1 empty one to keep in step") == 2, out.output


def test_sgd_float64_with_overlap_and_accumulation_on_2_ranks():
    out = check(2, "--model", "mlp", "--optimizers", "sgd", "--dtypes", "float64",
                "--stages", "1,2,3", "--steps", "15", "--overlap", "on", "--accumulate", "2")
    assert "mlp sgd float64 --zero 3 == --zero 0" in out


@pytest.mark.parametrize("n, args", [
    (3, ["--precision", "fp16", "--loss-scale", str(2 ** 20), "--optimizers", "adamw",
         "--steps", "12"]),
    (2, ["--model", "gpt-tiny", "--precision", "bf16", "--optimizers", "adamw",
         "--accumulate", "2", "--steps", "6"]),
    pytest.param(2, ["--model", "cnn", "--precision", "bf16", "--optimizers", "sgd",
                     "--accumulate", "2", "--steps", "6"], marks=pytest.mark.slow,
                 id="cnn-bf16-p2"),
    pytest.param(4, ["--precision", "fp16", "--loss-scale", str(2 ** 20), "--optimizers",
                     "adam", "--steps", "8", "--pipeline-stages", "2", "--accumulate", "2",
                     "--bucket-mb", "0.0005"], marks=pytest.mark.slow, id="fp16-pp2"),
    pytest.param(4, ["--precision", "bf16", "--optimizers", "sgd,adam", "--steps", "200",
                     "--overlap", "on"], marks=pytest.mark.slow, id="bf16-p4-200"),
    pytest.param(3, ["--model", "cnn", "--precision", "fp16", "--optimizers", "adam,adamw",
                     "--steps", "200"], marks=pytest.mark.slow, id="cnn-fp16-p3-200"),
])
def test_mixed_precision_stages_bitwise_their_stage_0(n, args):
    # the float32 masters sharded with the optimizer state; the buckets, the
    # reduce-scatters and the gathers of the working copies in the 2-byte format
    out = check(n, "--stages", "1,2,3", *args)
    fmt = args[args.index("--precision") + 1]
    assert f"float32 {fmt} (" in out and "--zero 3 == --zero 0 bitwise" in out, out
    if "--loss-scale" in args:  # (zero_check: some steps skipped, not all)
        assert "(0 skipped)" not in out, out


def test_cnn_adamw_on_2_ranks():
    out = check(2, "--model", "cnn", "--optimizers", "adamw", "--stages", "1,2,3",
                "--steps", "8")
    assert "cnn adamw float32 --zero 3 == --zero 0" in out


@pytest.mark.slow  # (CI: zero_check asserts a spare buffer was reused in every stage-3 run
# without --zero-reuse: gpt-tiny's in test_mixed_precision_stages_bitwise_their_stage_0
# and test_stages_on_tensor_and_pipeline_layouts; uneven shards at p = 3 in the mlp's)
def test_gpt_tiny_on_3_ranks_with_spare_gather_buffers():
    # its blocks' buckets have equal sizes, so stage 3 gathers one block's parameters
    # into the spare buffer another block's freed: a buffer in use twice would show here
    out = check(3, "--model", "gpt-tiny", "--optimizers", "adamw", "--dtypes", "float64",
                "--stages", "1,2,3", "--steps", "12")
    assert "gpt-tiny adamw float64 --zero 3 == --zero 0" in out


@pytest.mark.parametrize("n, args", [
    (3, ["--model", "mlp", "--optimizers", "adam", "--bucket-mb", "0.001"]),
    (2, ["--model", "gpt-tiny", "--optimizers", "sgd", "--accumulate", "2"]),
])
def test_zero_reuse_keeps_backwards_first_buckets_and_stays_exact(n, args):
    # --zero-reuse on: the buckets of the last two layers stay gathered from forward into
    # backward; the same bits, and the counters' bytes fall by those buckets' gathers
    out = check(n, *args, "--dtypes", "float64", "--stages", "3", "--steps", "10", "--reuse")
    assert "kept from forward into backward (--zero-reuse on)" in out, out


TP2 = ["--tensor-parallel", "2"]


@pytest.mark.parametrize("n, args, what", [
    (4, ["--model", "gpt-tiny", "--optimizers", "adam", "--stages", "3", "--accumulate",
         "2", *TP2], "[p=2 x tp 2]"),
    (4, ["--model", "gpt-tiny", "--optimizers", "adam", "--stages", "3", "--accumulate",
         "2", "--pipeline-stages", "2", "--schedule", "zb"], "[p=2 x pp 2 zb]"),
    (4, ["--model", "gpt-tiny", "--optimizers", "adam", "--stages", "3", "--accumulate",
         "4", "--pipeline-stages", "2", "--schedule", "interleaved:2"],
     "[p=2 x pp 2 interleaved:2]"),
    pytest.param(4, ["--model", "gpt-tiny", "--optimizers", "adam", "--stages", "1,2",
                     "--accumulate", "2", *TP2], "[p=2 x tp 2]", marks=pytest.mark.slow,
                 id="tp-stages-1-2"),
    pytest.param(4, ["--model", "mlp", "--optimizers", "sgd", "--stages", "3", "--accumulate",
                     "3", "--pipeline-stages", "2", "--recompute"], "[p=2 x pp 2 1f1b]",
                 marks=pytest.mark.slow, id="mlp-pp-recompute"),
    pytest.param(6, ["--model", "mlp", "--optimizers", "adamw", "--stages", "3", "--reuse",
                     *TP2], "[p=3 x tp 2]", marks=pytest.mark.slow, id="mlp-p3-reuse"),
    pytest.param(4, ["--model", "cnn", "--optimizers", "sgd", "--stages", "1,2,3", *TP2],
                 "[p=2 x tp 2]", marks=pytest.mark.slow, id="cnn"),
    pytest.param(8, ["--model", "gpt-tiny", "--optimizers", "adam", "--stages", "1,2,3",
                     "--accumulate", "2", "--pipeline-stages", "2", *TP2],
                 "[p=2 x tp 2 x pp 2 1f1b]", marks=pytest.mark.slow, id="3-d"),
    pytest.param(8, ["--model", "gpt-tiny", "--optimizers", "adamw", "--stages", "1,2,3",
                     "--accumulate", "4", "--pipeline-stages", "2", "--schedule",
                     "interleaved:2", *TP2],
                 "[p=2 x tp 2 x pp 2 interleaved:2]", marks=pytest.mark.slow,
                 id="3-d-interleaved"),
])
def test_stages_on_tensor_and_pipeline_layouts(n, args, what):
    # ZeRO over the data-parallel group of each tp rank / pipeline stage, sharding its
    # slices or layers: the bits of stage 0 with the same layout, the bytes of the formula
    # (stage 3 with a pipeline gathers for every pass its schedule runs)
    out = check(n, *args, "--dtypes", "float64", "--steps", "8", "--bucket-mb", "0.001")
    assert what in out and "== --zero 0 bitwise" in out, out


def test_auto_resolves_like_stage_0_and_stays_exact_on_4_ranks():
    # auto's small buckets go to MPI's own collective, whose reduce-scatter does not
    # match its all-reduce: those buckets are all-reduced, and the bits are stage 0's
    out = check(4, "--model", "mlp", "--optimizers", "nesterov", "--stages", "1,2,3",
                "--steps", "10", "--algorithm", "auto", "--bucket-mb", "0.001")
    assert "all-reduce + own chunk" in out


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_stage_3_gathers_decode_in_place_from_the_buffers_second_half(fmt):
    # mixed precision at stage 3: the 2-byte words arrive in the second half of the full
    # float32 buffer's bytes and are decoded into it, piece by piece from the front;
    # every value must be what decoding them elsewhere gives (several pieces, a ragged end)
    from mpidl import bfloat16
    from mpidl.runtime.precision import Wire
    from mpidl.runtime.zero import _decode_tail, _words

    wire = Wire(fmt)
    n = 3 * bfloat16.CHUNK + 5
    values = (np.random.default_rng(1).standard_normal(n) * 100).astype(np.float32)
    words = np.empty(n, wire.storage)
    wire.encode(values, 1.0, words)
    buf = np.empty(n, np.float32)
    tail = _words(buf)[n:]
    tail[...] = _words(words)
    _decode_tail(wire, tail, buf)
    assert np.array_equal(buf, wire.decode(words))


def test_exactness_table():
    assert exact_reduce_scatter("ring", 4) and exact_reduce_scatter("tree", 5)
    assert exact_reduce_scatter("recursive_doubling", 3)
    assert not exact_reduce_scatter("recursive_doubling", 4)
    assert not exact_reduce_scatter("mpi", 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_without_a_communicator_is_the_local_preset(stage):
    from mpidl.engine import SoftmaxCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_optimizer

    def run(rt):
        model = build_model("mlp", (1, 4, 4), 3, seed=1, hidden=(8,))
        opt = make_optimizer("adam", model.named_parameters(), lr=1e-2)
        rt.setup(model, opt, SoftmaxCrossEntropy())
        rng = np.random.default_rng(2)
        for _ in range(5):
            rt.train_step(rng.standard_normal((6, 1, 4, 4)).astype(np.float32),
                          rng.integers(0, 3, size=6))
        rt.prepare_eval()
        return [p.data.copy() for _, p in model.named_parameters()]

    ref = run(build("local"))
    got = run(build("allreduce", None, zero=stage, bucket_mb=0.0002))
    assert all(np.array_equal(a, b) for a, b in zip(ref, got))
    assert not np.array_equal(ref[0], build_model("mlp", (1, 4, 4), 3, seed=1,
                                                  hidden=(8,)).layers[1].weight.data)


# -- the full grid of issue 15, point 1 ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt-tiny"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_full_grid_200_steps(model, n):
    check(n, "--model", model, "--optimizers", "sgd,adam,adamw", "--dtypes",
          "float32,float64", "--stages", "1,2,3", "--steps", "200", "--bucket-mb", "0.001",
          timeout=3000)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, n", [("tree", 3), ("recursive_doubling", 3),
                                          ("recursive_doubling", 4), ("mpi", 3)])
def test_every_algorithm_is_exact(algorithm, n):
    check(n, "--model", "mlp", "--optimizers", "adam", "--stages", "1,2,3", "--steps", "20",
          "--algorithm", algorithm, "--bucket-mb", "0.001", "--overlap", "on")


# -- bad input ----------------------------------------------------------------------------------
class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("strategy, options, message", [
    ("allreduce", {"zero": 4}, "--zero must be 0, 1, 2 or 3"),
    ("ps", {"zero": 1}, "--zero 1 shards the optimizer over the data-parallel group"),
    ("allreduce", {"zero": 2, "sync": "local-sgd", "period": 2},
     "--zero 2 cannot serve --sync local-sgd"),
    ("allreduce", {"zero": 1, "compression": "topk", "ratio": 0.1},
     "--zero 1 cannot serve --compression topk"),
])
def test_build_refuses(strategy, options, message):
    with pytest.raises(ConfigError, match=message):
        build(strategy, FakeComm(0, 3), **options)


def test_model_and_optimizer_checks():
    from mpidl.engine import Embedding, Linear, Sequential
    from mpidl.engine.optim import SGD

    rng = np.random.default_rng(0)
    model = Sequential(Embedding(10, 4, rng=rng), Linear(4, 2, rng=rng))
    rt = build("allreduce", FakeComm(0, 2), zero=1)
    with pytest.raises(ConfigError, match="row-sparse gradients.*--sparse-grads dense"):
        rt.check(model, SGD(model.named_parameters(), lr=0.1))
    build("allreduce", FakeComm(0, 2), zero=1, sparse_grads="dense").check(
        model, SGD(model.named_parameters(), lr=0.1))

    with pytest.raises(ConfigError, match="optimizer does not hold 1.weight"):
        build("allreduce", FakeComm(0, 2), zero=1, sparse_grads="dense").check(
            model, SGD([("0.weight", model.layers[0].weight)], lr=0.1))

    class Clipped(SGD):  # not known to be elementwise
        pass
    with pytest.raises(ConfigError, match="elementwise optimizers only"):
        rt.check(model, Clipped(model.named_parameters(), lr=0.1))


@pytest.mark.parametrize("args, needles", [
    (["--zero", "5"], ["--zero must be 0, 1, 2 or 3"]),
    (["--zero", "1", "--compression", "topk", "--ratio", "0.1"],
     ["--zero 1 cannot serve --compression topk"]),
    (["--zero", "2", "--zero-reuse", "on"], ["--zero-reuse on", "only --zero 3"]),
])
def test_cli_bad_input_isassert_one_line_error(args, needles, tmp_path):
    assert_one_line_error(run_command(MPIDL + ["train"] + FAST + ["--out-dir", tmp_path] + args), *needles)


def test_cli_ps_under_mpiexec_isassert_one_line_error(tmp_path):
    cmd = [*mpiexec_cmd(), "-n", "2"] + MPIDL + ["train"] + FAST + [
        "--out-dir", tmp_path, "--strategy", "ps", "--zero", "2"]
    assert_one_line_error(run_command(cmd), "--zero 2", "--strategy allreduce")


# -- checkpoints --------------------------------------------------------------------------------
RESUME = os.path.join(HERE, "ranks", "zero_resume.py")


def train_mlp(n, args, env=None):
    """``mpidl train`` of the mlp on ``n`` ranks on synthetic data (32 test samples,
    0.5 MB buckets), ``args`` after."""
    cmd = [*mpiexec_cmd(), "-n", str(n)] + MPIDL + [
        "train", "--no-progress", "--dataset", "synthetic", "--limit-test", "32",
        "--model", "mlp", "--bucket-mb", "0.5"] + [str(a) for a in args]
    return run_command(cmd, env=env, timeout=240)


def test_checkpoint_resumes_at_another_number_of_ranks_and_stage(tmp_path):
    """Saved at --zero 2 on 3 ranks (its optimizer state bitwise --zero 0's), resumed at
    --zero 3 on 2 ranks: bitwise what --zero 0 does from its own checkpoint at that N
    (the sums' order changes with N, so that is the reference)."""
    path = tmp_path / "ck.pkl"
    out = run_ranks(3, [RESUME, "save", path, 2, 7]).check().output
    assert "--zero 2 checkpoint after 7 steps == --zero 0's" in out, out
    out = run_ranks(2, [RESUME, "resume", path, 3, 6]).check().output
    assert "resumed at --zero 3: bitwise --zero 0" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("save_n, save_stage, resume_n, resume_stage",
                         [(3, 2, 2, 1), (3, 1, 4, 2), (2, 3, 3, 2), (4, 3, 3, 1)])
def test_more_checkpoint_resumes(tmp_path, save_n, save_stage, resume_n, resume_stage):
    path = tmp_path / "ck.pkl"
    run_ranks(save_n, [RESUME, "save", path, save_stage, 5]).check()
    out = run_ranks(resume_n, [RESUME, "resume", path, resume_stage, 4]).check().output
    assert f"resumed at --zero {resume_stage}: bitwise --zero 0" in out, out


@pytest.mark.parametrize("first, then, precision", [
    pytest.param(2, 1, "fp32", marks=pytest.mark.slow),
    pytest.param(3, 0, "fp32", marks=pytest.mark.slow), (3, 1, "fp16"),
    pytest.param(2, 0, "bf16", marks=pytest.mark.slow),
    # into a lazily built --zero 3 (its parameters not gathered when the checkpoint's
    # shapes are checked against them)
    (1, 3, "fp32")])
def test_cli_run_stopped_and_resumed_at_another_stage_as_if_never_stopped(tmp_path, first,
                                                                         then, precision):
    """mpidl train on 3 ranks with Adam: a --zero FIRST run fails after its step-4
    checkpoint and resumes at --zero THEN; the final model is bitwise the uninterrupted
    --zero 0 run's (evaluation and the saved model at --zero 3 gather the parameters).
    (``--zero 3`` in fp32 builds the model lazily: no rank holds it whole after set-up.)
    Under --precision the checkpoint's float32 masters (sharded, gathered for it) and
    the loss scale carry over too (fp16 with a scale that overflows at first: skipped
    steps before and after the checkpoint)."""
    def train(args, env=None):
        cmd = [*mpiexec_cmd(), "-n", "3"] + MPIDL + [
            "train", "--no-progress", "--dataset", "synthetic", "--limit-train", "200",
            "--limit-test", "32", "--epochs", "2", "--batch-size", "16", "--model", "mlp",
            "--optimizer", "adam", "--lr", "0.001", "--algorithm", "ring",
            "--bucket-mb", "0.5", "--precision", precision] + [str(a) for a in args]
        if precision == "fp16":
            cmd += ["--loss-scale", str(2.0 ** 17), "--loss-scale-window", "3"]
        return run_command(cmd, env=env, timeout=240)

    whole = tmp_path / "whole"
    uninterrupted = train(["--out-dir", whole, "--zero", "0"]).check()
    ck = tmp_path / "ck"
    common = ["--out-dir", tmp_path / "z", "--checkpoint-dir", ck, "--checkpoint-every", "2"]
    failed = train(common + ["--zero", first], env={"MPIDL_FAIL_AT": "0:5"})
    assert failed.returncode != 0, failed.output
    resumed = train(common + ["--zero", then, "--resume"]).check()
    assert "resumed from" in resumed.output and "ckpt-000000004" in resumed.output, \
        resumed.output
    from mpirun import assert_bitwise_equal, model_arrays

    assert_bitwise_equal(model_arrays(tmp_path / "z" / "model.npz"),
                         model_arrays(whole / "model.npz"))
    if precision == "fp16":  # 2 steps skipped before the checkpoint, 1 after
        scale = re.compile(r'"loss_scale": [0-9.]+, "skipped_steps": [0-9]+, '
                           r'"skipped_steps_total": [0-9]+')
        assert scale.findall(resumed.output)[-1] == scale.findall(uninterrupted.output)[-1]
        assert scale.findall(uninterrupted.output)[-1].endswith("total\": 3"), \
            uninterrupted.output


@pytest.mark.parametrize("resume_n, resume_stage", [
    (2, 2), pytest.param(4, 1, marks=pytest.mark.slow),
    pytest.param(1, 3, marks=pytest.mark.slow)])
def test_cli_checkpoints_are_sharded_and_resume_on_another_number_of_ranks(
        tmp_path, resume_n, resume_stage):
    """mpidl train --zero 3 on 3 ranks (float64, Adam): every rank writes its own shard
    of each checkpoint (its chunks of the parameters and of both moments: a third each),
    the root's index holds none of them; a run that fails after its step-4 checkpoint
    resumes on RESUME_N ranks at --zero RESUME_STAGE, keeping the global batch, and ends
    within 1e-12 of the uninterrupted 3-rank --zero 0 run (only the sums' order
    changes with the rank count)."""
    def train(n, args, env=None):
        return train_mlp(n, ["--limit-train", 200, "--epochs", 2, "--batch-size", 16,
                             "--optimizer", "adam", "--lr", 0.001, "--dtype", "float64",
                             *args], env)

    whole = tmp_path / "whole"
    train(3, ["--out-dir", whole, "--zero", "0"]).check()
    ck = tmp_path / "ck"
    common = ["--out-dir", tmp_path / "z", "--checkpoint-dir", ck, "--checkpoint-every", "2"]
    failed = train(3, common + ["--zero", 3], env={"MPIDL_FAIL_AT": "0:5"})
    assert failed.returncode != 0, failed.output
    shards = [ck / f"ckpt-000000004-shard-{i}-of-3.npz" for i in range(3)]
    sizes = [os.path.getsize(s) for s in shards]
    model_bytes = (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) * 8
    assert all(abs(size - model_bytes) < 0.01 * model_bytes for size in sizes), sizes
    assert os.path.getsize(ck / "ckpt-000000004.npz") < 50_000
    resumed = train(resume_n, common + ["--zero", resume_stage, "--resume"]).check()
    assert f"written by 3 data-parallel rank(s), continued on {resume_n}" in resumed.output, resumed.output
    from mpirun import model_arrays

    ref, got = model_arrays(whole / "model.npz"), model_arrays(tmp_path / "z" / "model.npz")
    for k, a in ref.items():
        assert np.max(np.abs(got[k] - a)) <= 1e-12 * np.max(np.abs(a)), k


def test_cli_zero_under_tensor_parallelism_writes_a_shard_per_rank(tmp_path):
    """--zero 2 over TP 2 x DP 2 (float64, Adam): every rank writes its chunks of its
    slices (a quarter of the parameters and both moments each), the root's index holds
    none of them; killed after its step-4 checkpoint and resumed at --zero 1, the run
    ends bitwise the uninterrupted --zero 0 run of that layout; ``checkpoint.load``
    joins the shards into the whole model's tensors."""
    def train(args, env=None):
        return train_mlp(4, ["--limit-train", 384, "--epochs", 1, "--batch-size", 32,
                             "--optimizer", "adam", "--lr", 0.001, "--dtype", "float64",
                             "--tensor-parallel", 2, *args], env)

    train(["--out-dir", tmp_path / "whole", "--zero", "0"]).check()
    ck = tmp_path / "ck"
    common = ["--out-dir", tmp_path / "z", "--checkpoint-dir", ck, "--checkpoint-every", "4"]
    killed = train(common + ["--zero", 2], env={"MPIDL_KILL_AT": "0:5"})
    assert killed.returncode != 0, killed.output
    shards = [ck / f"ckpt-000000004-shard-{i}-of-4.npz" for i in range(4)]
    model_bytes = (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) * 8
    sizes = [os.path.getsize(s) for s in shards]
    assert all(abs(size - 3 * model_bytes / 4) < 0.01 * model_bytes for size in sizes), sizes
    assert os.path.getsize(ck / "ckpt-000000004.npz") < 50_000
    from mpidl.training import checkpoint

    joined = checkpoint.load(str(ck / "ckpt-000000004.npz"))
    assert joined["model"]["1.weight"].shape == (784, 1024)
    assert joined["optimizer"]["state"]["3.weight"]["exp_avg_sq"].shape == (1024, 1024)
    train(common + ["--zero", 1, "--resume"]).check()
    from mpirun import assert_bitwise_equal, model_arrays

    assert_bitwise_equal(model_arrays(tmp_path / "whole" / "model.npz"),
                         model_arrays(tmp_path / "z" / "model.npz"))


@pytest.mark.parametrize("save_n, saved, resume_n, resumed", [
    (4, ["--tensor-parallel", 2, "--zero", 2], 2, ["--tensor-parallel", 2, "--zero", 1]),
    # 3 replicas of a global batch of 64: pieces of 22, 21 and 21, each weighed
    (4, ["--pipeline-stages", 2, "--zero", 3], 6, ["--pipeline-stages", 2]),
    pytest.param(4, ["--pipeline-stages", 2, "--zero", 3], 2, ["--pipeline-stages", 2],
                 marks=pytest.mark.slow),
    pytest.param(2, ["--tensor-parallel", 2], 4, ["--tensor-parallel", 2, "--zero", 3],
                 marks=pytest.mark.slow),
    pytest.param(4, ["--tensor-parallel", 2, "--zero", 2], 3, ["--zero", 1],
                 marks=pytest.mark.slow),
    pytest.param(2, ["--pipeline-stages", 2], 4, ["--pipeline-stages", 2, "--zero", 2],
                 marks=pytest.mark.slow)])
def test_cli_split_layouts_resume_on_another_number_of_replicas(tmp_path, save_n, saved,
                                                               resume_n, resumed):
    """A tensor-parallel or pipelined run (float64, SGD momentum), ZeRO or not, killed
    mid-epoch after its step-4 checkpoint, resumes with another number of data-parallel
    replicas (and stage, and tensor-parallel degree), keeping the global batch, and ends
    within 1e-12 of one process at that batch (uneven pieces weighed by their share,
    under a pipeline too)."""
    def train(n, args, env=None):
        return train_mlp(n, ["--limit-train", 384, "--epochs", 1, "--seed", 3,
                             "--optimizer", "sgd", "--momentum", 0.9, "--dtype", "float64",
                             *args], env)

    split = dict(zip(saved[::2], saved[1::2]))
    replicas = save_n // split.get("--tensor-parallel", 1) // split.get("--pipeline-stages", 1)
    batch = 64 // replicas  # a global batch of 64: 6 steps, the checkpoint after 4
    train(1, ["--out-dir", tmp_path / "one", "--batch-size", 64]).check()
    ck = tmp_path / "ck"
    common = ["--out-dir", tmp_path / "run", "--checkpoint-dir", ck, "--checkpoint-every",
              4, "--batch-size", batch]
    killed = train(save_n, common + saved, env={"MPIDL_KILL_AT": "0:5"})
    assert killed.returncode != 0, killed.output
    done = train(resume_n, common + resumed + ["--resume"]).check()
    assert "resumed from" in done.output and "step 4," in done.output, done.output
    assert "continued on" in done.output and "global batches of 64" in done.output
    from mpirun import model_arrays

    ref, got = model_arrays(tmp_path / "one" / "model.npz"), \
        model_arrays(tmp_path / "run" / "model.npz")
    for k, a in ref.items():
        assert np.max(np.abs(got[k] - a)) <= 1e-12 * np.max(np.abs(a)), k


def test_cli_crash_while_writing_shards_keeps_the_previous_checkpoint(tmp_path):
    """mpidl train --zero 3 on 3 ranks, every rank killed in the middle of writing its
    shard of the step-4 checkpoint: no index of step 4 exists, the resume starts from
    step 2 and ends bitwise the uninterrupted --zero 0 run."""
    def train(args, env=None):
        cmd = [*mpiexec_cmd(), "-n", "3"] + MPIDL + [
            "train", "--no-progress", "--dataset", "synthetic", "--limit-train", "200",
            "--limit-test", "32", "--epochs", "2", "--batch-size", "16", "--model", "mlp",
            "--optimizer", "adam", "--lr", "0.001", "--algorithm", "ring",
            "--bucket-mb", "0.5"] + [str(a) for a in args]
        return run_command(cmd, env=env, timeout=240)

    train(["--out-dir", tmp_path / "whole", "--zero", "0"]).check()
    run = ["--out-dir", tmp_path / "z", "--checkpoint-every", "2", "--zero", "3"]
    crashed = train(run, env={"MPIDL_CRASH_IN_CHECKPOINT": "2:2000"})
    assert crashed.returncode != 0, crashed.output
    names = sorted(os.listdir(tmp_path / "z" / "checkpoints"))
    assert "ckpt-000000002.npz" in names and "ckpt-000000004.npz" not in names, names
    resumed = train(run + ["--resume"]).check()
    assert "resumed from" in resumed.output and "step 2," in resumed.output, resumed.output
    from mpirun import assert_bitwise_equal, model_arrays

    assert_bitwise_equal(model_arrays(tmp_path / "z" / "model.npz"),
                         model_arrays(tmp_path / "whole" / "model.npz"))


@pytest.mark.parametrize("write_n, resume", [(3, [(2, 3)]),
                                             pytest.param(3, [(4, 3), (2, 1), (1, 2)],
                                                          marks=pytest.mark.slow)])
def test_sharded_checkpoints_never_hold_the_model_whole(tmp_path, write_n, resume):
    """A lazily built 48 MB MLP at --zero 3: writing a checkpoint allocates next to
    nothing on any rank (its pieces are views of its chunks) and each shard is 1/N of
    the parameters and momentum; resumed on another number of ranks and stage, each rank
    reads the elements of its chunks (at stage 3 its peak is about its momentum chunk),
    the parameters are bitwise the saved model and a checkpoint written again joins
    into bitwise the first one (``tests/ranks/zero_checkpoint.py``)."""
    script = os.path.join(HERE, "ranks", "zero_checkpoint.py")
    out = run_ranks(write_n, [script, "write", tmp_path], timeout=300).check().output
    assert out.count("zero_checkpoint write") == write_n, out
    for n, stage in resume:
        out = run_ranks(n, [script, "resume", tmp_path, stage], timeout=300).check().output
        assert out.count(f"at --zero {stage}: bitwise") == n, out


@pytest.mark.parametrize("layout", [
    pytest.param(["--tensor-parallel", "2"], marks=pytest.mark.slow),
    ["--pipeline-stages", "2", "--micro-batches", "2"],
    pytest.param(["--pipeline-stages", "2", "--micro-batches", "2", "--schedule",
                  "interleaved:2"], marks=pytest.mark.slow)],
    ids=["tp", "pipeline", "interleaved"])
def test_cli_tp_or_pp_run_stopped_at_zero_3_resumes_as_if_never_stopped(tmp_path, layout):
    """mpidl train on 4 ranks, --tensor-parallel 2 (or --pipeline-stages 2) with Adam: a
    --zero 3 run fails after its step-4 checkpoint (a shard per rank: its chunks of its
    slices, or of its stage) and resumes at --zero 1; the final model is bitwise the
    uninterrupted --zero 0 run's."""
    def train(args, env=None):
        cmd = [*mpiexec_cmd(), "-n", "4"] + MPIDL + [
            "train", "--no-progress", "--dataset", "synthetic", "--limit-train", "200",
            "--limit-test", "32", "--epochs", "2", "--batch-size", "16", "--model", "mlp",
            "--optimizer", "adam", "--lr", "0.001", "--algorithm", "ring",
            "--bucket-mb", "0.5", *layout] + [str(a) for a in args]
        return run_command(cmd, env=env, timeout=240)

    whole = tmp_path / "whole"
    train(["--out-dir", whole, "--zero", "0"]).check()
    ck = tmp_path / "ck"
    common = ["--out-dir", tmp_path / "z", "--checkpoint-dir", ck, "--checkpoint-every", "2"]
    failed = train(common + ["--zero", "3"], env={"MPIDL_FAIL_AT": "0:5"})
    assert failed.returncode != 0, failed.output
    shards = sorted(f.name for f in ck.iterdir() if f.name.startswith("ckpt-000000004-"))
    # every rank its chunks (of its slices, of its stage)
    assert shards == [f"ckpt-000000004-shard-{i}-of-4.npz" for i in range(4)], shards
    resumed = train(common + ["--zero", "1", "--resume"]).check()
    assert "resumed from" in resumed.output and "ckpt-000000004" in resumed.output, \
        resumed.output
    from mpirun import assert_bitwise_equal, model_arrays

    assert_bitwise_equal(model_arrays(tmp_path / "z" / "model.npz"),
                         model_arrays(whole / "model.npz"))


# -- stage 3: the hooks, and a model it cannot serve ---------------------------------------------
def test_pre_hooks_fire_before_forward_and_backprop_only_where_added():
    from mpidl.engine import Linear, ReLU, Sequential

    rng = np.random.default_rng(0)
    first, second = Linear(3, 4, rng=rng), Linear(4, 2, rng=rng)
    model = Sequential(first, ReLU(), second)
    seen = []
    second.add_pre_hook(lambda layer, phase: seen.append((layer is second, phase)))
    y = model(np.ones((2, 3), np.float32))
    assert seen == [(True, "forward")]
    model.backprop(np.ones_like(y))
    assert seen == [(True, "forward"), (True, "backward")]
    assert Linear._pre_hooks == () and first._pre_hooks == ()  # nothing paid elsewhere


DIRECT = """
import math
from mpidl.engine import Flatten, Linear, ReLU, Sequential
from mpidl.engine.module import Layer


class Direct(Layer):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def children(self):
        return [("inner", self.inner)]

    def forward(self, x):
        return self.inner.forward(x)  # bypasses the child's hooks

    def backward(self, dy):
        return self.inner.backward(dy)


def build(input_shape, num_classes, rng, dtype):
    return Sequential(Flatten(), Direct(Linear(math.prod(input_shape), 8, rng=rng,
                                               dtype=dtype)),
                      ReLU(), Linear(8, num_classes, rng=rng, dtype=dtype))
"""


def test_cli_zero_3_with_a_layer_it_cannot_serve_isassert_one_line_error(tmp_path):
    (tmp_path / "direct.py").write_text(DIRECT)
    cmd = [*mpiexec_cmd(), "-n", "2"] + MPIDL + ["train"] + FAST + [
        "--out-dir", tmp_path / "out", "--model", f"{tmp_path / 'direct.py'}:build",
        "--zero", "3"]
    launch = run_command(cmd)
    assert launch.returncode == 2 and "Traceback" not in launch.output, launch.output
    errors = [ln for ln in launch.output.splitlines() if ln.startswith("mpidl: error: ")]
    assert len(errors) == 1 and "--zero 3 cannot serve this model" in errors[0], \
        launch.output
    assert "'1.inner.weight'" in errors[0] and "--zero 2" in errors[0]
    # the same model at --zero 2 trains
    cmd[-1] = "2"
    run_command(cmd[:-4] + ["--out-dir", tmp_path / "out2"] + cmd[-4:-2] + ["--zero", "2"]
                ).check()

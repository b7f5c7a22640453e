"""``mpiexec -n N mpidl train`` with the all-reduce strategy: accuracy, failures, resume.

* 2 ranks on a Fashion-MNIST subset learn (the full 10-epoch run, >= 88.5 %, is in the
  README; this is its short version).
* An exception on one rank (the MPIDL_FAIL_AT hook) ends all 4 ranks within 10 s of the
  traceback, non-zero, with that rank's traceback in the output.
* Kill-and-resume with 2 ranks: a run SIGKILLed mid-epoch (or failing on a rank) and
  resumed with --resume ends with a model file bitwise equal to an uninterrupted run
  (slow: CI resumes 2-rank runs that died in tests/test_train.py); with top-k
  compression every rank's residuals come back from its rank shard.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mpirun import fashion_available, mpi_env, mpiexec_cmd, rank_pids, run_command

MPIDL = [sys.executable, "-m", "mpidl.cli.main"]


def mpidl_cmd(n, *args):
    return [*mpiexec_cmd(), "-n", str(n)] + MPIDL + ["train", "--no-progress"] + list(args)


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# (the other MPIs: test_data_parallel.py's N-rank equivalence, and mpidl train on ranks in
# test_any_mpi.py and the failure test below)
def test_two_ranks_learn_fashion_mnist_subset(tmp_path):
    if not fashion_available():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    metrics = tmp_path / "m.jsonl"
    launch = run_command(mpidl_cmd(2, "--model", "mlp", "--epochs", "1",
                                   "--limit-train", "12000", "--limit-test", "2000",
                                   "--metrics", metrics, "--out-dir", tmp_path / "run"),
                         timeout=180).check()
    rec = records(metrics)[-1]
    assert rec["ranks"] == 2 and rec["global_batch"] == 256, launch.output
    assert rec["test_acc"] >= 0.78, launch.output
    assert rec["bytes_sent_per_step"] > 0 and rec["compute_ms"] > 0, rec


@pytest.mark.mpi_matrix
def test_exception_on_one_rank_ends_all_ranks_fast(tmp_path):
    """Rank 2 of 4 raises at step 3: every rank ends, non-zero, within 10 s of the error."""
    cmd = mpidl_cmd(4, "--model", "mlp", "--dataset", "synthetic", "--epochs", "50",
                    "--batch-size", "16", "--limit-train", "2048", "--limit-test", "64",
                    "--out-dir", tmp_path / "run")
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=mpi_env({"MPIDL_FAIL_AT": "2:3"}))
    lines, t_error = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if not t_error and "InjectedFailure" in line:
                t_error.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError("mpiexec still running 120 s after start:\n" + "".join(lines))
    t_end = time.monotonic()
    reader.join(10)
    out = "".join(lines)
    assert rc != 0, out
    assert t_error, f"no traceback of the injected failure in the output:\n{out}"
    assert t_end - t_error[0] < 10, f"took {t_end - t_error[0]:.1f} s to end:\n{out}"
    # rank 2's traceback, each line tagged with its rank
    assert re.search(r"\[rank 2\].*Traceback", out), out
    assert re.search(r"\[rank 2\].*InjectedFailure.*rank 2 at step 3", out), out


COMMON = ["--model", "mlp", "--dataset", "synthetic", "--epochs", "2", "--batch-size", "32",
          "--limit-train", "2048", "--limit-test", "128", "--checkpoint-every", "5",
          "--seed", "3"]
STEPS_PER_EPOCH = 2048 // 64
TOTAL_STEPS = 2 * STEPS_PER_EPOCH


def model_arrays(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def checkpoint_steps(directory):
    out = []
    for p in glob.glob(os.path.join(directory, "ckpt-*.npz")):
        m = re.search(r"ckpt-(\d+)\.npz$", p)
        out.append(int(m.group(1)))
    return sorted(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    run_command(mpidl_cmd(2, *COMMON, "--out-dir", d), timeout=180).check()
    return model_arrays(d / "model.npz")


def assert_same_model(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if k.startswith("__"):  # metadata (times, paths)
            continue
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs"


def kill_after_checkpoint(cmd, directory, min_step, timeout=120):
    """Start ``cmd``; SIGKILL its whole process group, and every rank by PID, once a
    checkpoint of step >= ``min_step`` exists (Open MPI starts its ranks outside the
    launcher's process group). Returns the checkpoint steps present after the kill."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=mpi_env())
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            steps = checkpoint_steps(directory)
            if steps and steps[-1] >= min_step:
                break
            if proc.poll() is not None:
                raise AssertionError(f"the run ended (rc {proc.returncode}) before "
                                     f"checkpoint {min_step}")
            time.sleep(0.005)
        else:
            raise AssertionError(f"no checkpoint {min_step} within {timeout} s")
    finally:
        if proc.poll() is None:
            for pid in rank_pids(proc.pid).values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return checkpoint_steps(directory)


@pytest.mark.slow  # (CI: test_train.py's 2-rank runs that die abruptly, in a checkpoint's
# write, or fail mid-epoch, then resume bitwise from the last whole checkpoint)
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(tmp_path, uninterrupted):
    run = tmp_path / "run"
    cmd = mpidl_cmd(2, *COMMON, "--out-dir", run)
    steps = kill_after_checkpoint(cmd, run / "checkpoints", min_step=10)
    assert steps[-1] < TOTAL_STEPS, f"the run finished before the kill: {steps}"
    assert not (run / "model.npz").exists()
    resumed = run_command(mpidl_cmd(2, *COMMON, "--out-dir", run, "--resume"),
                          timeout=180).check()
    assert f"step {steps[-1]}" in resumed.output, resumed.output
    assert_same_model(model_arrays(run / "model.npz"), uninterrupted)


@pytest.mark.slow  # (CI: test_train.py's test_resume_after_failure_is_bitwise_equal[2], a rank
# of 2 failing mid-epoch and resumed bitwise, with BatchNorm, dropout and a schedule too)
def test_rank_failure_mid_epoch_then_resume_is_bitwise_equal(tmp_path, uninterrupted):
    run = tmp_path / "run"
    failed = run_command(mpidl_cmd(2, *COMMON, "--out-dir", run), timeout=120,
                         env={"MPIDL_FAIL_AT": "1:13"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    assert checkpoint_steps(run / "checkpoints") == [5, 10]
    run_command(mpidl_cmd(2, *COMMON, "--out-dir", run, "--resume"), timeout=180).check()
    assert_same_model(model_arrays(run / "model.npz"), uninterrupted)


def test_compressed_exchange_reports_bytes_sent(tmp_path):
    """--compression topk --ratio 0.01: far fewer bytes per step than the dense all-reduce."""
    metrics = tmp_path / "m.jsonl"
    base = ["--model", "mlp", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "32",
            "--limit-train", "512", "--limit-test", "64", "--metrics"]
    run_command(mpidl_cmd(2, *base, metrics, "--out-dir", tmp_path / "a"), timeout=120).check()
    run_command(mpidl_cmd(2, *base, metrics, "--out-dir", tmp_path / "b", "--compression",
                          "topk", "--ratio", "0.01"), timeout=120).check()
    dense, topk = records(metrics)
    assert topk["compression_ratio"] > 20, topk
    assert topk["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 10, (dense, topk)


@pytest.mark.slow  # 19 s; CI: the same write hook and resume in test_zero.py's crash while
# writing shards, and the rank shards written and resumed in the test below
def test_a_crash_while_ranks_write_their_own_shards_keeps_the_previous_checkpoint(
        tmp_path):
    """Top-k on 2 ranks, both killed in the middle of writing their rank shards of the
    second checkpoint (step 10): no index of step 10 exists, the resume starts from step
    5, and the run ends bitwise the uninterrupted one."""
    args = COMMON + ["--compression", "topk", "--ratio", "0.01", "--limit-train", "640"]
    full, run = tmp_path / "full", tmp_path / "run"
    run_command(mpidl_cmd(2, *args, "--out-dir", full), timeout=180).check()
    crashed = run_command(mpidl_cmd(2, *args, "--out-dir", run), timeout=120,
                          env={"MPIDL_CRASH_IN_CHECKPOINT": "2:2000"})
    assert crashed.returncode != 0 and not crashed.timed_out, crashed.output
    names = sorted(os.listdir(run / "checkpoints"))
    assert "ckpt-000000005.npz" in names and "ckpt-000000010.npz" not in names, names
    launch = run_command(mpidl_cmd(2, *args, "--out-dir", run, "--resume"),
                         timeout=180).check()
    assert "resumed from" in launch.output and "step 5," in launch.output, launch.output
    assert_same_model(model_arrays(run / "model.npz"), model_arrays(full / "model.npz"))


def test_resume_with_compression_restores_error_feedback(tmp_path):
    """Top-k keeps residuals per rank (error feedback): the checkpoint carries every
    rank's, each in a rank shard its rank writes (the root's index holds none: no rank
    gathers another's), so the resumed run is still bitwise the uninterrupted one."""
    args = COMMON + ["--compression", "topk", "--ratio", "0.01",
                     "--limit-train", "1024"]  # (the last --limit-train counts)
    full, run = tmp_path / "full", tmp_path / "run"
    run_command(mpidl_cmd(2, *args, "--out-dir", full), timeout=180).check()
    failed = run_command(mpidl_cmd(2, *args, "--out-dir", run), timeout=120,
                         env={"MPIDL_FAIL_AT": "0:13"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    from mpidl.training import checkpoint

    (step, index), = checkpoint.list_checkpoints(str(run / "checkpoints"))[-1:]
    for i in range(2):
        with np.load(run / "checkpoints" / checkpoint.shard_name(step, i, 2, "rank")) as z:
            assert any(k.startswith("pieces/") for k in z.files), z.files
    with np.load(index) as z:
        assert not [k for k in z.files if k.startswith("runtime/")], z.files
    run_command(mpidl_cmd(2, *args, "--out-dir", run, "--resume"), timeout=180).check()
    assert_same_model(model_arrays(run / "model.npz"), model_arrays(full / "model.npz"))

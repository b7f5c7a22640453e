"""Local SGD, post-local SGD and DiLoCo (``--sync local-sgd|diloco``, ``mpidl.runtime.averaging``).

* On 2, 3 and 4 ranks (tests/ranks/local_sgd_check.py, float64): local SGD with H = 1 is
  all-reduce within 1e-13 for SGD (the mean of the local momentum buffers is all-reduce's
  buffer; each rank's own differs), not for Adam; local SGD with H = 3 is one process
  simulating the replicas, with and without ``--clip-grad-norm`` (and DiLoCo with it); DiLoCo with outer lr 1 and no outer
  momentum is local SGD bitwise; post-local SGD is all-reduce bitwise before its switch;
  replicas bitwise equal after every averaging; bytes exactly 1/H of all-reduce's.
* Bad input is one line and exit status 2.
* A run that fails in the middle of a period and resumes ends bitwise equal to an
  uninterrupted one (the anchor, the outer momentum and every rank's own parameters and
  optimizer state are in the checkpoint).
"""

import json
import os
import sys

import pytest

from mpidl.errors import ConfigError
from mpidl.runtime import build
from mpidl.runtime.averaging import DiLoCo, ModelAveraging
from mpirun import assert_one_line_error, model_arrays, mpiexec_cmd, run_command, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
MPIDL = [sys.executable, "-m", "mpidl.cli.main"]


class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.mpi_matrix_extra), 3,
                               pytest.param(4, marks=pytest.mark.slow)])
def test_identities_and_bytes_on_n_ranks(n):
    out = run_ranks(n, [os.path.join(HERE, "ranks", "local_sgd_check.py")],
                    timeout=240).check().output
    assert "local SGD checks passed" in out, out
    assert f"local-sgd H=3 == one process simulating {n} replicas" in out, out
    for sync in ("local-sgd", "diloco"):  # each replica clips its own gradient
        assert f"{sync} H=3 --clip-grad-norm 2.5" in out, out


def test_sync_composes_with_the_allreduce_preset():
    rt = build("allreduce", FakeComm(0, 2), sync="local-sgd", period=4)
    assert type(rt.averaging) is ModelAveraging and rt.averaging.period == 4
    assert rt.name == "allreduce+local-sgd"
    rt = build("allreduce", FakeComm(0, 2), sync="diloco", period=8, warmup_steps=3)
    assert type(rt.averaging) is DiLoCo and rt.averaging.warmup_steps == 3
    assert (rt.averaging.outer_lr, rt.averaging.outer_momentum) == (0.7, 0.9)
    assert build("allreduce", FakeComm(0, 2), sync="allreduce").averaging is None
    assert build("allreduce", FakeComm(0, 2)).averaging is None
    # one process: no replicas, the settings have no effect (reported, not refused)
    assert build("local", strict=False, sync="local-sgd", period=4).unused_options == \
        ("period", "sync")


@pytest.mark.parametrize("options, message", [
    ({"sync": "local-sgd"}, "--sync local-sgd needs --period H"),
    ({"sync": "local-sgd", "period": 0}, "--period must be at least 1"),
    ({"period": 4}, "--period needs --sync local-sgd or --sync diloco"),
    ({"warmup_steps": 4}, "--warmup-steps needs --sync"),
    ({"sync": "local-sgd", "period": 4, "outer_lr": 0.5}, "--outer-lr needs --sync diloco"),
    ({"outer_momentum": 0.5}, "--outer-momentum needs --sync diloco"),
    ({"sync": "diloco", "period": 4, "outer_lr": 0.0}, "--outer-lr must be a positive"),
    ({"sync": "diloco", "period": 4, "outer_momentum": -0.1}, "--outer-momentum must be in"),
    ({"sync": "gossip", "period": 4}, "--sync must be one of"),
])
def test_bad_combinations_are_refused_by_build(options, message):
    with pytest.raises(ConfigError, match=message):
        build("allreduce", FakeComm(0, 2), **options)
    with pytest.raises(ConfigError, match=message):  # whatever the preset
        build("local", strict=False, **options)


def test_ps_and_compression_refuse_model_averaging():
    with pytest.raises(ConfigError, match="--strategy allreduce"):
        build("ps", FakeComm(1, 3), strict=False, sync="diloco", period=4)
    with pytest.raises(ConfigError, match="--compression compresses gradients"):
        build("allreduce", FakeComm(0, 2), sync="local-sgd", period=4, compression="topk",
              ratio=0.1)


BASE = ["train", "--no-progress", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1",
        "--batch-size", "32", "--limit-train", "256", "--limit-test", "32"]


@pytest.mark.parametrize("flags, message", [
    (["--sync", "local-sgd", "--period", "0"], "--period must be at least 1"),
    (["--sync", "diloco", "--period", "-2"], "--period must be at least 1"),
    (["--outer-lr", "0.5"], "--outer-lr needs --sync diloco"),
    (["--sync", "diloco", "--period", "4", "--outer-lr", "-1"], "--outer-lr must be a positive"),
    (["--sync", "local-sgd", "--warmup-steps", "-1", "--period", "2"],
     "--warmup-steps must be at least 0"),
    (["--sync", "local-sgd"], "needs --period H"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, flags, message):
    launch = run_command(MPIDL + BASE + ["--out-dir", tmp_path / "run"] + flags, timeout=60)
    lines = [ln for ln in launch.output.splitlines() if ln.strip()]
    assert launch.returncode == 2, launch.output
    assert len(lines) == 1 and lines[0].startswith("mpidl: error: ") and message in lines[0], \
        launch.output


def test_cli_bad_input_on_two_ranks_is_one_line_and_exit_2(tmp_path):
    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + BASE +
                         ["--out-dir", tmp_path / "run", "--sync", "local-sgd",
                          "--period", "4", "--outer-momentum", "0.5"], timeout=60)
    line = assert_one_line_error(launch)
    assert line == "mpidl: error: --outer-momentum needs --sync diloco (--sync is local-sgd)"


# -- resume in the middle of a period

RESUME = ["--model", "mlp", "--dataset", "synthetic", "--epochs", "2", "--batch-size", "16",
          "--limit-train", "512", "--limit-test", "64", "--checkpoint-every", "5",
          "--seed", "3", "--dtype", "float64", "--sync", "diloco", "--period", "3",
          "--warmup-steps", "2"]  # 16 steps per epoch; averagings at 5, 8, 11, ...


def mpidl2(*args):
    return [*mpiexec_cmd(), "-n", "2"] + MPIDL + ["train", "--no-progress"] + list(args)




def test_failure_mid_period_then_resume_is_bitwise_equal(tmp_path):
    full, run = tmp_path / "full", tmp_path / "run"
    run_command(mpidl2(*RESUME, "--out-dir", full), timeout=180).check()
    # the checkpoint of step 10 is 2 steps into the period that began after the averaging
    # at step 8 (replicas differ there); rank 1 fails at step 13
    failed = run_command(mpidl2(*RESUME, "--out-dir", run), timeout=120,
                         env={"MPIDL_FAIL_AT": "1:13"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    resumed = run_command(mpidl2(*RESUME, "--out-dir", run, "--resume"), timeout=180).check()
    assert "step 10" in resumed.output, resumed.output
    a, b = model_arrays(full / "model.npz"), model_arrays(run / "model.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs after the resume"
    with open(full / "metrics.jsonl", encoding="utf-8") as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    # epoch 2 is steps 17..32: averagings after steps 17, 20, 23, 26, 29 and 32
    assert last["averagings"] == 6 and last["allreduce_steps"] == 0, last


def test_resume_with_other_sync_settings_is_refused(tmp_path):
    run = tmp_path / "run"
    failed = run_command(mpidl2(*RESUME, "--out-dir", run), timeout=120,
                         env={"MPIDL_FAIL_AT": "0:7"})
    assert failed.returncode != 0, failed.output
    i = RESUME.index("--period")
    other = RESUME[:i + 1] + ["4"] + RESUME[i + 2:]
    launch = run_command(mpidl2(*other, "--out-dir", run, "--resume"), timeout=120)
    assert launch.returncode == 2 and "period: checkpoint 3, now 4" in launch.output, \
        launch.output

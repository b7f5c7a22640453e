"""Dynamic work dealing (``--strategy ps --deal portions``) on real MPI ranks.

The global batch is cut into portions that the first server deals to whichever worker
asks; the servers sum the portions in portion order. What must hold:

1. The result does not depend on who computed what: a run with one worker 4x slower,
   and a run with the parameters on 2 servers, give bitwise the parameters of the run
   without a straggler (float64 and float32).
2. The update is still the global batch's mean gradient: float64 parameters within
   1e-12 of one process at the global batch, and of synchronous ``--strategy ps``
   (which sums each worker's mean instead).
3. The straggler takes fewer portions; every pushed portion is applied or dropped (a
   backup copy's loser), and exactly the portions of every step are applied. Row-sparse
   (Embedding) gradients too; a resumed run is bitwise the uninterrupted one.
4. What it cannot serve is one line: another mode, compression, worker groups,
   --accumulate, --portion-size without --deal portions, a model with dropout.
"""

import json

import numpy as np
import pytest

from mpirun import assert_one_line_error, mpiexec_cmd, run_cli_cases, run_command

from conftest import slow_run
from test_cli_errors import MPIDL

FAST = ["--no-progress", "--dataset", "synthetic", "--limit-train", "512", "--limit-test",
        "64", "--epochs", "2"]


def train(tmp_path, name, *args, n=4, dtype="float64"):
    out = tmp_path / name
    cmd = [*mpiexec_cmd(), "-n", str(n)] + MPIDL + ["train", "--strategy", "ps",
                                                   "--dtype", dtype, "--out-dir", str(out),
                                                   *FAST, *args]
    launch = run_command([str(c) for c in cmd], timeout=180)
    launch.check()
    with np.load(out / "model.npz") as f:
        params = {k: f[k] for k in f.files if not k.startswith("__")}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return params, records[-1]


def same_bits(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_dealt_portions_do_not_depend_on_who_computed_them(tmp_path, dtype, request):
    deal = ["--deal", "portions"]
    alone, rec = train(tmp_path, "plain", *deal, dtype=dtype)
    slow, slow_rec = train(tmp_path, "straggler", *deal, "--straggler", "3:4", dtype=dtype)
    assert same_bits(alone, slow)
    # 3 workers x batch 128, portions of 32: 12 per step, 2 steps per epoch, 2 epochs
    for r in (rec, slow_rec):
        assert r["ps_applied"] == 12 * 4 and r["ps_updates"] == 4, r
        assert r["ps_pushed"] == r["ps_applied"] + r["ps_dropped"], r
    by_worker = {int(w): n for w, n in slow_rec["ps_pushed_by_worker"].items()}
    assert by_worker[3] < min(by_worker[1], by_worker[2]), by_worker
    if dtype == "float64":  # other portions; with -m slow: 2 servers, another straggler
        if slow_run(request.config):
            two, _ = train(tmp_path, "two", *deal, "--servers", "2", "--straggler", "2:4",
                           n=5)
            assert same_bits(alone, two)
        other, _ = train(tmp_path, "other", *deal, "--portion-size", "48")
        assert not same_bits(alone, other)  # (the test can tell runs apart)
        rel = max(float(np.max(np.abs(other[k] - alone[k]))) / float(np.max(np.abs(alone[k])))
                  for k in alone)
        assert rel <= 1e-12, rel  # but the same mean gradient


def test_row_sparse_portions_too(tmp_path):
    """gpt-tiny: its embedding's gradients are pushed as rows (kept until the update,
    then concatenated in portion order), the rest dense: a 4x straggler changes no bit."""
    gpt = ["--deal", "portions", "--model", "gpt-tiny", "--dataset", "text", "--layers", "1",
           "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "16",
           "--limit-train", "512", "--epochs", "1"]
    alone, rec = train(tmp_path, "gpt", *gpt)
    slow, _ = train(tmp_path, "gpt-slow", *gpt, "--straggler", "3:4")
    assert same_bits(alone, slow)
    assert rec["ps_applied"] == 4 * rec["ps_updates"] * 3, rec  # 4 portions per worker


@pytest.mark.slow  # 12 s; dealing adds nothing to a checkpoint: CI resumes the parameter
# server's epoch-end checkpoints bitwise (test_parameter_server_mpi.py, test_preempt.py),
# and a straggler changes no bit of a dealt run (the first test here)
def test_resume_of_a_dealt_run_is_bitwise_the_uninterrupted_run(tmp_path):
    """Epoch 1, a checkpoint, then epoch 2 resumed with a straggler that was not there:
    the parameters of the run that went straight through."""
    common = ["--deal", "portions", "--schedule", "constant"]
    straight, _ = train(tmp_path, "straight", *common)
    ck = tmp_path / "ck"
    train(tmp_path, "first", *common, "--epochs", "1", "--checkpoint-dir", ck)
    resumed, rec = train(tmp_path, "resumed", *common, "--resume", "--checkpoint-dir", ck,
                         "--straggler", "2:3")
    assert rec["epoch"] == 2 and same_bits(straight, resumed)


def test_dealt_portions_equal_one_process_at_the_global_batch(tmp_path):
    """3 workers of batch 128, dealt in 32-sample portions, against one process with
    batch 384 (the same global batches): float64 parameters within 1e-12."""
    dealt, _ = train(tmp_path, "dealt", "--deal", "portions")
    cmd = MPIDL + ["train", "--strategy", "local", "--dtype", "float64", "--out-dir",
                   str(tmp_path / "one"), *FAST, "--batch-size", "384"]
    run_command([str(c) for c in cmd], timeout=180).check()
    with np.load(tmp_path / "one" / "model.npz") as f:
        one = {k: f[k] for k in f.files if not k.startswith("__")}
    assert sorted(one) == sorted(dealt)
    rel = max(float(np.max(np.abs(dealt[k] - one[k]))) / float(np.max(np.abs(one[k])))
              for k in one)
    assert rel <= 1e-12, rel


@pytest.mark.slow  # (CI: dealt portions within 1e-12 of one process at the global batch,
# above, and sync PS within 1e-12 of it, test_parameter_server_mpi.py; another portion
# size, the same mean: the first test's --portion-size 48 run)
def test_dealt_portions_equal_synchronous_ps_in_float64(tmp_path):
    dealt, _ = train(tmp_path, "dealt", "--deal", "portions", "--portion-size", "16")
    sync, _ = train(tmp_path, "sync")
    rel = max(float(np.max(np.abs(dealt[k] - sync[k]))) / float(np.max(np.abs(sync[k])))
              for k in sync)
    assert 0 < rel <= 1e-12, rel  # another summation order, the same mean


# also run as a launch of its own (test_what_dealing_cannot_serve_from_its_own_launch)
ASYNC_DEALING = (["--deal", "portions", "--mode", "async"], "--deal portions keeps "
                 "synchronous semantics")
CANNOT_SERVE = [
    ASYNC_DEALING,
    (["--deal", "portions", "--compression", "topk", "--ratio", "0.1"],
     "--deal portions pushes each portion's exact gradient on its own: drop --compression"),
    (["--deal", "portions", "--accumulate", "2"], "drop --accumulate"),
    (["--portion-size", "8"], "--portion-size applies to --deal portions"),
    (["--deal", "portions", "--dropout", "0.5"], "is Dropout with p 0.5"),
    # (the other new parameter-server mode, softsync, on the same command line)
    (["--mode", "softsync", "--wait", "5"], "--wait 5: softsync makes each update from c "
     "gradients of the 2 workers, so 1 <= c <= 2"),
    (["--mode", "sync", "--wait", "2"], "--wait applies to --mode backup or softsync"),
]


def _ps(args):
    return ["train", "--strategy", "ps", *FAST, *args]


@pytest.fixture(scope="module")
def cannot_serve_launches():
    """Every CANNOT_SERVE command through ``mpidl``'s main on 3 ranks, one after another
    in one launch (``mpirun.run_cli_cases``): each is refused before training starts."""
    return run_cli_cases([_ps(args) for args, _ in CANNOT_SERVE], n=3)


@pytest.mark.parametrize("case", range(len(CANNOT_SERVE)),
                         ids=[" ".join(args) for args, _ in CANNOT_SERVE])
def test_what_dealing_cannot_serve_is_one_line(case, cannot_serve_launches):
    assert_one_line_error(cannot_serve_launches[case], CANNOT_SERVE[case][1])


def test_what_dealing_cannot_serve_from_its_own_launch():
    """The same as a job of its own: one line, every rank exits 2."""
    args, needle = ASYNC_DEALING
    cmd = [*mpiexec_cmd(), "-n", "3"] + MPIDL + _ps(args)
    assert_one_line_error(run_command([str(c) for c in cmd], timeout=120), needle)

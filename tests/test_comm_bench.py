"""The collectives benchmark end to end: ``mpidl bench collectives`` (under mpiexec and
launching itself), bench/collectives.py writing JSON + PNG, and ``--tune`` feeding
``algorithm="auto"``. Tiny sizes and iteration counts: this checks the plumbing, not
the figures."""

import json
import os
import shutil
import sys

import pytest

from mpirun import mpiexec_cmd, run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIDL = shutil.which("mpidl", path=os.path.dirname(sys.executable)) or shutil.which("mpidl")
FAST = ["--sizes", "4,4KiB,64KiB", "--iters", "3", "--repeats", "1"]


@pytest.mark.skipif(MPIDL is None, reason="mpidl command not installed")
def test_cli_under_mpiexec_prints_table():
    launch = run_command([*mpiexec_cmd(), "-n", "2", MPIDL, "bench", "collectives", *FAST,
                          "--algorithms", "ring,tree,recursive_doubling,mpi,auto"],
                         timeout=120).check()
    out = launch.output
    assert "allreduce  p=2" in out, out
    for col in ("native us", "ring us", "tree us", "recursive_doubling us", "mpi us",
                "auto us", "64 KiB"):
        assert col in out, out
    assert "goal" in out


@pytest.mark.skipif(MPIDL is None, reason="mpidl command not installed")
def test_cli_launches_itself_with_np_and_other_collectives():
    launch = run_command([MPIDL, "bench", "collectives", "--np", "2", *FAST,
                          "--collective", "allgather,bcast"], timeout=120).check()
    assert "allgather  p=2" in launch.output and "bcast  p=2" in launch.output, launch.output


@pytest.mark.skipif(MPIDL is None, reason="mpidl command not installed")
def test_cli_rejects_bad_arguments_with_one_line():
    launch = run_command([MPIDL, "bench", "collectives", "--sizes", "lots"], timeout=60)
    assert launch.returncode == 2, launch.output
    assert "mpidl: error: mpidl bench collectives: bad size 'lots'" in launch.output


def test_runner_writes_json_and_png(tmp_path):
    launch = run_command([sys.executable, os.path.join(ROOT, "bench", "collectives.py"),
                          "--np", "2", "--sizes", "4,1MiB", "--iters", "2", "--repeats", "2",
                          "--out-dir", tmp_path], timeout=180).check()
    doc = json.loads((tmp_path / "collectives_p2.json").read_text())
    assert (tmp_path / "collectives_p2.png").stat().st_size > 10_000
    info = doc["info"]
    for key in ("cpu", "cores", "python", "numpy", "mpi4py", "mpi", "mpidl", "date"):
        assert info.get(key) not in (None, ""), key
    rows = {(r["bytes"], r["algorithm"]) for r in doc["results"]}
    for size in (4, 1 << 20):
        for alg in ("native", "ring", "tree", "recursive_doubling", "mpi"):
            assert (size, alg) in rows
    r = next(r for r in doc["results"] if r["bytes"] == 1 << 20 and r["algorithm"] == "ring")
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert len(r["lat_us_runs"]) == 2 and r["speedup_vs_native"] > 0
    assert doc["goals"], launch.output


def test_tune_writes_thresholds_that_auto_uses(tmp_path):
    path = tmp_path / "tuning.json"
    run_command([*mpiexec_cmd(), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                 "mpidl.benchmarks.collectives", "--tune", "--collective", "allreduce,bcast",
                 "--sizes", "4,64KiB", "--repeats", "2"], timeout=180,
                env={"MPIDL_TUNING": str(path)}).check()
    tables = json.loads(path.read_text())["tables"]
    entries = tables["allreduce"]["2"]
    assert entries[-1][0] is None
    assert all(alg in ("ring", "tree", "recursive_doubling", "mpi") for _, alg in entries)
    assert "bcast" in tables


def test_check_cost_writes_both_measurements(tmp_path):
    """``--check-cost``: the end-to-end overhead with its A/A floor, and the check's own
    work per call (calls through an algorithm that moves nothing), which it removes from
    the registry again."""
    path = tmp_path / "cc.json"
    launch = run_command([sys.executable, os.path.join(ROOT, "bench", "collectives.py"),
                          "--check-cost", "--sizes", "4,64KiB", "--repeats", "3",
                          "--json", path], timeout=300).check()
    goals = [ln for ln in launch.output.splitlines() if ln.startswith("goal ")]
    assert len(goals) == 2 and "at 4 B" in goals[0] and "at 64 KiB" in goals[1], goals
    records = json.loads(path.read_text())["check_cost"]
    assert [r["bytes"] for r in records] == [4, 65536]
    for r in records:
        for k in ("overhead_digest", "overhead_off-again", "check_us_digest",
                  "check_us_off-again", "cost_digest"):
            assert isinstance(r[k], float) and abs(r[k]) < 1e3, (k, r[k])
        # a share of the unchecked call timed beside it: the same order as over the
        # median latency of the separate end-to-end runs (noise moves both)
        if r["check_us_digest"] > 0.02:
            ratio = r["cost_digest"] / (r["check_us_digest"] / r["lat_us_off"])
            assert 0.2 < ratio < 5, (r["cost_digest"], r["check_us_digest"], r["lat_us_off"])

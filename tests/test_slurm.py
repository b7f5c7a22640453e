"""The sbatch scripts in slurm/ on a real single-node Slurm cluster.

A session fixture brings the cluster up (slurm/ci-cluster-up.sh: munged, slurmctld, slurmd
from Debian's packages, started by hand) and stops it at the end. Outside CI the tests skip
when that is impossible (not root, no apt-get); in CI (CI=true) they fail instead, so a
broken cluster never passes as "skipped".

Every job asserts what a wrong srun --mpi plugin would break: the MPI world has as many
ranks as Slurm started tasks.
"""

import json
import os
import re
import sys

import pytest

from slurm_cluster import ROOT, Cluster, ClusterUnavailable, in_ci, run_job

pytestmark = pytest.mark.slurm

TRAIN = os.path.join(ROOT, "slurm", "train.sbatch")
SCALING = os.path.join(ROOT, "slurm", "scaling.sbatch")
# a small, fast training run: 2000 training and 2000 test images, one epoch
SMALL_TRAIN = ["--model", "mlp", "--epochs", "1", "--limit-train", "2000", "--limit-test", "2000",
               "--seed", "1", "--no-progress"]


@pytest.fixture(scope="session")
def cluster():
    c = Cluster()
    try:
        c.acquire()
    except ClusterUnavailable as e:
        if in_ci():
            pytest.fail(f"CI=true but the Slurm cluster cannot be brought up: {e}")
        pytest.skip(f"no Slurm cluster: {e}")
    print(f"\n[slurm] cluster up in {c.up_seconds:.1f}s")
    yield c
    print("\n[slurm] " + c.release().strip().replace("\n", "\n[slurm] "))


def epoch_metrics(output):
    """The per-epoch JSON objects `mpidl train` prints on stdout."""
    found = []
    for line in output.splitlines():
        m = re.search(r"\{.*\}", line)
        if m:
            try:
                obj = json.loads(m.group(0))
            except ValueError:
                continue
            if isinstance(obj, dict) and "epoch" in obj:
                found.append(obj)
    return found


HELLO = """\
import os
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank)
print(f"hello rank={comm.rank} size={comm.size} procid={os.environ['SLURM_PROCID']} "
      f"ntasks={os.environ['SLURM_NTASKS']} sum={total}", flush=True)
"""


@pytest.mark.parametrize("ntasks", [2, 4])
def test_mpi_hello_world_size_is_ntasks(cluster, tmp_path, ntasks):
    (tmp_path / "hello.py").write_text(HELLO)
    (tmp_path / "hello.sbatch").write_text(
        "#!/bin/bash\nset -euo pipefail\n"
        f"srun --mpi=pmi2 {sys.executable} {tmp_path / 'hello.py'}\n")
    job = run_job(tmp_path / "hello.sbatch", ntasks=ntasks, timeout=60, cwd=tmp_path)
    assert job.state == "COMPLETED", job.describe()
    lines = re.findall(r"hello rank=(\d+) size=(\d+) procid=(\d+) ntasks=(\d+) sum=(\d+)", job.output)
    assert len(lines) == ntasks, job.describe()
    assert sorted(int(r) for r, *_ in lines) == list(range(ntasks)), job.describe()
    for rank, size, procid, nt, total in lines:
        assert int(size) == ntasks == int(nt), f"comm.size {size} != tasks {ntasks}\n{job.describe()}"
        assert rank == procid  # MPI rank is Slurm's task id
        assert int(total) == ntasks * (ntasks - 1) // 2  # the ranks really talk


def test_wrong_mpi_plugin_is_caught(cluster, tmp_path):
    """--mpi=none starts two one-rank worlds; train.sbatch must fail before training."""
    job = run_job(TRAIN, ["--help"], ntasks=2, timeout=60, cwd=tmp_path,
                  env={"MPIDL_SRUN_MPI": "none"})
    assert job.state == "FAILED" and job.returncode != 0, job.describe()
    assert "MPI world size is 1 but Slurm started 2 tasks" in job.output, job.describe()
    assert "mpidl train" not in job.output.split("world-size check failed")[-1]


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_train_sbatch_small_run(cluster, tmp_path, launcher):
    job = run_job(TRAIN, SMALL_TRAIN, ntasks=2, timeout=150, cwd=tmp_path,
                  env={"MPIDL_LAUNCHER": launcher})
    assert job.state == "COMPLETED" and job.returncode == 0, job.describe()
    assert "MPI world size 2 == SLURM_NTASKS" in job.output, job.describe()
    metrics = epoch_metrics(job.output)
    assert [m["epoch"] for m in metrics] == [1], job.describe()  # printed once: by rank 0 only
    m = metrics[0]
    for key in ("train_loss", "test_loss", "test_acc", "images_per_sec"):
        assert key in m, f"epoch metrics lack {key!r}: {m}"
    assert 0.5 < m["test_acc"] <= 1.0, m  # 2000 images, one epoch: well above chance (0.1)
    sizes = [m[k] for k in ("ranks", "world_size") if k in m]
    assert sizes and all(v == 2 for v in sizes), f"epoch metrics do not say 2 ranks: {m}"


def test_train_sbatch_rank_failure_ends_job(cluster, tmp_path):
    """Rank 1 raises at step 3 (MPIDL_FAIL_AT test hook): the whole job ends FAILED, fast,
    with rank 1's traceback in its output."""
    job = run_job(TRAIN, SMALL_TRAIN, ntasks=2, timeout=90, cwd=tmp_path,
                  env={"MPIDL_FAIL_AT": "1:3"})
    assert job.state == "FAILED" and job.returncode != 0, job.describe()
    assert job.seconds < 60, f"the job took {job.seconds:.0f}s to end\n{job.describe()}"
    assert "Traceback" in job.output, job.describe()
    assert re.search(r"rank\s*\[?1\b", job.output, re.I), f"no trace of rank 1\n{job.describe()}"
    assert "MPIDL_FAIL_AT" in job.output or "step 3" in job.output, job.describe()


# a short benchmark: the scaling figures themselves come from bench/scaling.py runs, not here
SCALING_TEST_ARGS = "--quick --no-torch --repeats 1 --steps 5 --warmup 2"


def test_scaling_sbatch_collects_json(cluster, tmp_path):
    """scaling.sbatch on 2 tasks: world-size checks for 1 and 2 ranks, then the benchmark's
    JSON with results for both rank counts, and the job's record, in one folder."""
    out = tmp_path / "results"
    args = os.environ.get("MPIDL_SCALING_TEST_ARGS", SCALING_TEST_ARGS).split()
    job = run_job(SCALING, args, ntasks=2, timeout=150, cwd=tmp_path,
                  env={"MPIDL_RANKS": "1 2", "MPIDL_RESULTS": str(out)})
    assert job.state == "COMPLETED", job.describe()
    assert "1 rank(s): MPI world size 1 ok" in job.output, job.describe()
    assert "2 rank(s): MPI world size 2 ok" in job.output, job.describe()
    with open(out / "scaling.json") as f:
        report = json.load(f)
    ranks = {s["ranks"] for s in report["summary"].values()}
    assert ranks == {1, 2}, f"rank counts in scaling.json: {ranks}"
    assert all(s["images_per_sec"] > 0 for s in report["summary"].values()), report["summary"]
    with open(out / "slurm-job.json") as f:
        record = json.load(f)
    assert record["ranks"] == [1, 2] and record["SLURM_NTASKS"] == "2", record

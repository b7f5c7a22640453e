"""Launch real MPI ranks from pytest, with a timeout that turns a deadlock into a failure.

``run_ranks(n, [script, args...])`` runs ``mpiexec -n n python -m mpi4py script args``
(``python -m mpi4py`` turns an uncaught exception on one rank into MPI_Abort for all).
On timeout every process of the launch is killed and the test fails with each rank's
output, so a hang never stalls the suite.

Every launch goes through ``mpiexec_cmd()``, so ``MPIDL_MPIEXEC="mpirun --bind-to none"``
points the whole suite at a site's launcher; ``mpi_env()`` lets Open MPI run as root and
with more ranks than cores, as MPICH's Hydra does without being asked.
"""

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


def mpiexec_cmd():
    """The launcher the tests use, as a list to put ``-n N ...`` after: ``$MPIDL_MPIEXEC``
    (a command with options, split as a shell would), else the mpiexec beside this Python
    (the MPI wheel's: the one mpi4py was built for), else the one on PATH."""
    site = os.environ.get("MPIDL_MPIEXEC", "").strip()
    if site:
        return shlex.split(site)
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    return [found] if found else []


def mpiexec_path():
    """The launcher program of ``mpiexec_cmd()`` (None when there is none)."""
    cmd = mpiexec_cmd()
    return cmd[0] if cmd else None


def mpi_env(extra=None):
    env = dict(os.environ)
    # 4+ ranks oversubscribe 2 cores: let busy-polling ranks yield the core.
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    # Open MPI refuses root (CI containers) unless both are set; others ignore them
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    if extra:
        env.update(extra)
    return env


@dataclass
class Launch:
    returncode: int
    output: str
    timed_out: bool = False

    def check(self):
        """Fail (with every rank's output) unless the launch exited 0."""
        if self.timed_out:
            raise AssertionError(f"MPI launch timed out (a deadlock?); output:\n{self.output}")
        if self.returncode != 0:
            raise AssertionError(f"MPI launch exited {self.returncode}; output:\n{self.output}")
        return self


def run_ranks(n, args, timeout=120, env=None, module_mpi4py=True, cwd=None):
    """Run ``args`` (a script path and its arguments, or ``-m module ...``) on ``n`` ranks."""
    cmd = [*mpiexec_cmd(), "-n", str(n), sys.executable]
    if module_mpi4py:
        cmd += ["-m", "mpi4py"]
    cmd += [str(a) for a in args]
    return run_command(cmd, timeout=timeout, env=env, cwd=cwd)


#: what a launcher says when it failed to start before any rank ran (then the launch
#: is tried again, at most twice): Open MPI 5's PMIx server now and then, under load
LAUNCHER_START_FAILURES = ("The PMIx server's listener thread failed to start",)


def run_command(cmd, timeout=120, env=None, cwd=None):
    """Run a plain command (e.g. ``mpiexec -n 2 mpidl train ...``) with the same timeout rule."""
    for _ in range(2):
        launch = _run_once(cmd, timeout, env, cwd)
        if launch.returncode == 0 or not any(m in launch.output
                                             for m in LAUNCHER_START_FAILURES):
            return launch
        sys.stderr.write(f"mpirun.py: the launcher failed to start, trying again:\n"
                         f"{launch.output[-400:]}\n")
    return _run_once(cmd, timeout, env, cwd)


def _run_once(cmd, timeout, env, cwd):
    # stdin closed: Open MPI's launcher forwards stdin to rank 0 and, with ULFM on, waits
    # at the end for an open one that never closes
    proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=mpi_env(env), cwd=cwd, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Launch(proc.returncode, out)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return Launch(proc.returncode, out, timed_out=True)
    except BaseException:  # pytest's own timeout, Ctrl-C: the launch must not outlive it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise


def run_cli_cases(cases, n=1, timeout=300, cwd=None):
    """Each of ``cases`` (``mpidl`` argument lists) run in one process, one after another
    (``tests/cli_cases.py``), or on ``n`` ranks under mpiexec: a ``Launch`` per case, for
    bad input refused before training starts. A case's output is every rank's, rank 0's
    first, and its status the first rank's that is not 0 (as mpiexec reports); the
    launch's own output if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cases.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump([[str(a) for a in argv] for argv in cases], f)
        script = [os.path.join(HERE, "cli_cases.py"), path]
        if n == 1:
            launch = run_command([sys.executable, *script], timeout=timeout, cwd=cwd)
            ranks = [launch.output]
        else:
            launch = run_ranks(n, script, timeout=timeout, cwd=cwd)
            ranks = [_read(f"{path}.{r}") for r in range(n)]
    per_rank = [[json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
                for text in ranks]
    assert not launch.timed_out and all(len(got) == len(cases) for got in per_rank), \
        launch.output
    out = []
    for results in zip(*per_rank):
        status = next((r["returncode"] for r in results if r["returncode"]), 0)
        out.append(Launch(status, "".join(r["output"] for r in results)))
    return out


def _read(path):
    """A file's text, or "" where there is none (a rank that never got to write it)."""
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def fashion_available():
    """Whether Fashion-MNIST is installed (Debian's dataset-fashion-mnist package); asked
    by many test modules at import, answered once per process."""
    from mpidl.data import load_dataset  # noqa: PLC0415
    from mpidl.errors import DataError  # noqa: PLC0415

    try:
        load_dataset("fashion-mnist", limit_train=1, limit_test=1)
    except DataError:
        return False
    return True


from mpidl.benchmarks.chaos import rank_pids  # noqa: E402,F401  (the tests' name for it)


def model_arrays(path):
    """The arrays of a saved model (.npz), without its metadata entries."""
    import numpy as np  # noqa: PLC0415

    with np.load(path) as z:
        return {k: z[k] for k in z.files if not k.startswith("__")}


def assert_bitwise_equal(a, b):
    """Two models' arrays (``model_arrays``) are the same bits, name by name."""
    import numpy as np  # noqa: PLC0415

    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k], b[k]), f"{k} differs (max |diff| "\
            f"{np.max(np.abs(a[k].astype(float) - b[k].astype(float)))})"


def train_cmd(n, out, *args, dtype="float64"):
    """``mpiexec -n n mpidl train`` writing its outputs to ``out`` (no progress bar;
    float64 unless ``dtype`` says otherwise); ``n=None``: one process, no launcher."""
    launcher = [] if n is None else [*mpiexec_cmd(), "-n", str(n)]
    return (launcher + [sys.executable, "-m", "mpidl.cli.main", "train", "--no-progress",
                        "--dtype", dtype, "--out-dir", str(out), *args])


def needs_fashion():
    """Skip the calling test when Fashion-MNIST is not installed."""
    import pytest  # noqa: PLC0415

    if not fashion_available():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


def error_lines(output):
    """The ``mpidl: error:`` lines of a launch's output."""
    return [line for line in output.splitlines() if line.startswith("mpidl: error:")]


def assert_one_line_error(launch, *needles):
    """A user error: exit 2, exactly one ``mpidl: error:`` line holding ``needles``, no
    traceback and nothing else from the ranks. What the launcher adds of its own (Open
    MPI's exit banner, libevent warnings) is its business, not mpidl's."""
    assert not launch.timed_out, launch.output
    assert launch.returncode == 2, launch.output
    lines = error_lines(launch.output)
    assert len(lines) == 1, f"expected one mpidl: error: line, got:\n{launch.output}"
    line = lines[0]
    # nothing else from the ranks: no traceback, no rank-prefixed log lines
    assert "Traceback" not in launch.output and "[rank " not in launch.output, launch.output
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line

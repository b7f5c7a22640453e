"""The single-node Slurm cluster the Slurm tests run on, and job helpers.

``Cluster.acquire()`` brings the cluster up with ``slurm/ci-cluster-up.sh`` (munged,
slurmctld, slurmd started by hand; Debian packages installed when missing) and
``release()`` stops it again with ``slurm/ci-cluster-down.sh``, which stops exactly the
daemons the up script started (by PID) and removes stale MPICH shared-memory segments.

Several pytest sessions on one machine (several checkouts, several developers) share the
cluster: each holds a shared lock on ``$SLURM_CI_BASE/pytest-users.lock`` while it runs, and
the last one out stops the cluster, and only if a pytest session started it (a cluster
someone brought up by hand is left running). ``MPIDL_SLURM_KEEP=1`` keeps it up for the next
run.

``run_job()`` submits with ``sbatch --parsable`` and polls ``scontrol`` every 0.2 s (``sbatch
-W`` polls every 2 s, then slower) until the job ends or the timeout cancels it.
"""

import fcntl
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_DIR = os.path.join(ROOT, "slurm")
BASE = os.environ.get("SLURM_CI_BASE", "/tmp/slurm-ci")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class ClusterUnavailable(Exception):
    """The cluster cannot be brought up here (not root, no apt, a daemon failed)."""


def in_ci():
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _alive(name):
    """The daemon whose PID ci-cluster-up.sh recorded in $BASE/run/NAME.pid is running."""
    try:
        with open(os.path.join(BASE, "run", name + ".pid")) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == name
    except (OSError, ValueError):
        return False


def _flock(path, mode, timeout):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    end = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > end:
                os.close(fd)
                raise ClusterUnavailable(f"timed out after {timeout}s waiting for {path}")
            time.sleep(0.2)


def _run_script(name, timeout, log_name):
    """Run slurm/NAME with output to a log file (the daemons it starts must not inherit a
    pipe that pytest waits on); return (exit code, log text)."""
    log = os.path.join(BASE, log_name)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(["bash", os.path.join(SLURM_DIR, name)], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log) as f:
        return rc, f.read()


class Cluster:
    def __init__(self):
        self.users_fd = None
        self.up_log = ""
        self.up_seconds = 0.0

    def acquire(self, timeout=300):
        if os.geteuid() != 0:
            raise ClusterUnavailable("needs root: the tests start munged, slurmctld and slurmd "
                                     "themselves (slurm/ci-cluster-up.sh); CI runs as root")
        have_slurm = all(os.path.exists(p) for p in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd",
                                                     "/usr/bin/sbatch", "/usr/sbin/munged"))
        if not have_slurm and not os.path.exists("/usr/bin/apt-get"):
            raise ClusterUnavailable("Slurm is not installed and there is no apt-get to install "
                                     "munge, slurmctld, slurmd and slurm-client")
        os.makedirs(BASE, exist_ok=True)
        self.users_fd = _flock(os.path.join(BASE, "pytest-users.lock"), fcntl.LOCK_SH, timeout)
        lock = _flock(os.path.join(BASE, "cluster.lock"), fcntl.LOCK_EX, timeout)
        try:
            was_up = _alive("slurmctld") and _alive("slurmd")
            t0 = time.monotonic()
            rc, self.up_log = _run_script("ci-cluster-up.sh", timeout, "ci-cluster-up.out")
            self.up_seconds = time.monotonic() - t0
            if rc == 0 and not was_up:
                with open(os.path.join(BASE, "run", "started-by-pytest"), "w") as f:
                    f.write(f"{os.getpid()}\n")
        finally:
            os.close(lock)
        if rc != 0:  # stop whatever half of it came up (unless it was up before)
            self.release(force_down=not was_up)
            raise ClusterUnavailable(f"slurm/ci-cluster-up.sh exited {rc}:\n{self.up_log[-4000:]}")
        return self

    def release(self, force_down=False):
        """Stop the cluster if no other pytest session uses it and a pytest session started
        it; returns what ci-cluster-down.sh printed (or why it was left up)."""
        if self.users_fd is None:
            return "not acquired"
        lock = _flock(os.path.join(BASE, "cluster.lock"), fcntl.LOCK_EX, 120)
        try:
            try:  # upgrade shared -> exclusive: fails while another session holds it
                fcntl.flock(self.users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "left up: another pytest session is using it"
            marker = os.path.join(BASE, "run", "started-by-pytest")
            if os.environ.get("MPIDL_SLURM_KEEP") == "1":
                return "left up: MPIDL_SLURM_KEEP=1"
            if not (force_down or os.path.exists(marker)):
                return "left up: it was running before the tests"
            _, out = _run_script("ci-cluster-down.sh", 120, "ci-cluster-down.out")
            try:
                os.remove(marker)
            except FileNotFoundError:
                pass
            return out
        finally:
            os.close(lock)
            os.close(self.users_fd)
            self.users_fd = None


@dataclass
class Job:
    job_id: str
    state: str
    exit_code: str  # "rc:signal", as scontrol shows it
    output: str
    seconds: float  # from submission until scontrol reported the end

    @property
    def returncode(self):
        return int(self.exit_code.split(":")[0]) if self.exit_code else -1

    def describe(self):
        return (f"job {self.job_id} {self.state} exit={self.exit_code} after {self.seconds:.1f}s; "
                f"output:\n{self.output}")


def job_env(extra=None):
    """The environment sbatch exports to the job (--export=ALL is Slurm's default)."""
    env = dict(os.environ)
    for k in list(env):  # pytest's own state must not leak into the job
        if k.startswith("PYTEST_") or k.startswith("SLURM_"):
            del env[k]
    env.update({
        # 4 ranks on 2 cores: let MPICH's busy-polling ranks yield the core
        "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if sys.prefix != sys.base_prefix:  # the venv running the tests is the one jobs use
        env["MPIDL_VENV"] = sys.prefix
    if extra:
        env.update(extra)
    return env


def scontrol_job(job_id):
    """scontrol's view of a job as a dict of its Key=Value fields ({} once it is forgotten)."""
    p = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                       text=True, timeout=30)
    if p.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout))


def wait_job(job_id, timeout):
    """Poll every 0.2 s until the job ends; on timeout cancel it. Returns (state, exit code)."""
    end = time.monotonic() + timeout
    info = {}
    while time.monotonic() < end:
        info = scontrol_job(job_id)
        if not info:
            return "UNKNOWN", ""
        if info.get("JobState") in TERMINAL:
            return info["JobState"], info.get("ExitCode", "")
        time.sleep(0.2)
    subprocess.run(["scancel", str(job_id)], timeout=30)
    return f"WAIT_TIMEOUT (was {info.get('JobState')})", info.get("ExitCode", "")


def run_job(script, args=(), ntasks=1, timeout=120, env=None, cwd=None, sbatch_opts=()):
    """Submit ``script args`` with ``sbatch -n ntasks``, wait for it, return a Job with the
    job's output (stdout and stderr together)."""
    cwd = cwd or ROOT
    out = os.path.join(cwd, "slurm-%j.out")
    cmd = ["sbatch", "--parsable", f"--ntasks={ntasks}", f"--output={out}", f"--chdir={cwd}",
           *sbatch_opts, str(script), *[str(a) for a in args]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(env), cwd=cwd,
                       timeout=60, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr}{p.stdout}")
    job_id = p.stdout.strip().split(";")[0]
    state, exit_code = wait_job(job_id, timeout)
    seconds = time.monotonic() - t0
    path = out.replace("%j", job_id)
    try:
        with open(path, errors="replace") as f:
            output = f.read()
    except FileNotFoundError:
        output = f"(no output file {path})"
    return Job(job_id, state, exit_code, output, seconds)

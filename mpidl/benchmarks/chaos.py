"""Kill a rank of a running launch: what the elastic tests and ``bench/elastic.py`` do
to a run (``mpidl train --elastic``) to see that the others go on."""

import os
import signal
import subprocess
import threading
import time

RANK_VARIABLES = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")


def rank_pids(launcher_pid):
    """{rank: pid} of the MPI ranks started under the launcher process ``launcher_pid``
    (descendants whose environment has PMI_RANK, or Open MPI's/PMIx's equivalent)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(entry)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    ranks = {}
    for pid in parent:
        up = pid
        while up in parent and up != launcher_pid:
            up = parent[up]
        if up != launcher_pid or pid == launcher_pid:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(RANK_VARIABLES):
                ranks[int(var.split(b"=", 1)[1])] = pid
                break
    return ranks


def kill_during(cmd, victim, delay, env=None, cwd=None, started="] training ",
                timeout=600):
    """Run ``cmd`` (a launch), SIGKILL world rank ``victim`` ``delay`` seconds after a
    line containing ``started`` appears, wait for the launch to end. Returns {"output",
    "status" (None: it did not end within ``timeout`` s and was killed: a hang),
    "killed_at" (time.time()), "killed" (whether the rank was still there to kill)}."""
    proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=cwd, text=True, start_new_session=True)
    lines, seen = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if started in line:
                seen.set()
        seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen.wait(timeout)
    time.sleep(delay)
    killed_at = time.time()
    pid = rank_pids(proc.pid).get(victim)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    try:
        status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        status = None
    reader.join(10)
    return {"output": "".join(lines), "status": status, "killed_at": killed_at,
            "killed": pid is not None}

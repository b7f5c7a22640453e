"""Ranks end when their launcher dies: no orphans left training and writing checkpoints.

When ``mpiexec`` is killed with SIGKILL it cannot tell its ranks. MPICH's Hydra proxies
then end them, but Open MPI's launcher (``prterun``, ``mpirun`` 4.x) leaves them running:
they go on training, holding the GPU and writing checkpoints nobody asked for. A rank
notices because its parent changes: an orphan is adopted by init or a subreaper. So
every rank of a multi-rank job watches ``os.getppid()`` from a daemon thread and, once
the parent it started with is gone, prints one line and exits non-zero.

Why a polling thread rather than ``PR_SET_PDEATHSIG``: the kernel sends that signal when
the parent *thread* that forked the rank exits, and Open MPI's launchers fork from a
helper thread, so it can fire while the launcher is alive; it is also Linux-only. The
poll is one cheap system call a second. A process started without a launcher (one rank)
is never watched: a single-process run whose shell exits must keep running, as before.
"""

import os
import sys
import threading
import time

#: seconds between two looks at the parent (the job ends at most this long after it)
POLL_S = 1.0
#: exit status of a rank whose launcher died (a crash, not a user error)
LAUNCHER_DIED_STATUS = 1


def watch_launcher(world_size, poll_s=POLL_S):
    """Start the watchdog for this rank when the job has several ranks; returns the
    thread (None when nothing is watched)."""
    parent = os.getppid()
    if world_size <= 1 or parent <= 1:  # alone, or already adopted: nothing to watch
        return None
    thread = threading.Thread(target=_watch, args=(parent, poll_s), daemon=True,
                              name="mpidl-launcher-watchdog")
    thread.start()
    return thread


def _watch(parent, poll_s):
    while os.getppid() == parent:
        time.sleep(poll_s)
    try:
        sys.stderr.write(f"mpidl: error: the MPI launcher (process {parent}) died; "
                         f"ending this rank (pid {os.getpid()})\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # the launcher held our stderr: nobody reads it now
        pass
    os._exit(LAUNCHER_DIED_STATUS)

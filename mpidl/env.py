"""Every ``MPIDL_*`` environment variable mpidl reads, in one place.

The variables are knobs for experiments and tests, not a second configuration system:
settings a user chooses per run are flags (``mpidl train --help``). Read them through
``get``/``number``/``flag`` only, so this table stays the whole list (``mpidl info``
prints the ones set). A name not in the table is a programming error.
"""

import os

#: name -> (default, what it does)
VARIABLES = {
    "MPIDL_DEVICE": ("cpu", "default device when none is given: cpu or gpu"),
    "MPIDL_CUDA_AWARE": (None, "0/1: override the detection of a CUDA-aware MPI"),
    "MPIDL_DATA_DIR": (None, "folder holding <dataset>/ folders (before the system ones)"),
    "MPIDL_TUNING": (None, "tuning file of the communicator's 'auto' algorithm choice"),
    "MPIDL_RING_SEGMENT": ("1048576", "bytes per ring pipeline segment"),
    "MPIDL_RANKS_PER_NODE": (None, "tests: the hierarchical all-reduce takes each K "
                                   "consecutive ranks for a node (default: ranks that share "
                                   "memory)"),
    "MPIDL_DEBUG": ("0", "1: check every collective call's signature across ranks"),
    "MPIDL_PROGRESS": ("thread", "eager: no progress thread (non-blocking calls complete "
                                 "when issued)"),
    "MPIDL_PROGRESS_WAIT": ("block", "poll: the progress thread polls and sleeps instead "
                                     "of blocking inside MPI"),
    "MPIDL_STALL_WARNING": ("60", "seconds a rank waits in a collective, point-to-point "
                                  "call or protocol before it names who has not arrived "
                                  "(--stall-warning)"),
    "MPIDL_STALL_TIMEOUT": ("0", "seconds of such a wait before the job is aborted; 0: "
                                 "never (--stall-timeout)"),
    "MPIDL_EXIT_TIMEOUT": ("30", "seconds to wait at exit for unfinished non-blocking "
                                 "collectives"),
    "MPIDL_FAIL_AT": (None, "tests: RANK:STEP[,RANK:STEP...] raises on that rank before "
                            "that step"),
    "MPIDL_KILL_AT": (None, "tests: RANK:STEP[,RANK:STEP...] kills that process (world "
                            "rank) with SIGKILL at the start of that step, a parameter "
                            "server once it applied that many updates (elastic runs)"),
    "MPIDL_CRASH_IN_CHECKPOINT": (None, "tests: N[:BYTES] kills the process while writing "
                                        "the N-th checkpoint"),
    "MPIDL_MALLOC_KEEP": ("1", "0: leave glibc's malloc thresholds as they are (1: large "
                               "freed blocks stay in the heap; mpidl.allocator)"),
    "MPIDL_SLOW": ("0", "tests: 1 runs the slow (full-accuracy) tests too"),
}


def _entry(name):
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not an mpidl environment variable (see mpidl.env)") \
            from None


def get(name):
    """The variable's value, or its default (None when it has none)."""
    default, _ = _entry(name)
    return os.environ.get(name, default)


def number(name, cast=float):
    """The variable as a number; a malformed value is an error naming the variable."""
    value = get(name)
    if value is None:
        return None
    try:
        return cast(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a {cast.__name__}") from None


def rank_steps(name):
    """``RANK:STEP[,RANK:STEP...]`` -> {rank: {steps}} (the test hooks MPIDL_FAIL_AT and
    MPIDL_KILL_AT); a malformed value is an error naming the variable."""
    from mpidl.errors import ConfigError  # noqa: PLC0415

    spec, out = get(name), {}
    for part in (spec or "").split(","):
        if not part:
            continue
        try:
            rank, step = (int(v) for v in part.split(":"))
        except ValueError:
            raise ConfigError(f"{name}={spec!r}: expected RANK:STEP[,RANK:STEP...]") from None
        out.setdefault(rank, set()).add(step)
    return out


def kill_now():
    """SIGKILL this process (the MPIDL_KILL_AT test hook: a rank that dies)."""
    import signal  # noqa: PLC0415

    os.kill(os.getpid(), signal.SIGKILL)


def flag(name):
    """True for 1/true/yes/on (any case)."""
    return str(get(name) or "").strip().lower() in ("1", "true", "yes", "on")


def set_variables():
    """{name: value} of the variables set in this process's environment."""
    return {k: os.environ[k] for k in VARIABLES if k in os.environ}


def cache_dir():
    """mpidl's cache folder: ``$XDG_CACHE_HOME/mpidl`` (``~/.cache/mpidl``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mpidl")

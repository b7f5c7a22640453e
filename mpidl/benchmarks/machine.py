"""What a benchmark ran on, for its JSON report (shared by every benchmark)."""

import platform


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe():
    """The machine and library versions, for a benchmark's JSON report."""
    import os  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}


def mpiexec():
    """The ``mpiexec`` beside this Python (the venv's MPICH), else the one on PATH."""
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else "mpiexec"


def bench_env(root, tuning_name):
    """``launch_env`` for a benchmark that launches ``mpiexec`` itself (``MPIEXEC``: the
    venv's, which ``slurm/vcluster.sh`` also runs) with no tuning file (``auto`` on its
    defaults: ``tuning_name`` names a file that does not exist)."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    env = launch_env(root)
    env.setdefault("MPIEXEC", mpiexec())
    env["MPIDL_TUNING"] = os.path.join(tempfile.gettempdir(), tuning_name)
    return env


def launch_env(root):
    """The environment for ranks a benchmark launches: one thread per rank, MPICH
    yielding the core while it waits (ranks may share cores), ``root`` importable."""
    import os  # noqa: PLC0415

    env = dict(os.environ)
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        env.setdefault(var, "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env

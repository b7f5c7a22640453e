"""CPU threads per rank: each rank on a node gets its share of the node's cores.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core in every process. Under
``mpiexec -n 4`` on a 4-core node that is 16 threads on 4 cores, and a step runs several
times slower than with one thread per rank (4.7x slower for the MLP with 2 ranks on 2
cores). ``torchrun`` sets ``OMP_NUM_THREADS=1`` for the same reason. The thread count a
BLAS uses is read from the environment when NumPy is first imported, so the ``mpidl``
command calls ``share_blas_threads()`` before anything imports NumPy. An explicit
``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS`` always wins.
"""

import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: what MPI launchers (MPICH/Hydra, Open MPI, Slurm, PMIx, Cray PALS) say about the
#: number of ranks on this node
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE",
                   "PALS_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE")


def ranks_on_this_node(environ=None):
    """The number of ranks the launcher started on this node (1 if it does not say).

    Slurm's count is used only in a task that srun started (SLURM_LOCALID is set): a
    batch script itself is one process, whatever its allocation."""
    env = os.environ if environ is None else environ
    for var in LOCAL_SIZE_VARS:
        if var.startswith("SLURM_") and "SLURM_LOCALID" not in env:
            continue
        value = env.get(var, "")
        # Slurm writes "4" or "4(x2)" (4 tasks on each of 2 nodes): take the first count
        head = value.split("(")[0].split(",")[0].strip()
        if head.isdigit() and int(head) > 0:
            return int(head)
    return 1


def blas_threads_set(environ=None):
    """The BLAS thread count the environment sets (the first of ``THREAD_VARS`` holding a
    positive number), or None."""
    env = os.environ if environ is None else environ
    for var in THREAD_VARS:
        value = env.get(var, "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def blas_threads_share(environ=None, cpus=None):
    """The BLAS threads this rank should use, or None to leave the BLAS alone (one rank
    on the node, or the user chose a thread count)."""
    env = os.environ if environ is None else environ
    if any(env.get(var) for var in THREAD_VARS):
        return None
    ranks = ranks_on_this_node(env)
    if ranks <= 1:
        return None
    return max(1, (usable_cpus() if cpus is None else cpus) // ranks)


def share_blas_threads():
    """Set the BLAS thread variables to this rank's share of the node's cores, if NumPy
    is not imported yet and nobody chose a count. Returns the count set, or None."""
    global _SET_BY_MPIDL
    if "numpy" in sys.modules:
        return None
    share = blas_threads_share()
    if share is not None:
        for var in THREAD_VARS:
            os.environ[var] = str(share)
        _SET_BY_MPIDL = f"{usable_cpus()} CPUs / {ranks_on_this_node()} ranks on this node"
    return share


_SET_BY_MPIDL = None  # why share_blas_threads() chose the count, when it did


def blas_threads_note():
    """One phrase for the start-of-training log line: the BLAS threads per rank and who
    chose them."""
    if _SET_BY_MPIDL:
        return (f"BLAS threads {os.environ['OMP_NUM_THREADS']} per rank ({_SET_BY_MPIDL}; "
                "set OMP_NUM_THREADS to choose)")
    chosen = next((f"{var}={os.environ[var]}" for var in THREAD_VARS if os.environ.get(var)),
                  None)
    return f"BLAS threads {chosen}" if chosen else "BLAS threads: library default"

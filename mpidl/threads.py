"""CPU threads per rank: each rank on a node gets its share of the node's cores.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core in every process. Under
``mpiexec -n 4`` on a 4-core node that is 16 threads on 4 cores, and a step runs several
times slower than with one thread per rank (4.7x slower for the MLP with 2 ranks on 2
cores). ``torchrun`` sets ``OMP_NUM_THREADS=1`` for the same reason. The thread count a
BLAS uses is read from the environment when NumPy is first imported, so the ``mpidl``
command calls ``share_blas_threads()`` before anything imports NumPy. An explicit
``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS`` always wins.

A rank's share is its CPUs divided by the ranks of the node it shares them with. Under
MPICH's Hydra every rank may run on every core, so that is the node's CPUs over the ranks;
Open MPI (bound to cores by default), Intel MPI (pinned) and ``srun -c 8`` hand each rank
CPUs of its own, already its share, which must not be divided again. Which case holds
cannot be read from one rank's affinity (a job confined by a cgroup looks bound), so the
ranks of a node compare their CPU sets once, over MPI, before NumPy is imported.
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


def cpu_set():
    """The CPUs this process may run on (its affinity)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def usable_cpus():
    return len(cpu_set())


def sharing_ranks(mine, node_sets):
    """How many of the node's ranks (CPU sets ``node_sets``, this rank's ``mine`` among
    them) may run on this rank's CPUs: all of them when nobody is bound, 1 when each rank
    has CPUs of its own."""
    mine = set(mine)
    return max(1, sum(1 for cpus in node_sets if mine & set(cpus)))


def blas_threads_share(environ=None, cpus=None, node_sets=None):
    """The BLAS threads this rank should use, or None to leave the BLAS alone (one rank
    on the node, or the user chose a thread count).

    ``cpus``: this rank's CPU set (or only its size); ``node_sets``: the CPU sets of the
    node's ranks. Without them every rank is taken to share every CPU (divide by ranks)."""
    env = os.environ if environ is None else environ
    if any(env.get(var) for var in THREAD_VARS):
        return None
    ranks = ranks_on_this_node(env)
    if ranks <= 1:
        return None
    cpus = cpu_set() if cpus is None else cpus
    count = cpus if isinstance(cpus, int) else len(cpus)
    sharing = ranks if node_sets is None else sharing_ranks(cpus, node_sets)
    return max(1, count // sharing)


#: set by launchers in every rank they start (Hydra/PMI, Open MPI, PMIx, Cray PALS, srun)
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID")


def node_cpu_sets(mine):
    """The CPU sets of every rank on this node, gathered over MPI (mpi4py's pickled
    objects: NumPy stays unimported), or None without MPI or with one rank.

    A collective over the world: every rank must call it, so whether to call depends on
    nothing that may differ between ranks (a node with one rank, a thread count set on
    some ranks only)."""
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    if world.Get_size() <= 1:
        return None
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return [frozenset(s) for s in node.allgather(sorted(mine))]
    finally:
        node.Free()


def share_blas_threads():
    """Set the BLAS thread variables to this rank's share of its CPUs, if NumPy is not
    imported yet and nobody chose a count. Returns the count set, or None."""
    global _SET_BY_MPIDL
    if "numpy" in sys.modules:
        return None
    mine = cpu_set()
    launched = any(var in os.environ for var in RANK_VARS)
    node_sets = node_cpu_sets(mine) if launched else None
    share = blas_threads_share(cpus=mine, node_sets=node_sets)
    if share is None:
        return None
    for var in THREAD_VARS:
        os.environ[var] = str(share)
    sharing = None if node_sets is None else sharing_ranks(mine, node_sets)
    if sharing is None:
        _SET_BY_MPIDL = f"{len(mine)} CPUs / {ranks_on_this_node()} ranks on this node"
    elif sharing == 1:
        _SET_BY_MPIDL = f"{len(mine)} CPUs bound to this rank alone"
    else:
        _SET_BY_MPIDL = f"{len(mine)} CPUs shared by {sharing} ranks on this node"
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

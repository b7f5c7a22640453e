"""Each rank gets its share of the node's cores for NumPy's BLAS (mpidl.threads)."""

import subprocess
import sys

import pytest

from mpidl import threads
from mpirun import mpi_env, mpiexec_cmd


@pytest.mark.parametrize("env, want", [
    ({}, 1),
    ({"MPI_LOCALNRANKS": "4"}, 4),                     # MPICH / Hydra
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3),          # Open MPI
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_LOCALID": "0"}, 8),  # srun: 8 a node
    ({"SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_LOCALID": "1"}, 2),
    ({"SLURM_STEP_TASKS_PER_NODE": "4"}, 1),           # not a task srun started
    ({"MPI_LOCALNRANKS": "junk"}, 1),
])
def test_ranks_on_this_node_from_the_launcher(env, want):
    assert threads.ranks_on_this_node(env) == want


def test_share_of_the_cores_unless_the_user_chose():
    assert threads.blas_threads_share({"MPI_LOCALNRANKS": "2"}, cpus=8) == 4
    assert threads.blas_threads_share({"MPI_LOCALNRANKS": "4"}, cpus=2) == 1  # at least 1
    assert threads.blas_threads_share({}, cpus=8) is None                     # one rank
    for var in threads.THREAD_VARS:
        assert threads.blas_threads_share({"MPI_LOCALNRANKS": "2", var: "3"}, cpus=8) is None


@pytest.mark.parametrize("mine, node, want", [
    (range(16), [range(16)] * 2, 8),                      # Hydra, unbound: 16 CPUs / 2
    (range(8), [range(8), range(8, 16)], 8),               # srun -c 8, Open MPI bound: own 8
    (range(0, 8), [range(8), range(8), range(8, 16), range(8, 16)], 4),  # bound to a socket
    ({3}, [{0}, {1}, {2}, {3}], 1),                        # --bind-to core
    ({0, 1}, [{0, 1}, {1, 2}, {5, 6}], 1),                 # overlaps one other rank: 2 / 2
])
def test_the_share_counts_only_the_ranks_that_share_my_cpus(mine, node, want):
    env = {"MPI_LOCALNRANKS": str(len(node))}
    assert threads.blas_threads_share(env, set(mine), [set(c) for c in node]) == want


@pytest.mark.mpi_matrix
def test_the_mpidl_command_sets_the_share_before_numpy_under_mpiexec():
    """Under whatever binding the launcher chooses (Hydra: none; Open MPI: a core each),
    each rank's count is its CPUs over the ranks of the node that share them."""
    # one write() per rank: print() writes in pieces that two ranks' output can interleave
    code = ("import mpidl.cli.main, os, sys; import numpy; "
            "os.write(1, ('threads %s cpus %s\\n' % (os.environ.get('OMP_NUM_THREADS'), "
            "','.join(map(str, sorted(os.sched_getaffinity(0)))))).encode())")
    env = mpi_env()
    for var in threads.THREAD_VARS:
        env.pop(var, None)
    out = subprocess.run([*mpiexec_cmd(), "-n", "2", sys.executable, "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("threads ")]
    assert len(rows) == 2, out.stdout
    sets = [set(map(int, row[3].split(","))) for row in rows]
    for row, mine in zip(rows, sets):
        assert row[1] == str(threads.blas_threads_share({"MPI_LOCALNRANKS": "2"}, mine, sets))
    # the user's choice stays
    env["OMP_NUM_THREADS"] = "3"
    out = subprocess.run([*mpiexec_cmd(), "-n", "2", sys.executable, "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, timeout=60)
    assert out.stdout.count("threads 3") == 2, out.stdout


@pytest.mark.mpi_matrix
def test_ranks_that_differ_in_their_thread_variables_do_not_hang():
    """The CPU sets are gathered by a collective every rank joins, so a count chosen on
    one rank only (an MPMD launch) changes that rank's share, never the others' progress."""
    code = ("import mpidl.cli.main, os; "
            "os.write(1, ('threads %s\\n' % os.environ.get('OMP_NUM_THREADS')).encode())")
    env = mpi_env()
    for var in threads.THREAD_VARS:
        env.pop(var, None)
    out = subprocess.run([*mpiexec_cmd(), "-n", "1", "env", "OMP_NUM_THREADS=3", sys.executable,
                          "-c", code, ":", "-n", "1", sys.executable, "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stdout
    assert out.stdout.count("threads 3") == 1 and out.stdout.count("threads ") == 2, out.stdout

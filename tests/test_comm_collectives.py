"""Every algorithm of every collective equals MPI's native result, on real ranks.

One launch per p runs tests/ranks/comm_equivalence.py (grid of collectives x algorithms x
dtypes x counts, >= 4M elements, a seeded random draw, non-blocking forms, the staging
transport); a deadlock becomes a timeout with every rank's output.
"""

import os

import pytest

from mpirun import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks", "comm_equivalence.py")


MATRIX = pytest.mark.mpi_matrix  # p = 3 runs again under each other MPI (its calls are p = 2's)


@pytest.mark.parametrize("p", [1, 2, pytest.param(3, marks=MATRIX),
                               4, pytest.param(5, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_every_algorithm_equals_native(p):
    launch = run_ranks(p, [SCRIPT], timeout=300).check()
    assert f"EQUIVALENCE OK p={p}" in launch.output, launch.output
    for section in ("grid", "large", "random", "nonblocking", "staged"):
        assert f"section {section}:" in launch.output, launch.output


def test_random_draws_with_another_seed():
    launch = run_ranks(3, [SCRIPT, "--sections", "random", "--seed", "99"], timeout=120)
    launch.check()
    assert "EQUIVALENCE OK p=3" in launch.output, launch.output


@pytest.mark.mpi_matrix
def test_nonblocking_with_polling_progress_thread():
    """MPIDL_PROGRESS_WAIT=poll: the progress thread polls and sleeps instead of spinning."""
    launch = run_ranks(3, [SCRIPT, "--sections", "nonblocking"], timeout=120,
                       env={"MPIDL_PROGRESS_WAIT": "poll"}).check()
    assert "EQUIVALENCE OK p=3" in launch.output, launch.output


@pytest.mark.parametrize("p, per_node", [pytest.param(4, 2, marks=MATRIX), (5, 3)])
def test_hierarchical_equals_native_on_pretended_nodes(p, per_node):
    """The node-aware algorithm (``algorithm="hierarchical"``) of every collective equals
    MPI's native result, on nodes pretended by ``MPIDL_RANKS_PER_NODE`` (2 + 2 ranks;
    3 + 2: a node of its own size, a leader that is not rank 0's node)."""
    launch = run_ranks(p, [SCRIPT, "--sections", "grid,random,nonblocking",
                           "--algorithms", "hierarchical"], timeout=300,
                       env={"MPIDL_RANKS_PER_NODE": str(per_node)}).check()
    assert f"EQUIVALENCE OK p={p}" in launch.output, launch.output

"""split, node-local rank, background progress, handles and the timeline on real ranks."""

import os

import pytest

from mpirun import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def test_split_progress_handles_timeline(tmp_path):
    launch = run_ranks(3, [os.path.join(HERE, "ranks", "comm_misc.py"), tmp_path],
                       timeout=120).check()
    assert "MISC OK" in launch.output, launch.output
    assert (tmp_path / "trace.json").exists()
    for r in range(3):
        assert (tmp_path / f"trace-{r}.json").exists()


def test_eager_progress_when_asked(tmp_path):
    launch = run_ranks(2, [os.path.join(HERE, "ranks", "comm_misc.py"), tmp_path],
                       timeout=120, env={"MPIDL_PROGRESS": "eager"}).check()
    assert "MISC OK" in launch.output, launch.output
    assert "progress mode eager" in launch.output, launch.output


@pytest.mark.mpi_matrix_extra
def test_exit_does_not_hang_on_an_orphaned_nonblocking_collective():
    launch = run_ranks(2, [os.path.join(HERE, "ranks", "comm_exit_stall.py")], timeout=60,
                       env={"MPIDL_EXIT_TIMEOUT": "2"}, module_mpi4py=False).check()
    assert "non-blocking collectives still running at exit" in launch.output, launch.output

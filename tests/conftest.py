import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA device (skipped otherwise)")
    config.addinivalue_line("markers", "slurm: needs the single-node Slurm cluster (tests/slurm)")
    config.addinivalue_line("markers", "slow: trains on real data; minutes, not seconds")
    config.addinivalue_line("markers", "mpi_matrix: the multi-rank slice CI runs again under "
                            "each other MPI (collectives incl. float16, data parallelism, "
                            "one-line errors, fp16 compression, launcher behaviour): "
                            "pytest -m mpi_matrix")
    config.addinivalue_line("markers", "mpi_matrix_extra: one multi-rank test of each other "
                            "part (groups, point-to-point, one-sided, ZeRO, pipeline, tensor "
                            "parallelism, stalls, signals, finalize) that CI runs again under "
                            "Open MPI 5 beside the mpi_matrix slice: "
                            "pytest -m 'mpi_matrix or mpi_matrix_extra'")
    config.addinivalue_line("markers", "serial: timed against the clock, or holding a "
                            "machine-wide resource: never beside another serial test "
                            "(see SERIAL_FILES)")
    config.addinivalue_line("markers", "ulfm: needs an MPI whose survivors go on when a rank "
                            "dies (Open MPI 5, mpiexec --with-ft ulfm): elastic training; "
                            "skipped under other MPIs, run by CI in the Open MPI 5 slice")


# Files whose tests read the clock against the job (stall and mismatch timeouts, signals
# sent mid-epoch, "ends within N s") or hold a machine-wide resource (the Slurm cluster,
# network namespaces). Under pytest-xdist (CI: -n 2) each test file is one unit of work
# (its module fixtures stay on one worker), and these files are one unit together: they
# never meet each other, and they go first, so that the longest unit is not the tail.
SERIAL_FILES = {
    "test_comm_later_mismatch.py", "test_data_parallel_cli.py", "test_elastic.py",
    "test_preempt.py", "test_slurm.py", "test_stall.py", "test_vcluster.py",
}


def _serial(path):
    return os.path.basename(str(path)) in SERIAL_FILES


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config, log):
    """xdist's file-by-file scheduling, with SERIAL_FILES as one unit (xdist's own
    ``xdist_group`` marks do nothing under pytest 9.2, whose node ids xdist 3.8 cannot
    extend)."""
    from xdist.scheduler import LoadFileScheduling  # noqa: PLC0415

    class FilesAndSerialFiles(LoadFileScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return "serial files" if _serial(path) else path

    return FilesAndSerialFiles(config, log)


def slow_run(config):
    """Whether this run asked for the ``slow`` tests (``-m slow``, ``MPIDL_SLOW=1``)."""
    return "slow" in (config.getoption("markexpr") or "") or os.environ.get("MPIDL_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (exhaustive grids, long training runs) run only when asked for:
    ``pytest -m slow ...`` or ``MPIDL_SLOW=1``; CI runs their representative slices.
    The serial files go first (see SERIAL_FILES)."""
    for item in items:
        if _serial(item.fspath):
            item.add_marker(pytest.mark.serial)
    items.sort(key=lambda item: "serial" not in item.keywords)  # stable
    if slow_run(config):
        return
    skip = pytest.mark.skip(reason="slow: run with pytest -m slow (or MPIDL_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

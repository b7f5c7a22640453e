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
# network namespaces). Under pytest-xdist (CI: -n 2 --dist loadgroup) every file is one
# group, so a file's tests and its module fixtures stay on one worker, and these files
# form a single group together: never two of them at once. They are put first, so that
# their group, the longest, is not the run's tail.
SERIAL_FILES = {
    "test_comm_later_mismatch.py", "test_data_parallel_cli.py", "test_elastic.py",
    "test_preempt.py", "test_slurm.py", "test_stall.py", "test_vcluster.py",
}


def _group_by_file(items):
    serial, other = [], []
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group("serial"))
            serial.append(item)
        else:
            item.add_marker(pytest.mark.xdist_group(name))
            other.append(item)
    items[:] = serial + other


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """``slow`` tests (exhaustive grids, long training runs) run only when asked for:
    ``pytest -m slow ...`` or ``MPIDL_SLOW=1``; CI runs their representative slices."""
    _group_by_file(items)
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("MPIDL_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with pytest -m slow (or MPIDL_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

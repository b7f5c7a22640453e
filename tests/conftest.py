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
                            "machine-wide resource: never run beside another test "
                            "(MPIDL_TEST_PHASE, see pytest_collection_modifyitems)")
    config.addinivalue_line("markers", "ulfm: needs an MPI whose survivors go on when a rank "
                            "dies (Open MPI 5, mpiexec --with-ft ulfm): elastic training; "
                            "skipped under other MPIs, run by CI in the Open MPI 5 slice")


# Files whose tests read the clock against the job (stall and mismatch timeouts, signals
# sent mid-epoch, "ends within N s") or hold a machine-wide resource (the Slurm cluster,
# network namespaces): CI runs them alone, after the rest ran two files at a time.
SERIAL_FILES = {
    "test_any_mpi.py", "test_comm_later_mismatch.py", "test_comm_mismatch.py",
    "test_data_parallel_cli.py", "test_elastic.py", "test_parameter_server_mpi.py",
    "test_preempt.py", "test_slurm.py", "test_stall.py", "test_vcluster.py",
}


def _split_phase(config, items):
    """``MPIDL_TEST_PHASE=parallel`` keeps the tests that may run beside others (CI runs
    them with ``-n 2 --dist loadfile``), ``serial`` the others; unset keeps all."""
    phase = os.environ.get("MPIDL_TEST_PHASE", "")
    if phase not in ("", "parallel", "serial"):
        raise pytest.UsageError(f"MPIDL_TEST_PHASE={phase!r}: expected parallel or serial")
    for item in items:
        if os.path.basename(str(item.fspath)) in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
    if not phase:
        return
    keep, dropped = [], []
    for item in items:
        (keep if ("serial" in item.keywords) == (phase == "serial") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (exhaustive grids, long training runs) run only when asked for:
    ``pytest -m slow ...`` or ``MPIDL_SLOW=1``; CI runs their representative slices."""
    _split_phase(config, items)
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("MPIDL_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with pytest -m slow (or MPIDL_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

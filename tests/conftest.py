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
    config.addinivalue_line("markers", "ulfm: needs an MPI whose survivors go on when a rank "
                            "dies (Open MPI 5, mpiexec --with-ft ulfm): elastic training; "
                            "skipped under other MPIs, run by CI in the Open MPI 5 slice")


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (exhaustive grids, long training runs) run only when asked for:
    ``pytest -m slow ...`` or ``MPIDL_SLOW=1``; CI runs their representative slices."""
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("MPIDL_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with pytest -m slow (or MPIDL_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA device (skipped otherwise)")
    config.addinivalue_line("markers", "slurm: needs the single-node Slurm cluster (tests/slurm)")
    config.addinivalue_line("markers", "slow: trains on real data; minutes, not seconds")

"""Compressed gradient exchange on real MPI ranks (tests/ranks/compress_exchange.py)."""

import os

import pytest

from mpirun import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("p", [pytest.param(2, marks=pytest.mark.mpi_matrix), 3])
def test_compressed_exchange_on_ranks(p):
    launch = run_ranks(p, [os.path.join(HERE, "ranks", "compress_exchange.py")],
                       timeout=240).check()
    assert "COMPRESS OK" in launch.output, launch.output

"""Ranks that disagree on a collective raise on every rank, within seconds, never hang."""

import os
import time

import pytest

from mpirun import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.mpi_matrix_extra
def test_mismatch_raises_on_all_ranks_naming_tensor_and_ranks():
    t0 = time.perf_counter()
    launch = run_ranks(3, [os.path.join(HERE, "ranks", "comm_mismatch.py")], timeout=60)
    elapsed = time.perf_counter() - t0
    launch.check()
    out = launch.output
    assert "MISMATCH OK" in out, out
    # the case: different shapes under one name, the odd rank named
    assert "tensor 'fc1.weight' (rank 1 differs from the rest)" in out, out
    assert "rank 1: allreduce tensor='fc1.weight' shape=(12,)" in out, out
    assert elapsed < 45, f"launch took {elapsed:.0f} s"

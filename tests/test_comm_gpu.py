"""Collectives on CuPy arrays (skipped without CuPy and a CUDA device).

Reductions run on the device; MPI gets device pointers when it is CUDA-aware, pinned
host copies otherwise (forced here with MPIDL_CUDA_AWARE=0); the "shared" algorithm reads
the other ranks' device memory through CUDA IPC.
"""

import os

import numpy as np
import pytest

from mpidl import backend
from mpirun import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(backend.gpu_count() == 0, reason="needs CuPy and a GPU")]


@pytest.mark.parametrize("aware", ["0", None])
def test_gpu_collectives_equal_native(aware):
    env = {"MPIDL_CUDA_AWARE": aware} if aware is not None else None
    launch = run_ranks(2, [os.path.join(HERE, "ranks", "comm_gpu.py")], timeout=300,
                       env=env).check()
    assert "GPU OK p=2" in launch.output, launch.output
    if aware == "0":  # staged: the ranks of one node read each other's device memory
        assert "ipc=yes" in launch.output, launch.output


def test_gpu_one_rank_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "none.json"))
    import cupy as cp

    from mpidl.comm import Communicator

    with Communicator() as comm:
        x = cp.arange(10, dtype=cp.float32)
        for alg in ("ring", "tree", "recursive_doubling", "shared", "mpi"):
            y = comm.allreduce(x, op="mean", algorithm=alg)
            assert isinstance(y, cp.ndarray)
            assert np.array_equal(y.get(), np.arange(10, dtype=np.float32))
            assert np.array_equal(comm.iallreduce(x, algorithm=alg).wait().get(),
                                  np.arange(10, dtype=np.float32))

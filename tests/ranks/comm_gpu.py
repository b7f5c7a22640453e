"""mpidl collectives on CuPy arrays against MPI's native result on host copies.

Launched by tests/test_comm_gpu.py (skipped without CuPy and a CUDA device), with
MPIDL_CUDA_AWARE=0 (pinned staging) and with the MPI library's own answer. Tolerances
as in comm_equivalence.py. Rank 0 prints "GPU OK".
"""

import numpy as np
from mpi4py import MPI

from mpidl import backend
from mpidl.comm import Communicator, even_split

W = MPI.COMM_WORLD
RANK, P = W.Get_rank(), W.Get_size()
ALGS = ("ring", "tree", "recursive_doubling", "shared", "mpi", "auto")


def main():
    comm = Communicator()
    cp = backend.use("gpu", comm.local_rank)
    comm.segment_bytes = 4096  # several segments per ring chunk
    rng = np.random.default_rng(RANK)
    for alg in ALGS:
        for n in (0, 1, P - 1, 7 * P + 3, 100_003, 1_000_003):  # the last: staged in chunks
            for dtype in (np.float32, np.float64, np.int32, np.float16):
                x = (rng.uniform(-1, 1, n) * (100 if dtype == np.int32 else 1)).astype(dtype)
                # the reference sum in float64 for float16: Open MPI 4.1 has no float16
                # datatype (its Allreduce crashes on one), and mpidl never asks MPI for it
                ref = x.astype(np.float64) if dtype == np.float16 else x.copy()
                W.Allreduce(MPI.IN_PLACE, ref, MPI.SUM)
                s = np.abs(x.astype(np.float64))
                W.Allreduce(MPI.IN_PLACE, s, MPI.SUM)
                tol = 0 if dtype == np.int32 else 2 * P * np.finfo(dtype).eps * s
                dx = cp.asarray(x)
                got = comm.allreduce(dx, algorithm=alg, name=f"g{n}{alg}")
                assert isinstance(got, cp.ndarray)
                assert np.all(np.abs(got.get().astype(np.float64) - ref) <= tol), (alg, n, dtype)
                comm.allreduce(dx, out=dx, algorithm=alg, name=f"gi{n}{alg}")  # in place
                assert np.all(np.abs(dx.get().astype(np.float64) - ref) <= tol), (alg, n, dtype)
                h = comm.iallreduce(cp.asarray(x), algorithm=alg, name=f"nb{n}{alg}")
                assert np.all(np.abs(h.wait().get().astype(np.float64) - ref) <= tol)
                c, d = even_split(n, P)
                rs = comm.reduce_scatter(cp.asarray(x), algorithm=alg, name=f"rs{n}{alg}")
                assert np.all(np.abs(rs.get() - ref[d[RANK]:d[RANK] + c[RANK]])
                              <= (tol if np.isscalar(tol) else tol[d[RANK]:d[RANK] + c[RANK]]))
            b = cp.arange(n, dtype=cp.float32) * (RANK + 1)
            comm.bcast(b, root=P - 1, algorithm=alg, name=f"b{n}{alg}")
            assert np.array_equal(b.get(), np.arange(n, dtype=np.float32) * P)
            g = comm.allgather(cp.full(n, RANK, cp.int64), algorithm=alg, name=f"ag{n}{alg}")
            assert np.array_equal(g.get(), np.repeat(np.arange(P), n))
            v, counts = comm.allgatherv(cp.full(RANK % 3, RANK, cp.float32), algorithm=alg)
            assert counts == [r % 3 for r in range(P)]
            assert np.array_equal(v.get(), np.concatenate(
                [np.full(r % 3, r, np.float32) for r in range(P)]))
            x = rng.uniform(-1, 1, n).astype(np.float32)
            r = comm.reduce(cp.asarray(x), root=P - 1, algorithm=alg, name=f"r{n}{alg}")
            ref, s = x.astype(np.float64), np.abs(x.astype(np.float64))
            W.Allreduce(MPI.IN_PLACE, ref, MPI.SUM)
            W.Allreduce(MPI.IN_PLACE, s, MPI.SUM)
            if RANK == P - 1:
                tol = 2 * P * np.finfo(np.float32).eps * s
                assert np.all(np.abs(r.get() - ref) <= tol), (alg, n)
    ipc = shared_on_device(comm, cp, rng)
    comm.close()
    if RANK == 0:
        print(f"GPU OK p={P} cuda_aware={backend.cuda_aware_mpi()} ipc={ipc}", flush=True)


def shared_on_device(comm, cp, rng):
    """The "shared" all-reduce of device arrays (CUDA IPC) gives the bits of the same
    algorithm on host arrays (an MPI shared window): the same sums in the same order,
    the same on every rank. Returns "yes" when the device path mapped the other ranks'
    memory, else the reason it fell back to MPI."""
    x = rng.standard_normal(3_000_017).astype(np.float32)
    host = comm.allreduce(x, algorithm="shared", name="host-shared")
    dev = comm.allreduce(cp.asarray(x), algorithm="shared", name="dev-shared").get()
    mem = comm._main.transport(True).node_memory
    if mem is not None and mem.failed is None:
        assert np.array_equal(dev.view(np.uint32), host.view(np.uint32)), "device != host"
    everyone = W.allgather(int(np.bitwise_xor.reduce(dev.view(np.uint32))))
    assert len(set(everyone)) == 1, everyone
    return "yes" if mem is not None and mem.failed is None else f"no ({mem and mem.failed})"


if __name__ == "__main__":
    main()

"""SharedVector on real ranks (tests/test_hogwild.py).

``adds``: every rank adds its own pattern K times, dense and sparse, lock-free and all at
once; afterwards every element is exactly the sum of all adds (no update lost) and each
owner's version counter counts every add that touched it.

``progress``: rank 0 owns the vector and computes without any MPI call; rank 1 adds to it
under exclusive locks (``--locks``), which MPICH completes only with the target's help.
Rank 0 must see the values arrive in its own memory *while* it computes; with
``--no-progress`` (no progress thread) it does not, which is what the thread is for.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpidl.comm.rma import SharedVector

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=("adds", "progress"))
ap.add_argument("--locks", action="store_true")
ap.add_argument("--no-progress", action="store_true")
ap.add_argument("--limit", type=float, default=20.0, help="seconds rank 0 computes at most")
args = ap.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def pattern(r, n):
    return np.sort(np.random.default_rng(r).choice(n, 37, replace=False))


if args.mode == "adds":
    n, k = 1001, 50
    owners = list(range(min(2, size)))
    sv = SharedVector(comm, owners, n, np.float64)
    dense = np.full(n, float(rank + 1))
    idx = pattern(rank, n)
    for step in range(k):
        sv.add(dense)
        sv.add(np.full(idx.size, 0.5), idx)
        got = sv.read(idx=idx)  # a read among the writes: never half an element
        assert np.all(got * 2 == np.round(got * 2)), got
    comm.Barrier()
    total = sv.read()
    expect = np.zeros(n)
    touched = np.zeros(len(owners), dtype=np.int64)
    for r in range(size):
        expect += k * float(r + 1)
        ridx = pattern(r, n)
        expect[ridx] += k * 0.5
        for i, (c, d) in enumerate(zip(sv.counts, sv.displs)):
            touched[i] += k * (1 + int(np.any((ridx >= d) & (ridx < d + c))))
    assert np.array_equal(total, expect), np.nonzero(total != expect)
    versions = sv.versions()
    assert np.array_equal(versions, touched), (versions, touched)
    sv.close()
    print(f"rank {rank}: adds ok, versions {versions.tolist()}", flush=True)

else:
    n, k = 1000, 20
    sv = SharedVector(comm, [0], n, np.float64, locks=args.locks,
                      poll_s=None if args.no_progress else 2e-4)
    if rank == 0:
        comm.Barrier()  # the last MPI call before computing
        t0 = time.perf_counter()
        seen_at = None
        x = 0.0
        while time.perf_counter() - t0 < args.limit:  # compute, no MPI call
            x += float(np.sum(np.sqrt(np.arange(1000.0))))
            if sv.local[0] == k:
                seen_at = time.perf_counter() - t0
                break
        comm.Barrier()
        assert seen_at is not None, (f"the remote adds never reached the owner's memory in "
                                     f"{args.limit} s of computing")
        assert seen_at > 0.2, "the adds arrived before the owner started computing"
        print(f"rank 0 saw {k} remote adds after {seen_at:.3f} s of computing", flush=True)
    else:
        comm.Barrier()
        time.sleep(0.5)  # rank 0 is computing by now
        for _ in range(k):
            if args.locks:
                with sv.exclusive():
                    sv.add(np.ones(n))
            else:
                sv.add(np.ones(n))
        comm.Barrier()
    sv.close()

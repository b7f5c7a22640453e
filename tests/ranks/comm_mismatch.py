"""Ranks that disagree on a collective get an error on every rank, fast, never a hang.

Launched on 3 ranks by tests/test_comm_mismatch.py. Each case makes one rank pass
something different; every rank must raise CollectiveMismatchError within a few seconds,
with the tensor's name and the odd rank in the message. Afterwards the communicator
still works. Rank 0 prints one line per case and "MISMATCH OK" at the end.
"""

import time

import numpy as np
from mpi4py import MPI

from mpidl.comm import CollectiveMismatchError, Communicator

W = MPI.COMM_WORLD
RANK, P = W.Get_rank(), W.Get_size()
LIMIT_S = 5.0


def expect_mismatch(label, fn, must_contain):
    W.Barrier()
    t0 = time.perf_counter()
    try:
        fn()
    except CollectiveMismatchError as e:
        elapsed = time.perf_counter() - t0
        msg = str(e)
        for part in must_contain:
            assert part in msg, f"rank {RANK} {label}: {part!r} not in message:\n{msg}"
        assert elapsed < LIMIT_S, f"rank {RANK} {label}: took {elapsed:.1f} s"
        if RANK == 0:
            print(f"case {label}: raised on rank 0 in {elapsed * 1e3:.1f} ms:\n{msg}",
                  flush=True)
    else:
        raise AssertionError(f"rank {RANK} {label}: no CollectiveMismatchError")
    raised = W.allgather(True)
    assert all(raised), f"{label}: not raised on every rank"


def main():
    comm = Communicator()  # default check="digest": first call checked in full
    assert comm.check == "digest"
    odd = 1

    # 1. different shapes, named tensor (the case)
    n = 12 if RANK == odd else 10
    expect_mismatch("shape", lambda: comm.allreduce(np.ones(n, np.float32), name="fc1.weight"),
                    ["fc1.weight", "rank 1", "shape=(12,)", "shape=(10,)", "ranks 0, 2"])

    # 2. different dtypes
    dt = np.float64 if RANK == 2 else np.float32
    expect_mismatch("dtype", lambda: comm.allreduce(np.ones(8, dt), name="fc1.bias"),
                    ["fc1.bias", "rank 2", "float64", "float32"])

    # 3. unnamed call, different shapes (keyed by its signature: a new one is checked)
    shape = (4, 3) if RANK == 0 else (3, 4)
    expect_mismatch("unnamed", lambda: comm.allreduce(np.ones(shape), algorithm="ring"),
                    ["<unnamed>", "rank 0", "(4, 3)", "(3, 4)"])

    # 4. different algorithms or ops
    alg = "tree" if RANK == 0 else "ring"
    expect_mismatch("algorithm", lambda: comm.allreduce(np.ones(5), algorithm=alg, name="g"),
                    ["'g'", "algorithm=tree", "algorithm=ring"])
    op = "max" if RANK == 2 else "sum"
    expect_mismatch("op", lambda: comm.allreduce(np.ones(5), op=op, name="h"),
                    ["'h'", "op=max", "rank 2"])

    # 5. non-blocking: the error comes out of wait() on every rank
    n = 7 if RANK == odd else 6
    expect_mismatch("iallreduce",
                    lambda: comm.iallreduce(np.ones(n), name="bucket0").wait(),
                    ["bucket0", "rank 1"])

    # 6. allgatherv: counts may differ, dtypes may not
    dt = np.int64 if RANK == odd else np.int32
    expect_mismatch("allgatherv", lambda: comm.allgatherv(np.ones(RANK, dt), name="idx"),
                    ["idx", "int64", "int32"])

    # 7. other collectives: reduce_scatter shape, bcast root, allgather size
    n = 9 if RANK == 2 else 8
    expect_mismatch("reduce_scatter", lambda: comm.reduce_scatter(np.ones(n), name="rs"),
                    ["'rs'", "rank 2"])
    root = 1 if RANK == 0 else 0
    expect_mismatch("bcast", lambda: comm.bcast(np.ones(4), root=root, name="b"),
                    ["'b'", "root=1", "root=0"])
    n = 3 if RANK == odd else 2
    expect_mismatch("allgather", lambda: comm.allgather(np.ones(n), name="ag"),
                    ["'ag'", "rank 1"])

    # The communicator still works, and a name checked once is not checked again.
    out = comm.allreduce(np.full(4, RANK, np.float64), name="after")
    assert np.array_equal(out, np.full(4, sum(range(P)), np.float64)), out
    out = comm.allreduce(np.full(4, 1.0), name="after")
    assert np.array_equal(out, np.full(4, float(P))), out

    # check="always": a later disagreement under an already-seen name is caught too
    strict = Communicator(check="always")
    strict.allreduce(np.ones(4), name="w")
    n = 5 if RANK == odd else 4
    expect_mismatch("always", lambda: strict.allreduce(np.ones(n), name="w"),
                    ["'w'", "rank 1"])
    strict.close()
    comm.close()
    if RANK == 0:
        print("MISMATCH OK", flush=True)


if __name__ == "__main__":
    main()

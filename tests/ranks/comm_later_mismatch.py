"""A disagreement on a *later* call of an already-checked tensor, under the default
check="digest": it must end in an error naming the call, the tensor and the ranks, never
in silent garbage or a silent hang.

Usage: comm_later_mismatch.py CASE ALGORITHM. 1500 calls; two names alternate ('w', 'v'), float32
vectors of 10 elements; at call AT (after the first digest comparison) rank 1 does
something else:

- dtype: int32 instead of float32 (same bytes: MPI would add them silently)
- op: max instead of sum
- shape: 12 elements instead of 10
- skip: rank 1 skips call AT (every later call pairs with the wrong one)
- skip-last: rank 1 skips the very last call and goes on to close()
- resize: no mismatch: every rank passes 12 elements for 'w' from call AT on (a known
  tensor at a new size, compared in full before MPI's own call gets it); must finish
- raised: ALGORITHM is ignored; every call is a max through an algorithm that moves
  nothing (the generic path, which records a call once it has run), and on rank 1 call AT
  raises; rank 1 catches it and goes on, so its window has no signature for that call

Each rank prints "RAISED <type>: <message>" when it gets an error, "FINISHED" when it
got none. The test runs this under MPIDL_STALL_WARNING/TIMEOUT of a few seconds, so a
rank stuck in MPI is named and the job ended by the stall inspector.
"""

import sys

import numpy as np

from mpidl.comm import Communicator

CASE, ALG = sys.argv[1], sys.argv[2]
CALLS, AT = 1500, 300


class _RaisesOnRank1:
    """An allreduce that moves nothing, and raises on rank 1 at call AT (case "raised")."""
    calls = 0

    @classmethod
    def allreduce(cls, t, src, dst, op, ctx):
        cls.calls += 1
        if cls.calls == AT + 1 and t.comm.Get_rank() == 1:
            raise RuntimeError("raised on purpose")


def main():
    global ALG
    if CASE == "raised":
        from mpidl.comm import algorithms

        algorithms.register("raises-on-rank-1", _RaisesOnRank1)
        ALG = "raises-on-rank-1"
    comm = Communicator()
    assert comm.check == "digest"
    odd = comm.rank == 1
    last = CALLS - 1
    try:
        for i in range(CALLS):
            name = "w" if i % 2 == 0 else "v"
            n, dtype, op = 10, np.float32, "sum"
            if odd and i == AT:
                if CASE == "dtype":
                    dtype = np.int32
                elif CASE == "op":
                    op = "max"
                elif CASE == "shape":
                    n = 12
                elif CASE == "skip":
                    continue
            if CASE == "resize" and name == "w" and i >= AT:
                n = 12
            if odd and CASE == "skip-last" and i == last:
                continue
            x = np.ones(n, dtype)
            if CASE == "raised":
                try:
                    comm.allreduce(x, out=x, op="max", algorithm=ALG, name=name)
                except RuntimeError as e:
                    if str(e) != "raised on purpose":
                        raise
                    print(f"CAUGHT {e} at call {i + 1}", flush=True)
                continue
            comm.allreduce(x, out=x, op=op, algorithm=ALG, name=name)
        comm.close()
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    print(f"FINISHED rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()

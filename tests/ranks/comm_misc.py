"""Communicator features beyond the collectives' values, on real ranks (3 by default).

split, node-local rank, progress without spinning (a non-blocking allreduce completes
while the caller sleeps), handle semantics, the Chrome-trace timeline (one gathered file
and one file per rank), close() idempotence. Rank 0 prints "MISC OK".
"""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator, Handle

W = MPI.COMM_WORLD
RANK, P = W.Get_rank(), W.Get_size()


def main(tmpdir):
    trace = os.path.join(tmpdir, "trace.json")
    comm = Communicator(timeline=trace)
    assert (comm.rank, comm.size) == (RANK, P)
    assert comm.mpi is W
    # one node: node-local rank and size are the world's
    assert (comm.local_rank, comm.local_size) == (RANK, P), (comm.local_rank, comm.local_size)

    # split: even and odd ranks, reversed order by key
    sub = comm.split(RANK % 2, key=-RANK)
    members = [r for r in range(P) if r % 2 == RANK % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(RANK)
    got = sub.allreduce(np.array([RANK], np.int64), algorithm="ring", name="split")
    assert got[0] == sum(members), (got, members)
    sub.barrier()
    # color None (MPI.UNDEFINED): that rank joins no group
    rest = comm.split(None if RANK == 0 else 7)
    if RANK == 0:
        assert rest is None
    else:
        assert rest.size == P - 1
        assert rest.allreduce(np.ones(2), algorithm="tree")[0] == P - 1
        rest.close()

    # progress without spinning: issue, sleep without touching MPI, then test()
    if comm.progress_mode == "thread":
        x = np.ones(1 << 20, np.float32)
        h = comm.iallreduce(x, algorithm="ring", name="bg")
        assert isinstance(h, Handle)
        deadline = time.time() + 20
        while not h.test() and time.time() < deadline:
            time.sleep(0.05)  # the caller never calls into MPI here
        assert h.test(), "iallreduce made no progress while the caller slept"
        assert np.all(h.wait() == P)
        assert h.wait() is h.wait()  # wait() twice returns the same result
    else:
        print(f"rank {RANK}: progress mode {comm.progress_mode} (no thread)", flush=True)

    # many in flight, waited out of order; timeout on a finished handle is harmless
    hs = [comm.iallreduce(np.full(10, k, np.float64), name=f"q{k}") for k in range(8)]
    for k in (7, 0, 3, 1, 2, 6, 5, 4):
        assert np.all(hs[k].wait(timeout=60) == k * P)
    # argument errors raise when the call is issued, not later in wait()
    try:
        comm.iallreduce(np.ones(3, bool), name="bool")
    except TypeError as e:
        assert "bool" in str(e)
    else:
        raise AssertionError("bool allreduce should fail")

    comm.allgatherv(np.arange(RANK, dtype=np.float32), name="v")
    comm.bcast(np.zeros(16), root=P - 1, algorithm="tree", name="b")
    sub.close()
    comm.close()
    comm.close()  # idempotent

    W.Barrier()
    if RANK == 0:
        with open(trace) as f:
            doc = json.load(f)
        events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        pids = {e["pid"] for e in events}
        assert pids == set(range(P)), pids
        names = {e["name"] for e in events}
        for want in ("allreduce bg", "allreduce split", "allgatherv v", "bcast b"):
            if want == "allreduce bg" and comm.progress_mode != "thread":
                continue
            assert want in names, (want, sorted(names)[:20])
        e = next(e for e in events if e["name"] == "bcast b")
        assert e["args"]["algorithm"] == "tree" and e["args"]["bytes"] == 128, e
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
        assert any(e["tid"] == 1 for e in events)  # progress thread spans
        print(f"timeline: {len(events)} spans from {len(pids)} ranks", flush=True)

    # one file per rank when the path has {rank}
    per = os.path.join(tmpdir, "trace-{rank}.json")
    c2 = Communicator(timeline=per)
    c2.allreduce(np.ones(4), name="r")
    path = c2.flush_timeline()
    assert path == per.format(rank=RANK), path
    with open(path) as f:
        doc = json.load(f)
    assert {e["pid"] for e in doc["traceEvents"]} == {RANK}
    c2.close()

    # a path given on rank 0 only still makes one file with every rank in it
    only0 = os.path.join(tmpdir, "only0.json")
    c3 = Communicator(timeline=only0 if RANK == 0 else None)
    c3.allreduce(np.ones(4), name="o")
    c3.close()
    if RANK == 0:
        with open(only0) as f:
            assert {e["pid"] for e in json.load(f)["traceEvents"]} == set(range(P))
    W.Barrier()
    if RANK == 0:
        print("MISC OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

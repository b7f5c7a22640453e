"""Hogwild! on sparse logistic regression (tests/test_hogwild.py, bench/hogwild.py).

Rank 0 owns the weights (a SharedVector) and only keeps MPI progressing; the other
ranks are workers that share one pass over a seeded order of the samples (worker j takes
every W-th sample from j). Rank 0 then compares the loss with serial SGD over the same
order and prints one JSON line: losses, update rates, the staleness histogram.

    python -m mpi4py hogwild_sparse.py [--locks] [--samples N] [--dim D] [--nnz K]
"""

import argparse
import json

import numpy as np
from mpi4py import MPI

from mpidl.comm.rma import SharedVector
from mpidl.runtime.hogwild import SparseLogistic, hogwild_worker, serial_sgd

ap = argparse.ArgumentParser()
ap.add_argument("--locks", action="store_true")
ap.add_argument("--samples", type=int, default=4000)
ap.add_argument("--dim", type=int, default=20000)
ap.add_argument("--nnz", type=int, default=10)
ap.add_argument("--lr", type=float, default=0.5)
ap.add_argument("--owners", type=int, default=1)
args = ap.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
owners = list(range(args.owners))
workers = [r for r in range(size) if r not in owners]
problem = SparseLogistic.generate(args.samples, args.dim, args.nnz, seed=7)
order = np.random.default_rng(11).permutation(args.samples)
shared = SharedVector(comm, owners, args.dim, np.float64, locks=args.locks)
stats = None
if rank in workers:
    j = workers.index(rank)
    stats = hogwild_worker(shared, problem, order[j::len(workers)], args.lr, locked=args.locks)
comm.Barrier()
everyone = comm.gather(None if stats is None else
                       {"updates": stats.updates, "seconds": stats.seconds,
                        "staleness": stats.staleness}, root=0)
w = shared.read() if rank == 0 else None
shared.close()
if rank == 0:
    ws = [e for e in everyone if e is not None]
    stale = np.concatenate([np.asarray(e["staleness"]) for e in ws])
    hist = np.bincount(stale)
    w_serial = serial_sgd(problem, order, args.lr)
    out = {"workers": len(workers), "owners": len(owners), "locks": args.locks,
           "updates": int(sum(e["updates"] for e in ws)),
           "loss_hogwild": problem.loss(w), "loss_serial": problem.loss(w_serial),
           "loss_start": problem.loss(np.zeros(args.dim)),
           "max_abs_diff_serial": float(np.max(np.abs(w - w_serial))),
           "updates_per_s": sum(e["updates"] / e["seconds"] for e in ws),
           "staleness_hist": hist.tolist(), "staleness_mean": float(stale.mean())}
    print("HOGWILD " + json.dumps(out), flush=True)

"""``mpidl simulate``'s traffic equals the communicator's counters, exactly, on every rank
(run under mpiexec).

For each case (model x algorithm x bucket size x overlap) a data-parallel runtime is
built as ``mpidl train --strategy allreduce`` builds it, runs one warm-up step, then one
counted step; ``rt.group.counters()`` (calls, messages, bytes, MPI calls per collective
kind) must equal ``mpidl.simulate.step.traffic`` of the step's predicted layout for this
rank, field by field. The models: the ``mlp`` (float32, dense buckets only) and a small
``gpt-tiny`` (token Embedding: two row gathers per step whose sizes are the rows each
rank's batch touches, exchanged here with mpi4py so every rank predicts every rank's).
``MPIDL_RANKS_PER_NODE=k`` (hierarchical) is read as the nodes' size; without it, all
ranks share one node, as they do on this machine.

Any failure raises; ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
Usage: mpiexec -n N python -m mpi4py tests/ranks/simulate_check.py ALGS BUCKETS [MODELS]
  e.g. ring,tree 0.001,4 mlp,gpt
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.engine import SGD, SoftmaxCrossEntropy
from mpidl.engine.losses import TokenCrossEntropy
from mpidl.engine.models import build_model
from mpidl.runtime import build
from mpidl.runtime.sync.rowsparse import sparse_param_names
from mpidl.simulate.step import layout, touched_rows, traffic

B = 3
VOCAB, CONTEXT = 23, 12


def make(kind):
    if kind == "mlp":
        return build_model("mlp", input_shape=(1, 28, 28), num_classes=10, seed=1)
    return build_model("gpt-tiny", input_shape=(CONTEXT,), num_classes=VOCAB, seed=1,
                       layers=1, heads=2, width=16)


def batch(kind, step, rank):
    rng = np.random.default_rng(100 * step + rank)
    if kind == "mlp":
        return (rng.standard_normal((B, 1, 28, 28)).astype("float32"),
                rng.integers(0, 10, size=B))
    # few distinct ids per rank (and a rank-dependent number): uneven row counts
    ids = rng.integers(0, 2 + 3 * rank, size=(B, CONTEXT + 1))
    return ids[:, :-1], ids[:, 1:]


def gathers_by(algorithm):
    """Tuning tables under which ``auto`` runs the row gathers with ``algorithm`` (they
    always ask for ``auto``; by default they would be MPI's own at these sizes)."""
    return None if algorithm == "auto" else {"allgather": {"1": [[None, algorithm]]}}


def check(kind, algorithm, bucket_mb, overlap, per_node):
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    model = make(kind)
    model.needs_input_grad = False
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    rt = build("allreduce", comm, algorithm=algorithm, bucket_mb=bucket_mb, overlap=overlap)
    rt.setup(model, opt, SoftmaxCrossEntropy() if kind == "mlp" else TokenCrossEntropy())
    rt.train_step(*batch(kind, 0, rank))
    rt.group.reset_counters()
    x, y = batch(kind, 1, rank)
    rt.train_step(x, y)
    counted = rt.group.counters()
    sparse = sparse_param_names(model)
    mine = touched_rows(make(kind), sparse, x)
    everyone = MPI.COMM_WORLD.allgather(mine)  # (not through the counted communicator)
    rows = {name: [r[name] for r in everyone] for name in sparse}
    step = layout(make(kind).named_parameters(), p, algorithm, bucket_mb, sparse, rows,
                  tables=tables)
    predicted = traffic(step, per_node, ranks=[rank])[rank]
    if predicted != counted:
        diff = {k: (predicted[k], counted[k]) for k in counted if predicted.get(k) != counted[k]}
        raise AssertionError(f"rank {rank} of {p}, {kind} {algorithm} bucket {bucket_mb} MiB "
                             f"overlap {overlap} nodes of {per_node}: predicted != counted "
                             f"{diff}; calls {[(c.name, c.algorithm, c.size) for c in step.calls]}")
    comm.close()
    totals = MPI.COMM_WORLD.gather(counted["total"], root=0)
    if rank == 0:
        msgs = [t["messages"] for t in totals]
        nbytes = [t["bytes"] for t in totals]
        print(f"exact p={p} {kind} {algorithm} bucket {bucket_mb} MiB overlap {overlap}: "
              f"{len(step.calls)} calls, messages per rank {msgs}, bytes per rank {nbytes}",
              flush=True)
    return counted


def main():
    algs = sys.argv[1].split(",")
    buckets = [float(b) for b in sys.argv[2].split(",")]
    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["mlp", "gpt"]
    p, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    per = os.environ.get("MPIDL_RANKS_PER_NODE")
    per_node = int(per) if per else p
    i = 0
    for kind in kinds:
        for alg in algs:
            for mb in buckets:
                check(kind, alg, mb, ("on", "off")[i % 2], per_node)
                i += 1
    if rank == 0:
        print(f"simulate_check: {i} cases exact on {p} ranks", flush=True)


if __name__ == "__main__":
    main()

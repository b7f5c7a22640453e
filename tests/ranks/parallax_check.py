"""Parallax (``--sparse-sync ps``) on real ranks, run by test_parallax.py on 5 ranks.

``python -m mpi4py parallax_check.py OUT.json`` trains a small gpt-tiny (token ids in,
next ids out, float64) through the runtime as the trainer does, in several scenarios on
sub-communicators of MPI_COMM_WORLD, and writes what every rank saw; the pytest side
asserts:

* ``sync_s2`` (2 servers + 3 trainers, AdamW): the parameters after every step are
  bitwise those of ``--strategy allreduce`` on the 3 trainer ranks (same launch, same
  batches), and within 1e-12 of one process at the global batch; the servers hold the
  token embedding only (one of them nothing), its AdamW state lives on its server and
  nowhere else; every step each trainer pushes exactly its batch's distinct ids as rows
  (8 bytes of index + the row), and the epoch line's bytes are the buckets' all-reduce
  plus those pushes;
* ``sync_tied`` (1 server + 2 trainers, ``--tie-weights``, SGD with momentum and weight
  decay): bitwise all-reduce on 2 ranks (the tied table's dense gradient travels as every
  row, as the all-gather sends it); ``sync_lazy`` (1 server + 1 trainer, untied, the same
  SGD: only the rows a batch touched move, their momentum too; ``--accumulate 2``)
  bitwise all-reduce on 1 rank with the same accumulation;
* ``pattern`` (1 server + 4 trainers, ``--ps-params '1.weight,3.body.1.*'``: the dense
  position table and the qkv projection on the server, the token embedding kept on the
  trainers, all-gathered): within 1e-12 of all-reduce, not bitwise (the server divides
  a sum of dense gradients by n, the buckets multiply each by 1/n before summing);
* ``async`` (1 server + 4 trainers, ``--mode async``): every gradient pushed is applied,
  one update per trainer and step; no trainer leads another by more than a step; the
  trainers' dense parameters agree after every step (they are all-reduced), all
  parameters after the epoch's barrier.
"""

import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.data import BatchLoader
from mpidl.engine.losses import TokenCrossEntropy
from mpidl.engine.models import build_model
from mpidl.engine.optim import SGD, AdamW
from mpidl.runtime import build

WORLD = MPI.COMM_WORLD
VOCAB, T, BATCH, LR = 13, 6, 4, 0.01


def model(tie=False):
    return build_model("gpt-tiny", input_shape=(T,), num_classes=VOCAB, seed=3,
                       dtype="float64", layers=1, heads=2, width=8, context=T,
                       tie_weights=tie)


def data(n=60, seed=5):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, T + 1)).astype(np.int64)
    return ids[:, :-1], ids[:, 1:]


def optimizer(kind, m):
    if kind == "sgd":
        return SGD(m.named_parameters(), lr=LR, momentum=0.9, weight_decay=0.01)
    return AdamW(m.named_parameters(), lr=LR)


def digest(arrays):
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def snapshot(m):
    return {n: p.data.copy() for n, p in m.named_parameters()}


def run(rt, opt_kind="adamw", tie=False, epochs=2, on_step=None):
    """The trainer's loop in miniature. Returns (runtime, model, optimizer, per-step
    snapshots of the parameters on training ranks)."""
    m = model(tie)
    opt = optimizer(opt_kind, m)
    rt.setup(m, opt, TokenCrossEntropy())
    if not rt.trains_on_data:
        rt.serve()
        rt.finish()
        return rt, m, opt, None
    x, y = data()
    loader = BatchLoader(x, y, BATCH, shard=rt.shard(), seed=0)
    steps = []
    for epoch in range(epochs):
        for _, xb, yb in loader.epoch(epoch):
            opt.lr = LR * (0.8 ** epoch)  # a schedule: the servers must follow it
            rt.train_step(xb, yb)
            steps.append(snapshot(m))
            if on_step is not None:
                on_step(rt, m, xb)
        rt.reduce({"steps": 1.0}, "sum")  # the trainer's order: a collective, evaluation
        rt.prepare_eval()
    return rt, m, opt, steps


def reference(trainers, opt_kind="adamw", tie=False, epochs=2):
    """One process at the global batch (trainers x BATCH)."""
    m = model(tie)
    opt = optimizer(opt_kind, m)
    loss = TokenCrossEntropy()
    x, y = data()
    for epoch in range(epochs):
        for _, xb, yb in BatchLoader(x, y, BATCH * trainers, seed=0).epoch(epoch):
            opt.lr = LR * (0.8 ** epoch)
            m.zero_grad()
            loss.forward(m.forward(xb), yb)
            m.backward(loss.backward())
            opt.step()
    return snapshot(m)


def max_rel(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) / max(1e-30, float(np.max(np.abs(b[k]))))
               for k in a)


def allreduce_steps(comm, trainers, opt_kind, tie, **options):
    """``--strategy allreduce`` on the ranks ``trainers`` of ``comm`` (a sub-group of
    the same size as Parallax's trainers, so the same shards): per-step snapshots."""
    sub = comm.Split(0 if comm.rank in trainers else MPI.UNDEFINED, comm.rank)
    if sub == MPI.COMM_NULL:
        return None
    try:
        _, _, _, steps = run(build("allreduce", Communicator(sub), **options), opt_kind, tie)
    finally:
        sub.Free()
    return steps


def compare(comm, servers, options, opt_kind="adamw", tie=False, traffic=False):
    """Parallax with ``servers`` on ``comm`` against all-reduce on the trainer ranks
    (those of the same shard index) and one process."""
    out = {"rank": comm.rank}
    distinct = []  # the ids each step's batch touched: the rows it pushes

    def count(rt, m, xb):
        distinct.append(len(np.unique(np.asarray(xb))))

    rt, m, opt, steps = run(build("allreduce", Communicator(comm), servers=servers,
                                  **options), opt_kind, tie, on_step=count)
    if steps is None:  # a server
        out.update(server=True, holds=list(rt.server.server.names),
                   opt_state=sorted(opt.state))
        allreduce_steps(comm, [], opt_kind, tie)
        return out
    sync = rt.syncs[0][1]
    n = comm.size - servers
    out.update(server=False, steps=len(steps), opt_state=sorted(opt.state),
               fewest_rows=min(distinct), vocab=VOCAB,
               remote=sorted(sync.split.remote), gathered=list(sync.rows.names),
               bucketed=sorted(sync.dense.names))
    if traffic:
        worker = sync.push.worker
        out["pushed"] = worker.stats["bytes_sent"]
        row = m.layers[0].weight.data.shape[1] * 8 + 8  # an int64 index and the row
        out["expected_pushed"] = sum(n * row for n in distinct)
        out["rows_names"] = list(sync.rows_names)
        dense = sync.dense.bytes_per_step()
        metrics = rt.metrics()
        out["bytes_sent_per_step"] = metrics["bytes_sent_per_step"]
        out["dense_plus_pushed"] = dense + metrics["ps_bytes_pushed_per_step"]
        out["pulled_per_step"] = metrics["ps_bytes_pulled_per_step"]
        out["table_bytes"] = int(m.layers[0].weight.data.nbytes)
        out["ps_pushed"] = metrics.get("ps_pushed")
    rt.finish()
    both = {k: v for k, v in options.items() if k == "accumulate"}  # (the schedule's)
    ar = allreduce_steps(comm, list(range(servers, comm.size)), opt_kind, tie, **both)
    out["bitwise_steps"] = [digest(a.values()) == digest(b.values())
                            for a, b in zip(steps, ar)]
    out["vs_allreduce"] = max_rel(steps[-1], ar[-1])
    out["vs_reference"] = max_rel(steps[-1], reference(n, opt_kind, tie))
    return out


def asynchronous(comm):
    """``--mode async``: counts, and what the trainers agree on."""
    rt = build("allreduce", Communicator(comm), sparse_sync="ps", mode="async")
    out = {"rank": comm.rank}
    agree = {"dense": [], "remote": [], "barrier": None}
    trainers = None

    def check(rt, m, xb):
        g = rt.group.mpi
        remote = rt.syncs[0][1].split.remote
        dense = [p.data for n, p in m.named_parameters() if n not in remote]
        far = [p.data for n, p in m.named_parameters() if n in remote]
        agree["dense"].append(len(set(g.allgather(digest(dense)))) == 1)
        agree["remote"].append(len(set(g.allgather(digest(far)))) == 1)

    rt, m, opt, steps = run(rt, "sgd", on_step=check)
    if steps is None:
        out["stats"] = {k: v for k, v in rt.server.server.stats.as_dict().items()
                        if k != "trace"}
        return out
    trainers = rt.group.mpi
    out["steps"] = len(steps)
    out["dense_agree"] = agree["dense"]
    out["remote_agree"] = agree["remote"]
    # after the barrier (prepare_eval in run) every trainer holds the servers' parameters
    out["barrier_agree"] = len(set(trainers.allgather(digest(snapshot(m).values())))) == 1
    out["finite"] = all(np.isfinite(a).all() for a in snapshot(m).values())
    out["metrics"] = {k: v for k, v in rt.metrics().items() if k.startswith("ps_")}
    rt.finish()
    return out


def main():
    results = {}
    results["sync_s2"] = WORLD.gather(compare(WORLD, 2, {"sparse_sync": "ps"},
                                              traffic=True))
    # at the same time: ranks 0-2 with tied weights, ranks 3-4 (1 server + 1 trainer)
    # with SGD's lazy rows (a batch leaves some of the 13 rows untouched)
    part = WORLD.Split(0 if WORLD.rank < 3 else 1, WORLD.rank)
    tied = WORLD.rank < 3
    rows = part.gather(compare(part, 1, {"sparse_sync": "ps"} if tied else
                               {"sparse_sync": "ps", "accumulate": 2}, "sgd", tie=tied))
    part.Free()
    lazy = WORLD.gather(rows if WORLD.rank == 3 else None)
    if WORLD.rank == 0:
        results["sync_tied"], results["sync_lazy"] = rows, lazy[3]
    results["pattern"] = WORLD.gather(compare(
        WORLD, 1, {"sparse_sync": "ps", "ps_params": "1.weight,3.body.1.*"}))
    results["async"] = WORLD.gather(asynchronous(WORLD))
    if WORLD.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()

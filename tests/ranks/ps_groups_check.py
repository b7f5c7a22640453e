"""Worker groups of the parameter server on 5 ranks, run by test_ps_groups.py.

``python -m mpi4py ps_groups_check.py OUT.json``: rank 0 serves, ranks 1-2 and 3-4 are
two groups of 2 (``--group-size 2``). Each scenario trains through the runtime as the
trainer does and records, on every rank, what the pytest side asserts:

* after every step (every pull) and after every epoch barrier, the digests of the
  parameters of every rank of the group, gathered over the group;
* after every barrier, those of every worker (the barrier gives every group the same);
* the server's counts (one push per group per step, by leader) and its trace;
* sync: the single-process global-batch reference (float64);
* ``--group-size 1`` and the option left out: the same part (``PushPull``, the servers
  knowing all 4 workers) and the same parameters, bitwise;
* async, with rank 4 slowed (so its whole group is slow and staleness happens): a
  single-process replay of the server's schedule in which each push is the mean of
  the group's two gradients, computed from the version the leader had pulled.
"""

import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.data import BatchLoader
from mpidl.engine.losses import SoftmaxCrossEntropy
from mpidl.engine.optim import SGD
from mpidl.runtime import build

from ps_check import (BATCH, LR, MOMENTUM, dense_data, max_rel_diff, mlp, reference, replay_model,
                      worker_batches)

WORLD = MPI.COMM_WORLD
GROUP = 2


def digest(model):
    h = hashlib.sha1()
    for _, p in model.named_parameters():
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


def run(mode, epochs, dtype="float64", busy=0.0, group_size=GROUP, **options):
    """One training run; returns (this rank's record, its final parameters)."""
    if group_size is not None:  # None: the option left out, as before groups existed
        options["group_size"] = group_size
    rt = build("ps", Communicator(WORLD), servers=1, mode=mode, trace=True, **options)
    model = mlp(dtype, busy=busy)
    opt = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    out = {"rank": WORLD.rank}
    if not rt.trains_on_data:
        out["stats"] = rt.serve().as_dict()
        rt.finish()
        return out, None
    sync = rt.syncs[0][1]
    if group_size in (1, None):  # the parameter server without groups: no group part
        params = train_plain(rt, model, opt, epochs, dtype)
        out["part"] = type(sync).__name__
        out["servers_know"] = sync.worker_ranks
        return out, params
    group = sync.comm.mpi
    out.update(leader=sync.is_leader, group=sync.group_index, group_size=group.size,
               shard=list(rt.shard()), step_mismatches=[], barrier_mismatches=[],
               world_mismatches=[], checks=0)
    x, y = dense_data(n=192)
    loader = BatchLoader(x, y, BATCH, shard=rt.shard(), seed=0, dtype=dtype)
    steps = 0
    for epoch in range(epochs):
        for _, xb, yb in loader.epoch(epoch):
            opt.lr = LR * (0.9 ** epoch)
            rt.train_step(xb, yb)
            steps += 1
            # every rank of the group holds the parameters its leader pulled
            if len(set(group.allgather(digest(model)))) != 1:
                out["step_mismatches"].append(steps)
            out["checks"] += 1
        rt.reduce({"steps": 1}, "sum")  # the trainer's order: a collective, then eval
        rt.prepare_eval()
        if len(set(group.allgather(digest(model)))) != 1:
            out["barrier_mismatches"].append(epoch)
        if len(set(rt.group.mpi.allgather(digest(model)))) != 1:
            out["world_mismatches"].append(epoch)
        out["metrics"] = rt.metrics()
    out["steps"] = steps
    out["pushes"] = sync.leader_sync.worker.stats["pushes"] if sync.is_leader else 0
    out["pulls"] = sync.leader_sync.worker.stats["pulls"] if sync.is_leader else 0
    params = {n: p.data.copy() for n, p in model.named_parameters()}
    rt.finish()
    assert not opt.state, "a worker holds optimizer state"
    return out, params


def train_plain(rt, model, opt, epochs, dtype):
    """The same loop without the group checks (for runs without groups)."""
    x, y = dense_data(n=192)
    loader = BatchLoader(x, y, BATCH, shard=rt.shard(), seed=0, dtype=dtype)
    for epoch in range(epochs):
        for _, xb, yb in loader.epoch(epoch):
            opt.lr = LR * (0.9 ** epoch)
            rt.train_step(xb, yb)
        rt.reduce({"steps": 1}, "sum")
        rt.prepare_eval()
        rt.metrics()
    params = {n: p.data.copy() for n, p in model.named_parameters()}
    rt.finish()
    return params


def replay(trace, shards, epochs, dtype="float64"):
    """The server's async schedule in one process: push i (leader w, clock t, staleness
    s) is the mean of the gradients of the group's ranks on their clock-t batches at
    version i - s, applied to version i. The mean is the all-reduce's: each gradient
    times 1/2, then added (two terms: the order does not matter)."""
    x, y = dense_data(n=192)
    batches = worker_batches(x, y, shards.items(), epochs, dtype)
    ref, named, opt, loss, versions = replay_model(dtype)
    for i, (leader, clock, _lead, staleness, applied, _update) in enumerate(trace):
        assert applied
        mean = {}
        for rank in range(leader, leader + GROUP):
            lr, xb, yb = batches[rank, clock]
            for n, p in named.items():
                p.data[...] = versions[i - staleness][n]
            ref.zero_grad()
            loss.forward(ref.forward(xb), yb)
            ref.backward(loss.backward())
            for n, p in named.items():
                part = p.grad * 0.5
                mean[n] = part if n not in mean else mean[n] + part
        for n, p in named.items():
            p.data[...] = versions[i][n]
            p.grad = mean[n]
        opt.lr = lr
        opt.step()
        versions.append({n: p.data.copy() for n, p in named.items()})
    return versions[-1]


def main():
    assert WORLD.size == 5, "run on 5 ranks: 1 server, 2 groups of 2 workers"
    results = {}
    epochs = 2

    rec, params = run("sync", epochs)
    if params is not None:  # 4 workers of batch 8 against one process of batch 32
        rec["vs_reference"] = max_rel_diff(params, reference(
            mlp("float64"), dense_data(n=192), epochs, "float64", 4))
    results["sync"] = WORLD.gather(rec)

    # --group-size 1, and the option left out (the parameter server before groups): the
    # same part, the same bits
    plain = {}
    for name, g in (("one", 1), ("absent", None)):
        rec, plain[name] = run("sync", epochs, group_size=g)
        results["g1_" + name] = WORLD.gather(rec)
    rec = {"rank": WORLD.rank}
    if plain["one"] is not None:
        rec["bitwise"] = all(np.array_equal(plain["one"][n], plain["absent"][n])
                             for n in plain["absent"])
        rec["vs_reference"] = max_rel_diff(plain["one"], reference(
            mlp("float64"), dense_data(n=192), epochs, "float64", 4))
    results["g1_compare"] = WORLD.gather(rec)

    # rank 4 (not a leader) 3x slower: its group waits for it, the other runs ahead
    rec, params = run("async", epochs, busy=0.002, straggler="4:3")
    everyone = WORLD.gather((rec, params))
    if WORLD.rank == 0:
        shards = {r["rank"]: tuple(r["shard"]) for r, _ in everyone[1:]}
        final = replay(everyone[0][0]["stats"]["trace"], shards, epochs)
        every = [r for r, _ in everyone]
        for r, p in everyone[1:]:
            r["vs_replay"] = max_rel_diff(p, final)
        results["async"] = every

    if WORLD.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()

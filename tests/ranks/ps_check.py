"""Multi-rank checks of the parameter server, run on 4 ranks by test_parameter_server_mpi.py.

``python -m mpi4py ps_check.py OUT.json`` runs every scenario below on sub-communicators
of MPI_COMM_WORLD (one launch, many checks) and writes what each rank measured to
OUT.json; the pytest side makes the assertions, so a failure names the scenario.

``python -m mpi4py ps_check.py --bad-push shape|dtype`` makes the last worker push a
gradient of the wrong shape (or dtype) at its third step: the job must end on every rank
with the server's message naming that worker and tensor.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from mpidl.data import BatchLoader
from mpidl.engine.activations import ReLU
from mpidl.engine.embedding import Embedding
from mpidl.engine.linear import Linear
from mpidl.engine.losses import SoftmaxCrossEntropy
from mpidl.engine.module import Layer, Sequential
from mpidl.engine.optim import SGD
from mpidl.engine.reshape import Flatten
from mpidl.comm import Communicator
from mpidl.runtime import build


def ps_runtime(comm, **options):
    """``--strategy ps`` on the ranks of ``comm`` (an mpi4py communicator)."""
    return build("ps", Communicator(comm), **options)


def worker_of(runtime):
    """The worker's side of the protocol (``mpidl.ps.worker.PSWorker``)."""
    return runtime.syncs[0][1].worker

WORLD = MPI.COMM_WORLD
LR, MOMENTUM, BATCH = 0.05, 0.9, 8


class Busy(Layer):
    """Identity whose forward takes ``seconds`` (sleeping): gives steps a compute time
    that the straggler factor can multiply, without loading the shared cores."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x

    def backward(self, dy):
        return dy


def mlp(dtype, busy=0.0, seed=0):
    rng = np.random.default_rng(seed)
    layers = [Linear(12, 16, rng=rng, dtype=dtype), ReLU(), Linear(16, 16, rng=rng, dtype=dtype),
              ReLU(), Linear(16, 4, rng=rng, dtype=dtype)]
    if busy:
        layers.insert(0, Busy(busy))
    return Sequential(*layers)


def embed_net(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return Sequential(Embedding(1000, 6, rng=rng, dtype=dtype), Flatten(),
                      Linear(5 * 6, 16, rng=rng, dtype=dtype), ReLU(),
                      Linear(16, 4, rng=rng, dtype=dtype))


def dense_data(n=96, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 12))
    y = (x[:, :4].argmax(axis=1)).astype(np.int64)
    return x, y


def id_data(n=96, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 1000, size=(n, 5)).astype(np.int64)
    y = (x[:, 0] % 4).astype(np.int64)
    return x, y


def train(strategy, model, data, epochs, dtype, bad=None):
    """The trainer's loop in miniature; returns (worker params or None, server stats)."""
    opt = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    strategy.setup(model, opt, SoftmaxCrossEntropy())
    if not strategy.trains_on_data:
        st = strategy.serve()
        strategy.finish()
        return None, st.as_dict(), opt
    index, count = strategy.shard()
    x, y = data
    loader = BatchLoader(x, y, BATCH, shard=(index, count), seed=0,
                         dtype=dtype if x.dtype.kind == "f" else None)
    step = 0
    for epoch in range(epochs):
        for _, xb, yb in loader.epoch(epoch):
            if x.dtype.kind != "f":
                xb = xb.astype(np.int64)
            opt.lr = LR * (0.9 ** epoch)  # a schedule: the server must follow it
            if bad and step == 2 and strategy.rank == strategy.size - 1:
                p = dict(model.named_parameters())["2.weight"]
                orig_push = worker_of(strategy).push

                def broken(lr=None, p=p, orig_push=orig_push):
                    p.grad = (np.zeros((3, 3), p.data.dtype) if bad == "shape"
                              else p.grad.astype(np.float16))
                    return orig_push(lr)
                worker_of(strategy).push = broken
            loss = strategy.train_step(xb, yb)
            step += 1
            if strategy.epoch_cut():  # as the trainer does (--epoch-quorum)
                break
        # the trainer's order: a collective over the workers first, then evaluation
        strategy.reduce({"loss": loss, "steps": 1}, "sum")
        strategy.prepare_eval()
        strategy.metrics()
    params = {n: p.data.copy() for n, p in model.named_parameters()}
    strategy.finish()
    assert not opt.state, "a worker holds optimizer state"
    return params, None, opt


def reference(model, data, epochs, dtype, workers):
    """One process, global batch = workers x BATCH: what sync PS must reproduce."""
    opt = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    loss = SoftmaxCrossEntropy()
    model.needs_input_grad = False
    x, y = data
    loader = BatchLoader(x, y, BATCH * workers, seed=0,
                         dtype=dtype if x.dtype.kind == "f" else None)
    for epoch in range(epochs):
        for _, xb, yb in loader.epoch(epoch):
            if x.dtype.kind != "f":
                xb = xb.astype(np.int64)
            opt.lr = LR * (0.9 ** epoch)
            model.zero_grad()
            loss.forward(model.forward(xb), yb)
            model.backward(loss.backward())
            opt.step()
    return {n: p.data.copy() for n, p in model.named_parameters()}


def max_rel_diff(a, b):
    worst = 0.0
    for n in a:
        d = float(np.max(np.abs(a[n] - b[n]))) / max(1e-30, float(np.max(np.abs(b[n]))))
        worst = max(worst, d)
    return worst


def equivalence(comm, servers, dtype, net="mlp", epochs=2):
    """sync PS vs the single-process global-batch reference; also vs data parallelism
    over the same worker ranks when that strategy is installed."""
    make, data = (mlp, dense_data()) if net == "mlp" else (embed_net, id_data())
    s = ps_runtime(comm, servers=servers, mode="sync")
    params, st, opt = train(s, make(dtype), data, epochs, dtype)
    out = {"rank": comm.rank, "server": st is not None}
    if st is not None:
        out.update(pushed=st["pushed"], applied=st["applied"], dropped=st["dropped"],
                   bytes_received=st["bytes_received"],
                   opt_state=sorted(opt.state), holds=list(s.server.server.names))
    workers = comm.size - servers
    if params is not None:
        ref = reference(make(dtype), data, epochs, dtype, workers)
        out["vs_reference"] = max_rel_diff(params, ref)
        out["dense_bytes"] = int(sum(p.nbytes for p in ref.values()))
    # data parallelism on the worker ranks
    sub = comm.Split(1 if params is not None else MPI.UNDEFINED, comm.rank)
    if params is not None:
        dp = build("allreduce", Communicator(sub))
        model = make(dtype)
        opt = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
        dp.setup(model, opt, SoftmaxCrossEntropy())
        x, y = data
        loader = BatchLoader(x, y, BATCH, shard=dp.shard(), seed=0,
                             dtype=dtype if x.dtype.kind == "f" else None)
        for epoch in range(epochs):
            for _, xb, yb in loader.epoch(epoch):
                opt.lr = LR * (0.9 ** epoch)
                dp.train_step(xb.astype(np.int64) if x.dtype.kind != "f" else xb, yb)
        dp.finish()
        out["vs_allreduce"] = max_rel_diff(
            params, {n: p.data for n, p in model.named_parameters()})
    if sub != MPI.COMM_NULL:
        sub.Free()
    return out


def modes(comm, mode, straggler_factor=4.0, **kw):
    """A run with a straggler (last rank, FACTOR x slower); the server keeps a trace."""
    s = ps_runtime(comm, servers=1, mode=mode, trace=True,
                                straggler=f"{comm.size - 1}:{straggler_factor}", **kw)
    t0 = time.perf_counter()
    params, st, _ = train(s, mlp("float32", busy=0.002), dense_data(n=288), 1, "float32")
    out = {"rank": comm.rank, "wall": time.perf_counter() - t0}
    if st is not None:
        out["stats"] = st
    else:
        out["worker"] = dict(worker_of(s).stats)
        out["finite"] = bool(all(np.isfinite(v).all() for v in params.values()))
        out["metrics"] = s.metrics()
    return out


def worker_batches(x, y, shards, epochs, dtype):
    """{(worker rank, clock): (lr, x, y)}: each worker's batches in the order of its loop
    in ``train()``, for ``shards`` = [(worker rank, (index, count)), ...]."""
    batches = {}
    for rank, (index, count) in shards:
        loader = BatchLoader(x, y, BATCH, shard=(index, count), seed=0, dtype=dtype)
        clock = 0
        for epoch in range(epochs):
            for _, xb, yb in loader.epoch(epoch):
                batches[rank, clock] = (LR * 0.9 ** epoch, xb, yb)
                clock += 1
    return batches


def replay_model(dtype):
    """A replay's one-process model (the run's layer names, no sleeping), its parameters
    by name, SGD, the loss, and [its parameters as version 0]."""
    ref = mlp(dtype, busy=0.002)
    next(layer for _, layer in ref.children()).seconds = 0.0
    ref.needs_input_grad = False
    named = dict(ref.named_parameters())
    opt = SGD(ref.named_parameters(), lr=LR, momentum=MOMENTUM)
    return ref, named, opt, SoftmaxCrossEntropy(), [{n: p.data.copy() for n, p in named.items()}]



def async_replay(comm, mode="async", **kw):
    """Async, SSP or softsync with 3 workers and a straggler, replayed in one process.

    The server's trace gives, for every push, the update it went into and its staleness,
    so the version of the parameters it was computed from (that update's number minus
    the staleness). Replaying that schedule — for each update, the gradients of its pushes'
    batches at their old versions, weighted as the mode weights them (softsync: 1/staleness;
    ``--staleness-aware-lr``: the lr divided by it), averaged in (worker, clock) order, then
    one optimizer step on the newest parameters — must give the server's parameters
    exactly: any mix-up of buffers, versions, groups or batches between workers shows."""
    from mpidl.ps.modes import staleness_weight  # noqa: PLC0415

    epochs, dtype = 2, "float64"
    s = ps_runtime(comm, servers=1, mode=mode, trace=True,
                                straggler=f"{comm.size - 1}:3", **kw)
    model = mlp(dtype, busy=0.002)
    data = dense_data(n=192)
    params, st, _ = train(s, model, data, epochs, dtype)
    final = {n: p.data.copy() for n, p in model.named_parameters()}
    shards = comm.gather(s.shard() if params is not None else None)
    out = {"rank": comm.rank}
    if st is None:
        return out
    trace = st["trace"]
    x, y = data
    batches = worker_batches(x, y, ((r, sh) for r, sh in enumerate(shards) if sh is not None),
                             epochs, dtype)
    ref, named, opt, loss, versions = replay_model(dtype)
    updates = {}
    for w, clock, _lead, staleness, applied, update in trace:
        assert applied, "async, SSP and softsync apply every push"
        updates.setdefault(update, []).append((w, clock, staleness))
    assert sorted(updates) == list(range(len(updates))), "updates numbered 0, 1, ..."
    for u in range(len(updates)):
        group = sorted(updates[u])
        total = {n: 0.0 for n in named}
        for w, clock, staleness in group:
            _, xb, yb = batches[w, clock]
            for n, p in named.items():  # the gradient at the version the worker had
                p.data[...] = versions[u - staleness][n]
            ref.zero_grad()
            loss.forward(ref.forward(xb), yb)
            ref.backward(loss.backward())
            weight = staleness_weight(staleness) if mode == "softsync" else 1.0
            for n, p in named.items():
                total[n] = total[n] + weight * p.grad
        for n, p in named.items():  # applied to the newest parameters
            p.data[...] = versions[u][n]
            p.grad = total[n] / len(group)
        lr = batches[group[-1][0], group[-1][1]][0]
        scale = 1.0 / max(1, group[0][2]) if kw.get("staleness_aware_lr") else 1.0
        opt.lr = lr * scale
        opt.step()
        versions.append({n: p.data.copy() for n, p in named.items()})
    sizes = [len(g) for g in updates.values()]
    out.update(vs_replay=max_rel_diff(final, versions[-1]), pushes=len(trace),
               stale=sum(1 for row in trace if row[3] > 0),
               max_staleness=max(row[3] for row in trace),
               mean_staleness=float(np.mean([row[3] for row in trace])),
               group_sizes=sorted(set(sizes)), updates=len(updates))
    return out


def epoch_quorum(comm, mode, **kw):
    """--epoch-quorum 2 of 3 workers, the last one 6x slower: every epoch ends when the
    two fast workers are done; the straggler skips the rest of its shard."""
    s = ps_runtime(comm, servers=1, mode=mode, epoch_quorum=2, trace=True,
                                straggler=f"{comm.size - 1}:6", **kw)
    params, st, _ = train(s, mlp("float32", busy=0.002), dense_data(n=288), 2, "float32")
    out = {"rank": comm.rank}
    if st is not None:
        out["stats"] = st
    else:
        out["pushes"] = worker_of(s).stats["pushes"]
        out["finite"] = bool(all(np.isfinite(v).all() for v in params.values()))
        out["steps_per_epoch"] = len(BatchLoader(*dense_data(n=288), BATCH,
                                                 shard=s.shard(), seed=0))
    return out


ONE_WORKER_MODES = [("sync", "sync", {}), ("async", "async", {}),
                    ("async_salr", "async", {"staleness_aware_lr": True}),
                    ("softsync", "softsync", {}),
                    ("ssp0", "ssp", {"staleness": 0}), ("ssp2", "ssp", {"staleness": 2}),
                    ("backup", "backup", {"wait": 1})]


def one_worker(comm):
    """Ranks 0 (server) and 1 (the only worker): with one worker nothing can be stale, so
    every mode must give sync's parameters bitwise (the modes differ only in timing)."""
    sub = comm.Split(0 if comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    out = {"rank": comm.rank}
    if sub == MPI.COMM_NULL:
        return out
    got, counts = {}, {}
    for name, mode, kw in ONE_WORKER_MODES:
        s = ps_runtime(sub, servers=1, mode=mode, **kw)
        params, st, _ = train(s, mlp("float64"), dense_data(), 2, "float64")
        if params is not None:
            got[name] = params
        else:
            counts[name] = {k: st[k] for k in ("pushed", "applied", "dropped")}
    if got:
        ref = reference(mlp("float64"), dense_data(), 2, "float64", 1)
        out["vs_sync"] = {name: max_rel_diff(p, got["sync"]) for name, p in got.items()}
        out["vs_reference"] = max_rel_diff(got["sync"], ref)
    else:
        out["counts"] = counts
    sub.Free()
    return out


def compressed(comm, name, ratio=None):
    """sync PS with compressed pushes (error feedback where the compressor has it)."""
    s = ps_runtime(comm, servers=1, mode="sync", compression=name, ratio=ratio)
    data = dense_data()
    params, st, _ = train(s, mlp("float32"), data, 2, "float32")
    out = {"rank": comm.rank}
    if st is not None:
        out.update(pushed=st["pushed"], applied=st["applied"],
                   bytes_received=st["bytes_received"])
    else:
        ref = reference(mlp("float32"), data, 2, "float32", comm.size - 1)
        out["vs_reference"] = max_rel_diff(params, ref)
        out["dense_bytes"] = int(sum(p.nbytes for p in ref.values()))
        out["finite"] = bool(all(np.isfinite(v).all() for v in params.values()))
        out["bytes_sent"] = worker_of(s).stats["bytes_sent"]
        out["pushes"] = worker_of(s).stats["pushes"]
    return out


def main():
    if sys.argv[1] == "--bad-push":
        s = ps_runtime(WORLD, servers=1, mode="sync")
        train(s, mlp("float32"), dense_data(), 2, "float32", bad=sys.argv[2])
        return
    results = {}
    world = WORLD
    assert world.size == 4, "run on 4 ranks"
    results["eq_s1_f64"] = world.gather(equivalence(world, 1, "float64"))
    results["eq_s2_f64"] = world.gather(equivalence(world, 2, "float64"))
    results["eq_s1_f32"] = world.gather(equivalence(world, 1, "float32"))
    results["eq_sparse_s2"] = world.gather(equivalence(world, 2, "float64", net="embed"))
    results["one_worker"] = world.gather(one_worker(world))
    for name, mode, kw in [("sync", "sync", {}), ("async", "async", {}),
                           ("async_salr", "async", {"staleness_aware_lr": True}),
                           ("ssp1", "ssp", {"staleness": 1}),
                           ("ssp3", "ssp", {"staleness": 3}),
                           ("backup", "backup", {"wait": 2}),
                           ("softsync", "softsync", {"wait": 2})]:
        results["mode_" + name] = world.gather(modes(world, mode, **kw))
    for name, mode, kw in [("async", "async", {}), ("ssp", "ssp", {"staleness": 1}),
                           ("backup", "backup", {"wait": 2})]:
        results["quorum_" + name] = world.gather(epoch_quorum(world, mode, **kw))
    for name, mode, kw in [("async", "async", {}), ("ssp1", "ssp", {"staleness": 1}),
                           ("async_salr", "async", {"staleness_aware_lr": True}),
                           ("softsync1", "softsync", {"wait": 1}),
                           ("softsync2", "softsync", {"wait": 2}),
                           ("softsync3", "softsync", {})]:
        results["replay_" + name] = world.gather(async_replay(world, mode, **kw))
    for name, kw in [("fp16", {}), ("topk", {"ratio": 0.1}), ("onebit", {}),
                     ("qsgd", {}), ("randomk", {"ratio": 0.25}), ("dgc", {"ratio": 0.1})]:
        results["comp_" + name] = world.gather(compressed(world, name, **kw))
    if world.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()

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

Beside plain data parallelism, a fourth argument names the other layouts to check, each
built as ``mpidl train`` builds it: ``zero1``, ``zero2``, ``zero3`` (with 2
micro-batches: every bucket gathered once per forward and backward of each; ``zero3r``
with ``--zero-reuse on``),
``local-sgd`` and ``diloco`` (``--period 3``: three counted steps hold one averaging),
``bf16`` and ``fp16`` (``--precision``: 2-byte buckets; the mlp only, which has a
low-precision path), ``syncbn`` (``--sync-bn``: the cnn's BatchNorms all-reduce their
statistics in every pass; ``syncbn+local-sgd`` combines two), ``c-NAME`` (``--compression NAME``: the simulation runs its own
compressor on made-up gradients; for ``topk``, ``threshold`` and ``dgc``, whose payload
size depends on the values (delta-packed indices), each rank's real frame sizes are
recorded during the counted step and given to it), ``psc-NAME`` (``--strategy ps --compression NAME``, sync, 1 server), ``ps-MODE[-S]`` (``--strategy ps
--mode MODE --servers S``: point-to-point pushes and answers; algorithms and buckets do
not apply), ``tpT`` (``--tensor-parallel T``: the tp and dp groups' counters, group by
group), ``ppP[-SCHEDULE[-M]][-tT]`` (``--pipeline-stages P --schedule SCHEDULE
--micro-batches M [--tensor-parallel T]``, default 1f1b, 2 and 1: the pipeline, dp and
tp groups' counters; ``-rc`` in ``pp...``: ``--recompute``, ``-tied``: gpt-tiny with
``--tie-weights`` (its head and token embedding on two stages), ``-tiedstep`` that with
``--tied-exchange step``, ``-bn``: ``--sync-bn`` (the cnn), ``-bf16``/``-fp16``:
``--precision`` (the mlp); ``tp...`` and ``pp...`` take
``+zeroK``: ZeRO stage K on the dp group; ``tp...`` also ``3r`` with ``--zero-reuse on``),
``parallax-MODE[-S]`` (``--sparse-sync ps``: gpt-tiny's Embeddings, or the mlp's
biases with ``--ps-params '*.bias'``, on S servers; the rest all-reduced among the
trainers), ``clip`` or ``...+clip`` (``--clip-grad-norm``: the norm's two MPI
all-reduces on every group that sums it, in any layout above), ``hogwild[-S]`` (``--strategy hogwild --servers S``: a worker's one-sided
operations), ``groupsG-MODE[-S]`` (``--strategy ps --group-size G``: a group's all-reduce and
broadcast, its leader's pushes), ``hybrid`` and ``hybrid+syncbn`` (``--hybrid conv-dp-fc-mp``, the cnn: the boundary's
gathers, the FC block's all-reduces and the convolutions' buckets on the one group). Models: ``mlp``, ``gpt``, ``cnn``.

Any failure raises; ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
Usage: mpiexec -n N python -m mpi4py tests/ranks/simulate_check.py ALGS BUCKETS [MODELS
  [LAYOUTS]]   e.g. ring,tree 0.001,4 mlp,gpt zero1,local-sgd
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
from mpidl.runtime.zero import boundary_params
from mpidl.runtime.sync.rowsparse import sparse_param_names
from mpidl.simulate.step import layout, sync_bn_layers, touched_rows, traffic

B = 3
VOCAB, CONTEXT = 23, 12


def make(kind, tied=False):
    if kind in ("mlp", "cnn"):
        return build_model(kind, input_shape=(1, 28, 28), num_classes=10, seed=1)
    return build_model("gpt-tiny", input_shape=(CONTEXT,), num_classes=VOCAB, seed=1,
                       layers=1, heads=2, width=16, tie_weights=tied)


def batch(kind, step, rank):
    rng = np.random.default_rng(100 * step + rank)
    if kind in ("mlp", "cnn"):
        return (rng.standard_normal((B, 1, 28, 28)).astype("float32"),
                rng.integers(0, 10, size=B))
    # few distinct ids per rank (and a rank-dependent number): uneven row counts
    ids = rng.integers(0, 2 + 3 * rank, size=(B, CONTEXT + 1))
    return ids[:, :-1], ids[:, 1:]


def gathers_by(algorithm):
    """Tuning tables under which ``auto`` runs the row gathers and the worker groups'
    broadcasts with ``algorithm`` (they always ask for ``auto``; by default they would
    be MPI's own at these sizes)."""
    return None if algorithm == "auto" else {"allgather": {"1": [[None, algorithm]]},
                                             "bcast": {"1": [[None, algorithm]]}}


PERIOD = 3
#: what each layout adds to ``build("allreduce", ...)``, and to ``layout(...)``
LAYOUTS = {
    "dp": ({}, {}),
    # (ZeRO shards the Embedding's gradient too: --sparse-grads dense)
    "zero1": ({"zero": 1, "sparse_grads": "dense"}, {"zero": 1}),
    "zero2": ({"zero": 2, "sparse_grads": "dense"}, {"zero": 2}),
    "zero3": ({"zero": 3, "accumulate": 2, "sparse_grads": "dense"}, {"zero": 3, "micro": 2}),
    # (and zero_keep, from the model: check)
    "zero3r": ({"zero": 3, "zero_reuse": "on", "accumulate": 2, "sparse_grads": "dense"},
               {"zero": 3, "micro": 2}),
    "local-sgd": ({"sync": "local-sgd", "period": PERIOD}, {"period": PERIOD}),
    "diloco": ({"sync": "diloco", "period": PERIOD}, {"period": PERIOD}),
    "bf16": ({"precision": "bf16"}, {"wire": "bf16"}),
    "fp16": ({"precision": "fp16"}, {"wire": "fp16"}),
    "syncbn": ({"sync_bn": True}, {"sync_bn": True}),  # (the cnn: its BatchNorms)
    # --clip-grad-norm: ZeRO's group sums the norm (the elements: check); plain data
    # parallelism computes it without a message
    "clip": ({"clip_grad_norm": 1.0}, {}),
}


def clip_of(how, kind):
    """``(how without "+clip", the elements --clip-grad-norm counts or 0)``."""
    if not how.endswith("+clip"):
        return how, 0
    return how[:-len("+clip")], sum(q.data.size for _, q in make(kind).named_parameters())


#: compressors whose payload size depends on the gradient's values
DATA_DEPENDENT = ("topk", "threshold", "dgc")


class FrameSizes:
    """Records the bytes of every frame this rank's exchanger packs, by tensor name (an
    observation of the real exchange: the frames still travel)."""

    def __init__(self):
        from mpidl.compress import exchange, frame

        self.sizes, self._last = {}, None
        self._pack, self._start = frame.pack, exchange.Exchanger.start
        rec = self

        def pack(payload, like=None):
            out = rec._pack(payload, like)
            rec._last = int(out.nbytes)
            return out

        def start(ex, grad, name):
            rec._last = None
            pending = rec._start(ex, grad, name)
            if rec._last is not None:
                rec.sizes[name] = rec._last
            return pending

        frame.pack, exchange.Exchanger.start = pack, start

    def close(self):
        from mpidl.compress import exchange, frame

        frame.pack, exchange.Exchanger.start = self._pack, self._start


def made_up_grads(model):
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal(q.data.shape).astype(q.data.dtype)
            for n, q in model.named_parameters()}


def wire_dtype(fmt):
    from mpidl.runtime.precision import Wire

    return Wire(fmt).dtype


def check(kind, algorithm, bucket_mb, overlap, per_node, how="dp"):
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    model = make(kind)
    model.needs_input_grad = False
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    options, shape = {}, {}
    for part in how.split("+"):  # (layouts combined: syncbn+local-sgd)
        if part.startswith("c-"):
            options = {**options, "compression": part[2:]}
        else:
            options, shape = {**options, **LAYOUTS[part][0]}, {**shape, **LAYOUTS[part][1]}
    if options.get("zero_reuse") == "on":
        shape["zero_keep"] = boundary_params(model)
    if "clip_grad_norm" in options:
        shape["clip"] = sum(q.data.size for _, q in model.named_parameters())
    rt = build("allreduce", comm, algorithm=algorithm, bucket_mb=bucket_mb,
               overlap="off" if options.get("zero", 0) >= 2 else overlap, **options)
    rt.setup(model, opt, TokenCrossEntropy() if kind == "gpt" else SoftmaxCrossEntropy())
    def step_batch(k):  # (twice the batch with 2 micro-batches)
        x, y = batch(kind, k, rank)
        if options.get("accumulate"):
            x, y = np.concatenate([x, x]), np.concatenate([y, y])
        return x, y

    rt.train_step(*step_batch(0))
    rt.group.reset_counters()
    sparse = sparse_param_names(model) \
        if "sparse_grads" not in options and "compression" not in options else []
    rows = {name: [0] * p for name in sparse}
    frames = FrameSizes() if options.get("compression") in DATA_DEPENDENT else None
    for k in range(shape.get("period", 1)):  # the steps the layout describes
        x, y = step_batch(1 + k)
        rt.train_step(x, y)
        mine = touched_rows(make(kind), sparse, x)
        everyone = MPI.COMM_WORLD.allgather(mine)  # (not through the counted communicator)
        rows = {name: [r[name] for r in everyone] for name in sparse}
    counted = rt.group.counters()
    if "compression" in options:
        given = None
        if frames is not None:
            frames.close()
            everyone = MPI.COMM_WORLD.allgather(frames.sizes)
            given = {name: [r[name] for r in everyone] for name in frames.sizes}
        shape["compression"] = {"spec": options["compression"], "ratio": None,
                                "grads": made_up_grads(model), "frames": given}
    if "wire" in shape:
        shape["wire"] = wire_dtype(shape["wire"])
    if shape.get("sync_bn"):
        shape["sync_bn"] = sync_bn_layers(make(kind))
    step = layout(make(kind).named_parameters(), p, algorithm, bucket_mb, sparse, rows,
                  tables=tables, **shape)
    predicted = traffic(step, per_node, ranks=[rank])[rank]
    if predicted != counted:
        diff = {k: (predicted[k], counted[k]) for k in counted if predicted.get(k) != counted[k]}
        raise AssertionError(f"rank {rank} of {p}, {kind} {how} {algorithm} bucket {bucket_mb} "
                             f"MiB overlap {overlap} nodes of {per_node}: predicted != counted "
                             f"{diff}; calls {[(c.kind, c.name, c.algorithm, c.size) for c in step.calls]}")
    rt.mesh.close()  # (its groups' communicators: many cases would run out of them)
    comm.close()
    totals = MPI.COMM_WORLD.gather(counted["total"], root=0)
    if rank == 0:
        msgs = [t["messages"] for t in totals]
        nbytes = [t["bytes"] for t in totals]
        print(f"exact p={p} {kind} {how} {algorithm} bucket {bucket_mb} MiB overlap {overlap}: "
              f"{len(step.calls)} calls, messages per rank {msgs}, bytes per rank {nbytes}",
              flush=True)
    return counted


def worker_counters(rt, kind, rank, together, comms, second=None):
    """A worker's counters over its second step (``{name: counters}`` of ``comms``, name ->
    Communicator); the workers meet in ``together`` after each step (not through the
    counted communicators), so that under async the servers' window between the updates
    that end the first and second steps holds nobody's first pull or goodbye."""
    rt.train_step(*batch(kind, 0, rank))
    together.Barrier()
    for c in comms.values():
        c.reset_counters()
    rt.train_step(*(second or batch(kind, 1, rank)))
    out = {name: c.counters() for name, c in comms.items()}
    together.Barrier()
    return out


def same_groups(predicted, counted, where):
    """Raise, naming ``where`` and every field that differs, unless each group's counters
    in ``counted`` equal ``predicted``'s."""
    for group, got in counted.items():
        want = predicted[group]
        if want != got:
            diff = {k: (want[k], got[k]) for k in got if want.get(k) != got[k]}
            raise AssertionError(f"{where}: {group} predicted != counted {diff}")


def served_between(rt, first, second):
    """A server's counters between the updates that made versions ``first`` and
    ``second`` (it serves until the workers are done)."""
    marks = {}

    def mark(srv):
        if srv.version in (first, second):
            marks[srv.version] = rt.comm.counters()
    rt.server.server.on_update = mark
    rt.serve()
    if first not in marks or second not in marks:
        return None  # (a mode whose versions skip them)
    return {k: {f: marks[second][k][f] - marks[first][k][f] for f in v}
            for k, v in marks[second].items()}


def check_ps(kind, how):
    """``ps-MODE[-S]``: ``--strategy ps --mode MODE --servers S`` (default 1). Every
    worker's counters over its second step, and (sync, async: whose updates keep step with
    the pushes) every server's between the updates that end the first and the second
    step, must equal ``mpidl.simulate.server``'s messages for that rank."""
    from mpidl.simulate import server as ps_model

    from mpidl.ps import worker as ps_worker
    from mpidl.simulate import compression

    parts = how.split("-")
    if parts[0] == "psc":  # --compression NAME, sync, 1 server
        mode, servers, spec = "sync", 1, parts[1]
    else:
        mode, servers, spec = parts[1], int(parts[2]) if len(parts) > 2 else 1, None
    comm = Communicator(MPI.COMM_WORLD)
    p, rank = comm.size, comm.rank
    workers = p - servers
    model = make(kind)
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    loss = TokenCrossEntropy() if kind == "gpt" else SoftmaxCrossEntropy()
    rt = build("ps", comm, servers=servers, mode=mode, compression=spec)
    rt.setup(model, opt, loss)
    encoded = {}  # the data-dependent compressors' real pushes, recorded (they still go)
    if spec in DATA_DEPENDENT:
        real = ps_worker.PSWorker._encode

        def record(worker, name, g):
            out = real(worker, name, g)
            encoded[name] = (out[0], out[1], [np.asarray(a).copy() for a in out[2]])
            return out
        ps_worker.PSWorker._encode = record
    per_step = ps_model.updates_per_step(mode, workers)
    counted = None
    together = MPI.COMM_WORLD.Split(int(rt.trains_on_data), rank)
    if rt.trains_on_data:
        counted = worker_counters(rt, kind, rank, together, {"world": rt.comm})["world"]
    else:
        served = served_between(rt, int(per_step), int(2 * per_step))
        if mode in ("sync", "async"):
            counted = served
    rt.finish()
    together.Free()
    if spec in DATA_DEPENDENT:
        ps_worker.PSWorker._encode = real
    # the arrays a push holds: one backward of a batch of the same shape (compressed: of
    # this worker's batch, by a fresh compressor of this worker)
    probe = make(kind)
    x, y = batch(kind, 1, rank if spec else 0)
    loss.forward(probe(x), y)
    probe.backward(loss.backward())
    grads = {n: q.grad for n, q in probe.named_parameters()}
    if spec is None:
        arrays, by_worker = ps_model.pushed_arrays(grads), None
    else:
        mine = encoded or (compression.pushed(spec, None, grads, rank - servers, workers)
                           if rank >= servers else None)
        by_worker = {r: a for r, a in enumerate(MPI.COMM_WORLD.allgather(mine))
                     if a is not None}
        arrays = {}
    step, _ = ps_model.layout(make(kind).named_parameters(), p, servers,
                              ps_model.Pushes(arrays, lr=0.01, step=1, mode=mode,
                                              by_worker=by_worker))
    predicted = ps_model.traffic(step, ranks=[rank])[rank]
    if counted is not None and predicted != counted:
        diff = {k: (predicted[k], counted[k]) for k in counted if predicted.get(k) != counted[k]}
        raise AssertionError(f"rank {rank} of {p}, {kind} {how}: predicted != counted {diff}")
    comm.close()
    totals = MPI.COMM_WORLD.gather(None if counted is None else counted["total"], root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how}: messages per rank "
              f"{[t and t['messages'] for t in totals]}, bytes per rank "
              f"{[t and t['bytes'] for t in totals]}", flush=True)


def check_parallax(kind, algorithm, bucket_mb, overlap, how):
    """``parallax-MODE[-S]``: ``--sparse-sync ps --mode MODE --servers S`` (default 1;
    gpt-tiny: its Embeddings on the servers; the mlp: ``--ps-params '*.bias'``). Every
    trainer's world (pushes, answers) and dp group's counters over its second step, and
    (sync) every server's between the updates that end the first and the second step,
    must equal ``mpidl.simulate.parallax``'s layout for that rank."""
    from mpidl.runtime.sync.rowsparse import as_rows
    from mpidl.simulate import parallax
    from mpidl.simulate import server as ps_model

    parts = how.split("-")
    mode, servers = parts[1], int(parts[2]) if len(parts) > 2 else 1
    patterns = "*.bias" if kind == "mlp" else None
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    model = make(kind)
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    rt = build("allreduce", comm, algorithm=algorithm, bucket_mb=bucket_mb, overlap=overlap,
               sparse_sync="ps", ps_params=patterns, servers=servers, mode=mode)
    rt.setup(model, opt, loss_of(kind))
    together = MPI.COMM_WORLD.Split(int(rt.trains_on_data), rank)
    counted = arrays = None
    x, y = batch(kind, 1, rank)
    if rt.trains_on_data:
        counted = worker_counters(rt, kind, rank, together,
                                  {"world": rt.comm, "dp": rt.group}, (x, y))
    else:
        served = served_between(rt, 1, 2)
        if mode == "sync":
            counted = {"world": served}
    rt.finish()
    together.Free()
    remote = sorted(rt.syncs[0][1].split.remote) if rt.trains_on_data else None
    if rt.trains_on_data:  # what this trainer pushed: one backward of its batch
        probe = make(kind)
        loss = loss_of(kind)
        loss.forward(probe(x), y)
        probe.backward(loss.backward())
        arrays = ps_model.pushed_arrays({n: as_rows(q) if n in sparse_param_names(probe)
                                         else q.grad for n, q in probe.named_parameters()
                                         if n in remote})
    everyone = MPI.COMM_WORLD.allgather((rank, remote, arrays))
    remote = next(r for _, r, _ in everyone if r is not None)
    by_worker = {r: a for r, _, a in everyone if a is not None}
    pushes = ps_model.Pushes({}, lr=0.01, step=1, mode=mode, by_worker=by_worker)
    step = parallax.layout(make(kind).named_parameters(), p, servers, pushes, remote,
                           algorithm, bucket_mb, tables=tables)
    predicted = parallax.traffic(step, ranks=[rank])[rank]["groups"]
    same_groups(predicted, counted or {},
                f"rank {rank} of {p}, {kind} {how} {algorithm} bucket {bucket_mb}")
    comm.close()
    totals = MPI.COMM_WORLD.gather(None if counted is None else
                                   sum(g["total"]["bytes"] for g in counted.values()), root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how} {algorithm} bucket {bucket_mb} MiB: remote "
              f"{remote}, bytes per rank {totals}", flush=True)


def check_groups(kind, algorithm, bucket_mb, overlap, how, per_node):
    """``groupsG-MODE[-S]``: ``--strategy ps --group-size G --mode MODE --servers S``
    (default 1). Every worker's world (a leader's pushes) and group's counters over its
    second step, and (sync) every server's between the updates that end the first and
    the second step, must equal ``mpidl.simulate.server.grouped_layout``'s for it."""
    from mpidl.simulate import server as ps_model

    parts = how.split("-")
    size, mode = int(parts[0][len("groups"):]), parts[1]
    servers = int(parts[2]) if len(parts) > 2 else 1
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    model = make(kind)
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    rt = build("ps", comm, servers=servers, mode=mode, group_size=size, algorithm=algorithm,
               bucket_mb=bucket_mb, overlap=overlap)
    rt.setup(model, opt, loss_of(kind))
    together = MPI.COMM_WORLD.Split(int(rt.trains_on_data), rank)
    counted = None
    if rt.trains_on_data:
        counted = worker_counters(rt, kind, rank, together,
                                  {"world": rt.comm, "group": rt.syncs[0][1].comm})
    else:
        served = served_between(rt, 1, 2)
        if mode == "sync":
            counted = {"world": served}
    rt.finish()
    together.Free()
    named = make(kind).named_parameters()
    arrays = ps_model.pushed_arrays({n: np.zeros(q.data.shape, q.data.dtype)
                                     for n, q in named})
    step = ps_model.grouped_layout(named, p, servers, size,
                                   ps_model.Pushes(arrays, lr=0.01, step=1, mode=mode),
                                   algorithm, bucket_mb, tables=tables)
    predicted = ps_model.grouped_traffic(step, per_node, ranks=[rank])[rank]["groups"]
    same_groups(predicted, counted or {},
                f"rank {rank} of {p}, {kind} {how} {algorithm} bucket {bucket_mb}")
    comm.close()
    totals = MPI.COMM_WORLD.gather(None if counted is None else
                                   sum(g["total"]["bytes"] for g in counted.values()), root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how} {algorithm} bucket {bucket_mb} MiB: bytes per rank "
              f"{totals}", flush=True)


def check_hogwild(kind, how):
    """``hogwild[-S]``: ``--strategy hogwild --servers S`` (default 1). Every worker's
    counters over its second step (its one-sided operations, ``rma``) must equal
    ``mpidl.simulate.hogwild``'s; the servers' windows count nothing."""
    from mpidl.simulate import hogwild

    servers = int(how.split("-")[1]) if "-" in how else 1
    comm = Communicator(MPI.COMM_WORLD)
    p, rank = comm.size, comm.rank
    model = make(kind)
    opt = SGD(model.named_parameters(), lr=0.01, fused=False)
    rt = build("hogwild", comm, servers=servers)
    rt.setup(model, opt, loss_of(kind))
    if rt.trains_on_data:
        rt.train_step(*batch(kind, 0, rank))
        rt.comm.reset_counters()
        rt.train_step(*batch(kind, 1, rank))
        counted = rt.comm.counters()
    else:
        rt.serve()
        counted = {"rma": rt.comm.counters()["rma"]}
    rt.finish()
    step = hogwild.layout(make(kind).named_parameters(), p, servers)
    predicted = hogwild.traffic(step, ranks=[rank])[rank]
    for k, got in counted.items():
        if predicted[k] != got:
            raise AssertionError(f"rank {rank} of {p}, {kind} {how}: {k} predicted "
                                 f"{predicted[k]} != counted {got}")
    comm.close()
    totals = MPI.COMM_WORLD.gather(counted["rma"], root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how}: rma per rank {[t['messages'] for t in totals]} "
              f"messages, {[t['bytes'] for t in totals]} bytes", flush=True)


def check_tp(kind, algorithm, bucket_mb, overlap, how, per_node):
    """``tpT``: ``--tensor-parallel T`` (data parallelism over p / T): each rank's tp
    group's and dp group's counters over a step must equal ``mpidl.simulate.tensor``'s
    layout for this rank, group by group."""
    from mpidl.simulate import tensor

    core, clip = clip_of(how, kind)
    base, _, stage = core.partition("+zero")
    degree, zero, reuse = int(base[2:]), int(stage.rstrip("r") or 0), stage.endswith("r")
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    i, j = tensor.groups_of(rank, degree)
    model = make(kind)
    model.needs_input_grad = False
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    loss = TokenCrossEntropy() if kind == "gpt" else SoftmaxCrossEntropy()
    rt = build("allreduce", comm, algorithm=algorithm, bucket_mb=bucket_mb, overlap=overlap,
               tensor_parallel=degree, zero=zero, zero_reuse="on" if reuse else None,
               sparse_grads="dense" if zero else "allgather",
               clip_grad_norm=1.0 if clip else None)
    rt.setup(model, opt, loss)
    rt.train_step(*batch(kind, 0, i))  # (a tp group's ranks share their data: dp index)
    rt.mesh.reset_counters()
    x, y = batch(kind, 1, i)
    rt.train_step(x, y)
    counted = rt.mesh.counters()
    mine = tensor.cut(lambda: make(kind), degree, j, x, y, loss_of(kind), tables).rows
    everyone = MPI.COMM_WORLD.allgather((j, mine))  # (world rank order: dp index within j)
    rows = {t: {name: [r[name] for tt, r in everyone if tt == t] for name in mine}
            for t in range(degree)}
    pieces, whole = tensor.pieces_of(lambda: make(kind), degree, (x, y), loss_of(kind), tables)
    keep = boundary_params(make(kind)) if reuse else ()
    step = tensor.layout(pieces, whole, p, algorithm, bucket_mb, tables=tables, rows=rows,
                         sparse=not zero, zero=zero, zero_keep=keep, clip=clip)
    predicted = tensor.traffic(step, per_node, ranks=[rank])[rank]["groups"]
    same_groups(predicted, {g: counted[g] for g in ("tp", "dp")},
                f"rank {rank} of {p}, {kind} {how} {algorithm} bucket {bucket_mb}")
    rt.mesh.close()
    comm.close()
    totals = MPI.COMM_WORLD.gather(sum(counted[g]["total"]["bytes"] for g in ("tp", "dp")),
                                   root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how} {algorithm} bucket {bucket_mb} MiB: tp calls "
              f"{len(step.pieces[0].calls)} per micro-batch, bytes per rank {totals}",
              flush=True)


def check_pp(kind, algorithm, bucket_mb, how, per_node):
    """``ppP[-SCHEDULE[-M]][-tT]``: ``--pipeline-stages P --schedule SCHEDULE
    --micro-batches M --tensor-parallel T`` (default 1f1b, 2, 1) with data parallelism
    over p / (P T), the stages cut one cost per layer: each rank's pipeline, dp (and tp)
    groups' counters over a step must equal ``mpidl.simulate.pipeline``'s layout for
    this rank, group by group."""
    from mpidl.simulate import pipeline

    from mpidl.simulate import tensor

    core, clip = clip_of(how, kind)
    base, _, stage = core.partition("+zero")
    zero = int(stage or 0)
    parts = base[2:].split("-")
    recompute, tied, per_step = "rc" in parts, "tied" in parts, "tiedstep" in parts
    tied, sync_bn = tied or per_step, "bn" in parts
    precision = next((q for q in parts if q in ("bf16", "fp16")), None)
    parts = [q for q in parts if q not in ("rc", "tied", "tiedstep", "bn", "bf16", "fp16")]
    T = int(parts.pop()[1:]) if parts[-1].startswith("t") else 1
    P = int(parts[0])
    schedule = parts[1] if len(parts) > 1 else "1f1b"
    M = int(parts[2]) if len(parts) > 2 else 2
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    model = make(kind, tied)
    model.needs_input_grad = False
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    rt = build("allreduce", comm, algorithm=algorithm, bucket_mb=bucket_mb,
               pipeline_stages=P, pipeline_schedule=schedule, micro_batches=M,
               stage_costs="layers", tensor_parallel=T, zero=zero, recompute=recompute,
               tied_exchange="step" if per_step else None, sync_bn=sync_bn,
               sparse_grads="dense" if zero else "allgather", precision=precision,
               clip_grad_norm=1.0 if clip else None)
    rt.setup(model, opt, loss_of(kind))
    i = rt.shard()[0]  # (a replica's stages share its data)

    def step_batch(step):
        xs, ys = zip(*(batch(kind, 10 * step + k, i) for k in range(M)))
        return np.concatenate(xs), np.concatenate(ys)

    rt.train_step(*step_batch(0))
    rt.mesh.reset_counters()
    x, y = step_batch(1)
    rt.train_step(x, y)
    counted = rt.mesh.counters()
    whole = make(kind, tied)
    if clip:  # (a tied weight counted once)
        clip = sum(q.data.size for _, q in whole.named_parameters())
    sparse = sorted(sparse_param_names(whole))
    j = rank % T
    if T == 1:
        mine = touched_rows(whole, sparse, x)
    else:  # (the rows of this tp rank's slice of a vocabulary-parallel embedding)
        mine = tensor.cut(lambda: make(kind, tied), T, j, x, y, loss_of(kind), tables).rows
    everyone = MPI.COMM_WORLD.allgather((j, i, mine))
    d = p // (P * T)
    rows = {t: {n: [next(r[n] for tt, ii, r in everyone if ii == k and tt == t)
                    for k in range(d)] for n in mine} for t in range(T)}
    plan = pipeline.plan_of(P, schedule, M)
    pieces = (lambda bounds: tensor.pieces_of(lambda: make(kind, tied), T, (x[:B], y[:B]),
                                              loss_of(kind), tables, bounds)[0]) \
        if T > 1 else None
    step = pipeline.layout(whole, p, plan, [1.0] * len(whole.layers), x[:B], algorithm,
                           bucket_mb, () if zero else sparse if T == 1 else sorted(mine),
                           rows, tables=tables, pieces=pieces, zero=zero,
                           recompute=recompute, tied_per_step=per_step, sync_bn=sync_bn,
                           wire=None if precision is None else wire_dtype(precision),
                           clip=clip)
    assert step.bounds == rt.pp.bounds, (step.bounds, rt.pp.bounds)
    predicted = pipeline.traffic(step, per_node, ranks=[rank])[rank]["groups"]
    same_groups(predicted, {g: counted[g] for g in predicted},
                f"rank {rank} of {p}, {kind} {how} {algorithm} bucket {bucket_mb}")
    rt.finish()  # (async: the backwards it carries drained; no send left in flight)
    rt.mesh.close()
    comm.close()
    totals = MPI.COMM_WORLD.gather(sum(counted[g]["total"]["bytes"] for g in predicted),
                                   root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how} {algorithm} bucket {bucket_mb} MiB: "
              f"{len(step.messages[0])} stage messages, bytes per rank {totals}", flush=True)


def check_hybrid(kind, algorithm, bucket_mb, overlap, how, per_node):
    """``hybrid`` (``--hybrid conv-dp-fc-mp``; ``hybrid+syncbn`` with ``--sync-bn``): the
    group's counters over a step must equal ``mpidl.simulate.hybrid``'s layout for this
    rank (every rank trains on as many rows)."""
    from mpidl.simulate import hybrid

    core, clip = clip_of(how, kind)
    sync_bn = core.endswith("+syncbn")
    tables = gathers_by(algorithm)
    comm = Communicator(MPI.COMM_WORLD, _tables=tables)
    p, rank = comm.size, comm.rank
    model = make(kind)
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    rt = build("allreduce", comm, algorithm=algorithm, bucket_mb=bucket_mb, overlap=overlap,
               hybrid="conv-dp-fc-mp", sync_bn=sync_bn,
               clip_grad_norm=1.0 if clip else None)
    rt.setup(model, opt, loss_of(kind))
    rt.train_step(*batch(kind, 0, rank))
    rt.group.reset_counters()
    x, y = batch(kind, 1, rank)
    rt.train_step(x, y)
    counted = rt.group.counters()
    step = hybrid.layout(lambda: make(kind), p, x, y, loss_of(kind), algorithm, bucket_mb,
                         sync_bn=sync_bn, tables=tables, rank=rank, clip=clip)
    predicted = hybrid.traffic(step, per_node, ranks=[rank])[rank]
    if predicted != counted:
        diff = {k: (predicted[k], counted[k]) for k in counted if predicted.get(k) != counted[k]}
        raise AssertionError(f"rank {rank} of {p}, {kind} {how} {algorithm} bucket "
                             f"{bucket_mb} overlap {overlap}: predicted != counted {diff}; "
                             f"calls {[(c.kind, c.name, c.algorithm, c.size) for c in step.fc_calls]}")
    comm.close()
    totals = MPI.COMM_WORLD.gather(counted["total"]["bytes"], root=0)
    if rank == 0:
        print(f"exact p={p} {kind} {how} {algorithm} bucket {bucket_mb} MiB: "
              f"{len(step.fc_calls)} boundary/FC calls per micro-batch, {counted['total']['calls']} "
              f"calls, bytes per rank {totals}", flush=True)


def loss_of(kind):
    return TokenCrossEntropy() if kind == "gpt" else SoftmaxCrossEntropy()


def main():
    algs = sys.argv[1].split(",")
    buckets = [float(b) for b in sys.argv[2].split(",")]
    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["mlp", "gpt"]
    hows = sys.argv[4].split(",") if len(sys.argv) > 4 else ["dp"]
    p, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    per = os.environ.get("MPIDL_RANKS_PER_NODE")
    per_node = int(per) if per else p
    i = 0
    for how in hows:
        for kind in kinds:
            if how.startswith("hogwild"):
                check_hogwild(kind, how)
                i += 1
                continue
            if how.startswith(("ps-", "psc-")):  # (no algorithm or bucket: point to point)
                check_ps(kind, how)
                i += 1
                continue
            if how.startswith("groups"):
                for alg in algs:
                    for mb in buckets:
                        check_groups(kind, alg, mb, ("on", "off")[i % 2], how, per_node)
                        i += 1
                continue
            if how.startswith("parallax-"):
                for alg in algs:
                    for mb in buckets:
                        check_parallax(kind, alg, mb, ("on", "off")[i % 2], how)
                        i += 1
                continue
            if how.startswith("hybrid"):
                for alg in algs:
                    for mb in buckets:
                        check_hybrid(kind, alg, mb, ("on", "off")[i % 2], how, per_node)
                        i += 1
                continue
            if how.startswith(("tp", "pp")):
                for alg in algs:
                    for mb in buckets:
                        if how.startswith("pp"):
                            check_pp(kind, alg, mb, how, per_node)
                        else:
                            check_tp(kind, alg, mb, ("on", "off")[i % 2], how, per_node)
                        i += 1
                continue
            if how in ("bf16", "fp16", "c-fp16") and kind == "gpt":
                continue  # (its Embedding's rows, gathered as float32: refused)
            for alg in algs:
                for mb in buckets:
                    check(kind, alg, mb, ("on", "off")[i % 2], per_node, how)
                    i += 1
    if rank == 0:
        print(f"simulate_check: {i} cases exact on {p} ranks", flush=True)


if __name__ == "__main__":
    main()

"""One training step, replayed symbolically: its collectives, per rank, and its time.

The layout is the real one, computed by the functions the runtime itself uses:

- the dense gradients' fused buckets: ``mpidl.runtime.fusion.plan`` over the parameters
  the fused all-reduce owns (every parameter, less the row-sparse ones when
  ``--sparse-grads allgather``), ``bucket_mb`` MiB each, one all-reduce per bucket in
  bucket order; under ``--precision bf16|fp16`` the buckets hold 2-byte words (float16,
  bfloat16) and are planned by those bytes;
- the row-sparse (Embedding) gradients: per parameter, in parameter order, two
  ``allgatherv`` calls (the coalesced row indices as int64, then the rows' values), whose
  sizes are the rows each rank touched (data: given, or estimated from the dataset);
- ZeRO (``--zero 1|2|3``, ``mpidl.runtime.zero``): per bucket a reduce-scatter (an
  all-reduce where the algorithm's reduce-scatter would sum in another order than its
  all-reduce: ``zero.exact_reduce_scatter``) and an all-gather of the updated shards
  (stages 1-2), or of the parameters before every forward and backward (stage 3);
- compression (``--compression``): the collectives of each tensor's (or bucket's)
  compressed exchange, found by running the compressor (``compression``);
- model averaging (``--sync local-sgd|diloco --period H``, after its warm-up): no
  gradient sync; one all-reduce of the parameters per period in the fused buckets'
  layout (the layout is then of H steps);
- the algorithm of each call as the communicator resolves it: the one asked for, or
  ``auto``'s choice by size (``mpidl.comm.auto.Selector`` over the same tuning tables:
  the row gathers always ask ``auto``; ZeRO's calls take the all-reduce table's choice
  for the bucket, as stage 0 would); MPI's own reduction is never used for float16
  or bfloat16 words (``ops.own_reduction``: the ring instead).

``traffic`` then counts, per rank, what ``Communicator.counters()`` counts for the step
(calls, messages, bytes and MPI calls per kind, exactly; see ``collectives``), and
``step_time`` predicts the time: forward, backward (per layer, so that overlapped
buckets start when their last gradient is ready), the collectives one after another on
the progress thread (overlap) or after backward (no overlap), the row gathers, the
optimizer update (a 1/p share of it under ZeRO) and what runs with it.
"""

from dataclasses import dataclass, field

import numpy as np

from mpidl import env
from mpidl.comm import auto
from mpidl.comm.counters import FIELDS, KINDS
from mpidl.comm.layout import even_split
from mpidl.comm.ops import own_reduction
from mpidl.runtime.fusion import MiB, plan

from . import collectives as col


@dataclass
class Call:
    """One collective of the step: ``size`` is the all-reduce's or reduce-scatter's
    element count, or the all-gather's counts per rank. ``phase``: where the step runs
    it (``PHASES``)."""

    kind: str
    name: str
    algorithm: str
    size: object
    itemsize: int
    dtype: str
    params: tuple = ()
    phase: str = "backward"
    local_s: float = 0.0  # a compressor's own seconds around the call (compression.py)

    def nbytes(self):
        n = self.size if self.kind in ("allreduce", "reduce_scatter", "bcast") \
            else sum(self.size)
        return n * self.itemsize


#: where a call runs: ``backward`` (a gradient bucket, launched as its last gradient is
#: ready when overlapping), ``after`` (once backward is done: the row gathers, ZeRO
#: stage 2-3's buckets), ``update`` (with the optimizer update: ZeRO's all-gather of the
#: updated shards, model averaging), ``forward-gather`` / ``backward-gather`` (ZeRO stage
#: 3's parameter gathers before each layer, prefetched), ``forward-bn`` /
#: ``backward-bn`` (``--sync-bn``'s blocking all-reduces inside the passes)
PHASES = ("backward", "after", "update", "forward-gather", "backward-gather", "forward-bn",
          "backward-bn")


@dataclass
class StepLayout:
    """The collectives of ``every`` steps (1; model averaging: a period of H steps, one
    averaging) and what shapes their time: ``overlap`` (False: the buckets never overlap
    backward: ZeRO stage 2-3), ``update_share`` (the fraction of the optimizer update a
    rank computes: 1/p under ZeRO)."""

    p: int
    calls: list = field(default_factory=list)
    buckets: int = 0
    dense_bytes: int = 0
    sparse: tuple = ()
    every: int = 1
    overlap: bool = True
    update_share: float = 1.0
    what: str = "data parallelism"
    servers: int = 0  # (ranks that do not train: none here; ``server.ServerStep`` has some)
    # gamma (s/byte, ``calibrate.measure_gamma``) of the process that timed the calls'
    # ``local_s``, alone: ``step_time`` prices that work at the machine's gamma instead
    local_gamma: float = 0.0


def clip_calls(count):
    """``--clip-grad-norm``'s MPI all-reduces on a group whose ranks hold parts of the
    gradient (``runtime.clip.GradClip``; ``count`` elements in all): the largest square,
    then the folds' float64 sums. (A step whose gradient is all zero or not finite makes
    the first only.)"""
    from mpidl.runtime.clip import folds_for  # noqa: PLC0415

    folds, _ = folds_for(count)
    return [Call("allreduce", "clip.max", "mpi", 1, 8, "float64", (), phase="update"),
            Call("allreduce", "clip.sum", "mpi", folds, 8, "float64", (), phase="update")]


def add_blocking(t, calls, links, seg_bytes):
    """Add to step time ``t`` (``step_time``'s keys) the calls made once a step outside
    the passes, each waited for (clipping's norm on a tensor-parallel or hybrid group)."""
    seconds = sum(call_time(c, links, seg_bytes) for c in calls)
    for key in ("comm", "exposed_comm", "total"):
        t[key] += seconds
    return t


def segment_bytes():
    """The ring's segment in bytes, as the communicator reads it."""
    return max(env.number("MPIDL_RING_SEGMENT", int), 64)


def resolve(selector, kind, algorithm, nbytes, dtype):
    """The algorithm the communicator runs (``Communicator._resolve``)."""
    alg = selector.choose(kind, nbytes) if algorithm == "auto" else algorithm
    if alg == "mpi" and kind in ("allreduce", "reduce_scatter") \
            and own_reduction(np.dtype(dtype)):
        alg = "ring"
    return alg


def _dtype_name(dtype):
    from mpidl import bfloat16  # noqa: PLC0415

    return "bfloat16" if dtype == bfloat16.BFLOAT16 else str(dtype)


def layout(named_params, p, algorithm="auto", bucket_mb=4.0, sparse_names=(), rows=None,
           tables=None, zero=0, micro=1, wire=None, period=None, compression=None,
           sync_bn=(), alone=False, zero_keep=(), zero_recompute=False, part_of=None,
           bn_forwards=1, clip=0):
    """The collectives of one step on ``p`` ranks (module doc). ``rows``: for each
    row-sparse parameter name, the rows every rank sends (a list of ``p`` counts).
    ``zero``: the ZeRO stage (``mpidl.runtime.zero``), ``micro`` the micro-batches of a
    step (stage 3 gathers every bucket once per forward and once per backward of each;
    ``zero_keep``: with ``--zero-reuse on``, ``zero.boundary_params``, the names of the
    parameters whose buckets are gathered once per forward only; ``zero_recompute``: a
    pipeline's ``--recompute``, a third gather for the forward backward runs again);
    ``wire``: mixed precision's bucket dtype (float16, or bfloat16 words: 2 bytes);
    ``period``: model averaging every H steps (``--sync local-sgd|diloco`` after its
    warm-up): the layout is then of one period, its one averaging. ``compression``:
    ``compression.layout``'s settings (spec, ratio, grads, frames, overlap) for
    ``--compression``. ``sync_bn``: ``sync_bn_layers(model)`` for ``--sync-bn`` (each
    BatchNorm's all-reduces in every forward and backward of a micro-batch;
    ``bn_forwards``: 2 under a pipeline's ``--recompute``). ``alone``:
    on one rank the calls are still made (a mesh's data-parallel group of one: they count
    as calls, moving nothing); otherwise one process makes none. ``part_of``: the
    buckets' parts (``fusion.plan``: a pipeline's chunks). ``clip``: under
    ``--clip-grad-norm`` the elements its norm counts (the whole model's), which this
    group sums under ZeRO (``clip_calls``; replicas that hold the whole reduced gradient
    compute it without a message)."""
    named_params = list(named_params)
    sparse_names = set(sparse_names)
    selector = auto.Selector(p, auto.load() if tables is None else tables)
    out = StepLayout(p)
    if p == 1 and not alone:
        return out
    # (every step of a period)
    _sync_bn(out, sync_bn, selector, micro * (period or 1), bn_forwards)
    if period:
        return _averaging(out, named_params, selector, algorithm, bucket_mb, period)
    if compression:
        from .compression import layout as compressed  # noqa: PLC0415

        return compressed(out, named_params, selector=selector, algorithm=algorithm,
                          bucket_mb=bucket_mb, **compression)
    dense = [(n, q) for n, q in named_params if n not in sparse_names]
    itemsize = None if wire is None else np.dtype(wire).itemsize
    for index, group in enumerate(plan(dense, int(bucket_mb * MiB), itemsize, part_of)):
        data = group[0][1].data
        n = sum(q.data.size for _, q in group)
        dtype = data.dtype if wire is None else np.dtype(wire)
        size = dtype.itemsize
        names = tuple(name for name, _ in group)
        if zero:
            kept = any(name in zero_keep for name, _ in group)
            _zero_bucket(out, index, names, n, dtype, selector, algorithm, zero, micro, kept,
                         zero_recompute)
        else:
            alg = resolve(selector, "allreduce", algorithm, n * size, dtype)
            out.calls.append(Call("allreduce", f"bucket{index}", alg, n, size,
                                  _dtype_name(dtype), names))
        out.dense_bytes += n * size
        out.buckets += 1
    if zero:
        out.overlap = zero == 1
        out.update_share = 1.0 / p
        out.what = f"ZeRO stage {zero}"
        agree = []  # (before any update: the clipping coefficient, then fp16's skip)
        if clip and p > 1:  # each rank holds chunks: the group sums the norm's parts
            agree += clip_calls(clip)
        if wire is not None and np.dtype(wire) == np.float16 and p > 1:
            # fp16: each rank checks its own chunks for an overflow, so the ranks agree
            # (MPI's all-reduce of one int32) before any update
            agree.append(Call("allreduce", "precision.overflow", "mpi", 1, 4, "int32", (),
                              phase="update"))
        first = next((i for i, c in enumerate(out.calls) if c.phase == "update"),
                     len(out.calls))
        out.calls[first:first] = agree
    sparse = [(n, q) for n, q in named_params if n in sparse_names]
    out.sparse = tuple(n for n, _ in sparse)
    for name, q in sparse:
        counts = list((rows or {}).get(name) or [])
        if len(counts) != p:
            raise ValueError(f"row-sparse parameter {name}: give the rows of each of the "
                             f"{p} ranks, got {counts}")
        width = int(np.prod(q.data.shape[1:], dtype=np.int64))
        for what, itemsize, per_row, dtype in (("indices", 8, 1, "int64"),
                                               ("values", q.data.itemsize, width,
                                                str(q.data.dtype))):
            sizes = [c * per_row for c in counts]
            alg = resolve(selector, "allgatherv", "auto", sum(sizes) * itemsize // p, dtype)
            out.calls.append(Call("allgatherv", f"{name} {what}", alg, sizes, itemsize,
                                  dtype, (name,), phase="after"))
    return out


def _zero_bucket(out, index, names, n, dtype, selector, algorithm, stage, micro, kept=False,
                 recompute=False):
    """ZeRO's calls for one bucket (``mpidl.runtime.zero``): the gradient reduce-scattered
    (all-reduced where the algorithm's reduce-scatter would sum in another order), the
    shards all-gathered after their update (stages 1-2) or before every forward and
    backward (stage 3; ``kept`` from forward into backward: before every forward;
    ``recompute``: also before the forward a pipeline's backward runs again)."""
    from mpidl.runtime.zero import exact_reduce_scatter  # noqa: PLC0415

    p, size = out.p, dtype.itemsize
    chosen = algorithm if algorithm != "auto" else selector.choose("allreduce", n * size)
    kind = "reduce_scatter" if exact_reduce_scatter(chosen, p) else "allreduce"
    alg = resolve(selector, kind, chosen, n * size, dtype)
    name = f"bucket{index}"
    out.calls.append(Call(kind, name, alg, n, size, _dtype_name(dtype), names,
                          phase="backward" if stage == 1 else "after"))
    counts = tuple(even_split(n, p)[0])
    # (the gather copies words, which MPI's own collective can: the bucket's algorithm
    # as chosen, where a 2-byte format's reduction goes to the ring instead)
    gather = Call("allgather", f"{name}.params", chosen, counts, size, _dtype_name(dtype),
                  names)
    if stage < 3:
        gather.phase = "update"
        out.calls.append(gather)
        return
    phases = ("forward-gather",) if kept else ("forward-gather", "backward-gather")
    if recompute:
        phases += ("backward-gather",)
    for phase in phases:
        for _ in range(micro):
            out.calls.append(Call(**{**gather.__dict__, "phase": phase}))


def sync_bn_layers(model):
    """``(name, channels, dtype, needs_input_grad)`` of every BatchNorm, in forward order;
    ``needs_input_grad`` as ``Sequential.forward`` sets it (the runtime starts the model
    without an input gradient: only layers after a parameter compute one)."""
    from mpidl.engine.module import Sequential  # noqa: PLC0415
    from mpidl.engine.normalization import BatchNorm1d, BatchNorm2d  # noqa: PLC0415

    out = []

    def walk(layer, prefix, needs):
        if isinstance(layer, (BatchNorm1d, BatchNorm2d)):
            out.append((prefix.rstrip("."), layer.num_features, layer.dtype, needs))
        children = layer.children()
        inner = needs
        for key, child in children:
            walk(child, f"{prefix}{key}.", inner if isinstance(layer, Sequential) else True)
            if isinstance(layer, Sequential):
                inner = inner or child.has_params()

    walk(model, "", False)
    return out


def _sync_bn(out, layers, selector, micro, forwards=1):
    """``--sync-bn``: per BatchNorm and micro-batch, forward sums the channels' values
    and the count (C + 1 words), then the squared deviations (C); backward, when the
    layer computes an input gradient, the two gradient sums (2 C); each a blocking
    all-reduce that ``auto`` resolves by size (``engine.normalization``). ``forwards``:
    forward passes per micro-batch (2: a pipeline's ``--recompute`` runs it again)."""
    passes = [("forward-bn", lambda c, needs: (c + 1, c))] * forwards + [
        ("backward-bn", lambda c, needs: (2 * c,) if needs else ())]
    for _ in range(micro):
        for phase, sizes in passes:
            order = layers if phase == "forward-bn" else list(reversed(layers))
            for name, c, dtype, needs in order:
                dtype = np.dtype(dtype)
                for n in sizes(c, needs):
                    alg = resolve(selector, "allreduce", "auto", n * dtype.itemsize, dtype)
                    out.calls.append(Call("allreduce", f"{name} statistics", alg, n,
                                          dtype.itemsize, str(dtype), (name,), phase=phase))


def _averaging(out, named_params, selector, algorithm, bucket_mb, period):
    """Model averaging (``mpidl.runtime.averaging``): one all-reduce of the parameters per
    period, in the fused buckets' layout over every parameter, after the update."""
    for index, group in enumerate(plan(named_params, int(bucket_mb * MiB))):
        data = group[0][1].data
        n = sum(q.data.size for _, q in group)
        alg = resolve(selector, "allreduce", algorithm, n * data.itemsize, data.dtype)
        out.calls.append(Call("allreduce", f"average{index}", alg, n, data.itemsize,
                              str(data.dtype), tuple(name for name, _ in group),
                              phase="update"))
        out.dense_bytes += n * data.itemsize
    out.every = int(period)
    out.overlap = False
    out.what = f"model averaging every {period} steps"
    return out


def _empty_table():
    return {kind: [0, 0, 0, 0] for kind in KINDS}


def traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {calls, messages, bytes, native_calls}, "total": ...}}``: what the
    communicator's counters show on each rank after the step (``ranks``: which ranks,
    default all)."""
    p = step.p
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    topo = col.Topology(p, per_node)
    return {r: calls_traffic(step.calls, r, topo, seg_bytes)
            for r in (range(p) if ranks is None else ranks)}


def calls_traffic(calls, rank, topo, seg_bytes):
    """``{kind: {calls, messages, bytes, native_calls}, "total": ...}``: what rank
    ``rank`` of a group on ``topo`` counts for ``calls``."""
    table = _empty_table()
    for c in calls:
        row = table[c.kind]
        row[0] += 1
        if c.nbytes() == 0 or topo.p == 1:  # (a group of one sends nothing, asks MPI nothing)
            continue
        if c.algorithm == "mpi":
            row[3] += 1
            continue
        m, b = col.count(c.kind, c.algorithm, rank, topo, c.size, c.itemsize, seg_bytes)
        row[1] += m
        row[2] += b
    summary = {kind: dict(zip(FIELDS, v)) for kind, v in table.items()}
    summary["total"] = {f: sum(summary[k][f] for k in KINDS) for f in FIELDS}
    return summary


def call_time(c, links, seg_bytes):
    if c.kind == "bcast":
        return col.time_bcast(c.algorithm, links, c.size, c.itemsize, seg_bytes)
    if c.kind == "allreduce":
        return col.time_allreduce(c.algorithm, links, c.size, c.itemsize, seg_bytes)
    if c.kind == "reduce_scatter":
        return col.time_reduce_scatter(c.algorithm, links, c.size, c.itemsize, seg_bytes)
    return col.time_allgatherv(c.algorithm, links, c.size, c.itemsize, seg_bytes)


# ------------------------------------------------------------------ compute
@dataclass
class Compute:
    """Seconds per sample of each top-level layer: ``layers[key] = (forward, backward)``
    in model order, and the optimizer update per step. ``cv``: the spread of a rank's
    forward + backward from step to step (standard deviation over mean); ``on_cores``:
    the compute runs on the CPU cores (measured on a CPU), so an overlapping progress
    thread needs a spare one; a given pace (a GPU, emulated compute) leaves them free."""

    layers: dict
    update_s: float = 0.0
    source: str = ""
    cv: float = 0.0
    on_cores: bool = False

    def forward(self, samples):
        return samples * sum(f for f, _ in self.layers.values())

    def backward(self, samples):
        return samples * sum(b for _, b in self.layers.values())


def top_layer(name):
    return name.split(".", 1)[0]


def compute_from_pace(model, seconds_per_sample, update_s=0.0):
    """``seconds_per_sample`` of forward + backward spread over the top-level layers in
    proportion to their parameters (a third forward, two thirds backward): a stand-in
    where nothing was measured."""
    weights = {}
    for key, layer in model.children():
        weights[key] = sum(q.data.size for _, q in layer.named_parameters())
    total = sum(weights.values()) or 1
    layers = {k: (seconds_per_sample * w / total / 3, 2 * seconds_per_sample * w / total / 3)
              for k, w in weights.items()}
    return Compute(layers, update_s, f"{seconds_per_sample:g} s/sample by parameter count")


def slowest_of(p):
    """The expected largest of ``p`` standard normal draws (Blom's approximation)."""
    from statistics import NormalDist  # noqa: PLC0415

    return 0.0 if p <= 1 else NormalDist().inv_cdf((p - 0.375) / (p + 0.25))


def step_time(step, compute, batch, accumulate, links, overlap, seg_bytes=None,
              in_pass=(0.0, 0.0)):
    """Predicted seconds of one step: {forward, backward, comm, exposed_comm, update,
    skew, total} (module doc). Overlap hides communication only where the progress
    thread has a core (``Compute.on_cores``, ``Machine.spare_core``); the step waits for
    the slowest rank's compute (``Compute.cv``). A layout of ``every`` steps (model
    averaging) is spread over them: its calls' time divided by ``every``. ZeRO stage 3's
    gathers run on the progress thread ahead of the pass that needs them: a pass takes
    the longer of its compute and its gathers when overlapping, their sum when not.
    ``in_pass``: seconds another group's blocking calls add to each micro-batch's forward
    and backward (tensor parallelism's all-reduces, ``tensor.step_time``)."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    machine, topo = links.m, links.topo
    overlap = overlap and (not compute.on_cores
                           or machine.spare_core(min(topo.per_node, topo.p)))
    micro = batch
    fwd0, bwd0 = compute.forward(micro), compute.backward(micro)
    times = [call_time(c, links, seg_bytes) / step.every for c in step.calls]
    by = {phase: [(c, t) for c, t in zip(step.calls, times) if c.phase == phase]
          for phase in PHASES}

    def passes(seconds, phase):  # ``accumulate`` passes, each with its gathers
        gathers = sum(t for _, t in by[phase]) / max(accumulate, 1)
        one = max(seconds, gathers) if overlap else seconds + gathers
        return accumulate * one if gathers else accumulate * seconds

    extra = in_pass
    in_pass = {phase: sum(t for _, t in by[phase]) / max(accumulate, 1)
               for phase in ("forward-bn", "backward-bn")}
    fwd = fwd0 + in_pass["forward-bn"] + extra[0]  # (blocking calls inside the passes)
    bwd = bwd0 + in_pass["backward-bn"] + extra[1]
    before = passes(fwd, "forward-gather") + passes(bwd, "backward-gather") - bwd
    buckets = by["backward"]
    if overlap and step.overlap and buckets:
        ready = {}
        t = before
        for key in reversed(list(compute.layers)):  # backward, last layer first
            t += micro * compute.layers[key][1]
            ready[key] = t
        end_bwd = before + bwd
        done = 0.0
        for c, tc in buckets:
            when = max((ready.get(top_layer(n), end_bwd) for n in c.params), default=end_bwd)
            done = max(done, when) + tc
        after_bwd = max(done, end_bwd)
    else:
        after_bwd = before + bwd + sum(t for _, t in buckets)
    skew = compute.cv * accumulate * (fwd0 + bwd0) * slowest_of(step.p)
    update = compute.update_s * step.update_share
    local = sum(c.local_s for c in step.calls) / step.every * local_scale(step, machine)
    total = (after_bwd + local + sum(t for _, t in by["after"]) + update
             + sum(t for _, t in by["update"]) + skew)
    compute_s = accumulate * (fwd0 + bwd0) + update + local
    return {"forward": accumulate * fwd0, "backward": accumulate * bwd0, "comm": sum(times),
            "exposed_comm": total - compute_s - skew, "update": update,
            "compression": local, "skew": skew, "total": total}


def local_scale(step, machine):
    """What the compressors' own work (``Call.local_s``, timed in this process, alone)
    takes on the machine's ranks: the machine's gamma over this process's. It is
    elementwise, memory-bound work like the reduction gamma prices, and a calibration
    measures gamma on every rank at once, sharing the node's cores and memory as a run
    does (and a described cluster gives its nodes' own); 1 where either is unknown."""
    if step.local_gamma > 0 and machine.gamma > 0:
        return machine.gamma / step.local_gamma
    return 1.0


def efficiency(t_one, t_p):
    """Weak-scaling efficiency: a rank's throughput on p ranks over one process's."""
    return t_one / t_p if t_p > 0 else 1.0


def parse_ranks(text):
    """``--ranks``: ``P``, ``A-B`` (powers of two from A to B, and B), or a comma list."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if a < 1 or b < a:
                    raise ValueError
                k = a
                while k < b:
                    out.append(k)
                    k = 1 << k.bit_length() if k & (k - 1) else 2 * k
                out.append(b)
            else:
                out.append(int(part))
        except ValueError:
            out = None
            break
        if out[-1] < 1:
            out = None
            break
    if not out:
        raise ValueError(f"--ranks {text!r}: expected a rank count >= 1, a range A-B "
                         "(1-4096: the powers of two between) or a list 2,3,4")
    return sorted(set(out))


def touched_rows(model, sparse_names, x):
    """For each row-sparse parameter, the rows a rank sends for batch ``x``: one forward
    and backward (any output gradient: which rows get one depends on the input only), the
    gradient coalesced by ``rowsparse.as_rows`` as the row gather does. Leaves the
    model's gradients cleared."""
    from mpidl.runtime.sync.rowsparse import as_rows  # noqa: PLC0415

    sparse_names = set(sparse_names)
    if not sparse_names:
        return {}
    model.zero_grad()
    out = model(x)
    model.backward(np.ones_like(out) / max(out.size, 1))
    rows = {name: int(as_rows(q).indices.size) for name, q in model.named_parameters()
            if name in sparse_names}
    model.zero_grad()
    return rows

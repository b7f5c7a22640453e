"""One data-parallel step, replayed symbolically: its collectives, per rank, and its time.

The layout is the real one, computed by the functions the runtime itself uses:

- the dense gradients' fused buckets: ``mpidl.runtime.fusion.plan`` over the parameters
  the fused all-reduce owns (every parameter, less the row-sparse ones when
  ``--sparse-grads allgather``), ``bucket_mb`` MiB each, one all-reduce per bucket in
  bucket order;
- the row-sparse (Embedding) gradients: per parameter, in parameter order, two
  ``allgatherv`` calls (the coalesced row indices as int64, then the rows' values), whose
  sizes are the rows each rank touched (data: given, or estimated from the dataset);
- the algorithm of each call as the communicator resolves it: the one asked for, or
  ``auto``'s choice by size (``mpidl.comm.auto.Selector`` over the same tuning tables:
  the row gathers always ask ``auto``); MPI's own reduction is never used for float16
  or bfloat16 words (``ops.own_reduction``: the ring instead).

``traffic`` then counts, per rank, what ``Communicator.counters()`` counts for the step
(calls, messages, bytes and MPI calls per kind, exactly; see ``collectives``), and
``step_time`` predicts the time: forward, backward (per layer, so that overlapped
buckets start when their last gradient is ready), the collectives one after another on
the progress thread (overlap) or after backward (no overlap), the row gathers, the
optimizer update.
"""

from dataclasses import dataclass, field

import numpy as np

from mpidl import env
from mpidl.comm import auto
from mpidl.comm.counters import FIELDS, KINDS
from mpidl.comm.ops import own_reduction
from mpidl.runtime.fusion import MiB, plan

from . import collectives as col


@dataclass
class Call:
    """One collective of the step: ``size`` is the all-reduce's element count, or the
    all-gather's counts per rank."""

    kind: str
    name: str
    algorithm: str
    size: object
    itemsize: int
    dtype: str
    params: tuple = ()

    def nbytes(self):
        n = self.size if self.kind == "allreduce" else sum(self.size)
        return n * self.itemsize


@dataclass
class StepLayout:
    p: int
    calls: list = field(default_factory=list)
    buckets: int = 0
    dense_bytes: int = 0
    sparse: tuple = ()


def segment_bytes():
    """The ring's segment in bytes, as the communicator reads it."""
    return max(env.number("MPIDL_RING_SEGMENT", int), 64)


def resolve(selector, kind, algorithm, nbytes, dtype):
    """The algorithm the communicator runs (``Communicator._resolve``)."""
    alg = selector.choose(kind, nbytes) if algorithm == "auto" else algorithm
    if alg == "mpi" and kind == "allreduce" and own_reduction(np.dtype(dtype)):
        alg = "ring"
    return alg


def layout(named_params, p, algorithm="auto", bucket_mb=4.0, sparse_names=(), rows=None,
           tables=None):
    """The collectives of one step on ``p`` ranks (module doc). ``rows``: for each
    row-sparse parameter name, the rows every rank sends (a list of ``p`` counts)."""
    named_params = list(named_params)
    sparse_names = set(sparse_names)
    selector = auto.Selector(p, auto.load() if tables is None else tables)
    out = StepLayout(p)
    if p == 1:
        return out
    dense = [(n, q) for n, q in named_params if n not in sparse_names]
    for index, group in enumerate(plan(dense, int(bucket_mb * MiB))):
        data = group[0][1].data
        n = sum(q.data.size for _, q in group)
        alg = resolve(selector, "allreduce", algorithm, n * data.itemsize, data.dtype)
        out.calls.append(Call("allreduce", f"bucket{index}", alg, n, data.itemsize,
                              str(data.dtype), tuple(name for name, _ in group)))
        out.dense_bytes += n * data.itemsize
    out.buckets = len(out.calls)
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
                                  dtype, (name,)))
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
    out = {}
    for r in (range(p) if ranks is None else ranks):
        table = _empty_table()
        for c in step.calls:
            row = table[c.kind]
            row[0] += 1
            if c.nbytes() == 0:
                continue
            if c.algorithm == "mpi":
                row[3] += 1
                continue
            m, b = col.count(c.kind, c.algorithm, r, topo, c.size, c.itemsize, seg_bytes)
            row[1] += m
            row[2] += b
        summary = {kind: dict(zip(FIELDS, v)) for kind, v in table.items()}
        summary["total"] = {f: sum(summary[k][f] for k in KINDS) for f in FIELDS}
        out[r] = summary
    return out


def call_time(c, links, seg_bytes):
    if c.kind == "allreduce":
        return col.time_allreduce(c.algorithm, links, c.size, c.itemsize, seg_bytes)
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


def step_time(step, compute, batch, accumulate, links, overlap, seg_bytes=None):
    """Predicted seconds of one step: {forward, backward, comm, exposed_comm, update,
    skew, total} (module doc). Overlap hides communication only where the progress
    thread has a core (``Compute.on_cores``, ``Machine.spare_core``); the step waits for
    the slowest rank's compute (``Compute.cv``)."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    machine, topo = links.m, links.topo
    overlap = overlap and (not compute.on_cores
                           or machine.spare_core(min(topo.per_node, topo.p)))
    micro = batch
    fwd = compute.forward(micro)
    bwd = compute.backward(micro)
    before = (accumulate - 1) * (fwd + bwd) + fwd  # the hooks run in the last backward
    times = [call_time(c, links, seg_bytes) for c in step.calls]
    buckets = step.calls[:step.buckets]
    comm = sum(times)
    if overlap and buckets:
        ready = {}
        t = before
        for key in reversed(list(compute.layers)):  # backward, last layer first
            t += micro * compute.layers[key][1]
            ready[key] = t
        end_bwd = before + bwd
        done = 0.0
        for c, tc in zip(buckets, times):
            when = max((ready.get(top_layer(n), end_bwd) for n in c.params), default=end_bwd)
            done = max(done, when) + tc
        after_bwd = max(done, end_bwd)
    else:
        after_bwd = before + bwd + sum(times[:step.buckets])
    skew = compute.cv * accumulate * (fwd + bwd) * slowest_of(step.p)
    total = after_bwd + sum(times[step.buckets:]) + compute.update_s + skew
    compute_s = accumulate * (fwd + bwd) + compute.update_s
    return {"forward": accumulate * fwd, "backward": accumulate * bwd, "comm": comm,
            "exposed_comm": total - compute_s - skew, "update": compute.update_s,
            "skew": skew, "total": total}


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

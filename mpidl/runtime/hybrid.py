"""Krizhevsky's "one weird trick" (2014), ``--hybrid conv-dp-fc-mp``: the convolutions
data parallel over all ranks, the fully connected block tensor parallel over the same
ranks.

Why: convolutions have few parameters and much compute per sample, fully connected
layers the reverse. Data parallelism all-reduces every gradient each step, so a wide FC
block dominates its traffic; splitting that block instead moves activations, whose size
grows with the batch, not with the width. Past some width the hybrid moves fewer bytes.

A step on ``p`` ranks, each with its own piece of the global batch (``n_r`` samples,
``B = sum n_r``):

* the convolutions run on the rank's piece, as in data parallelism;
* at the boundary (the top-level ``Sequential``'s first ``Linear``, whose input is the
  flattened activations, ``F`` wide) the activations are all-gathered in rank order, so
  every rank holds all ``B`` rows; the labels are all-gathered alike;
* the FC block is cut by ``TensorParallel``'s walk over the world group: the first
  ``Linear`` is column-parallel (it keeps a slice of the output columns) and the rest
  pair as in tensor parallelism. Every rank runs its slices on all ``B`` rows, and the
  loss is the mean over the global batch, on every rank;
* backward: the first FC layer's input gradient is partial (each rank's columns'
  contribution, ``B x F``); instead of the all-reduce a column-parallel layer does, one
  reduce-scatter by samples sums the partials and hands each rank its own ``n_r`` rows;
* the FC parameters are not averaged by data parallelism (they are slices, and each
  already saw the whole batch); the convolutions' gradients are **summed** over the
  ranks, not averaged: each rank's is its samples' share of the gradient of the global
  mean, so the sum is the one-process gradient, for even and uneven pieces alike.

So the run equals one process at the global batch (with ``--sync-bn`` when the
convolutions have BatchNorm, as for data parallelism), within rounding.

``Hybrid.bytes_per_step`` is the traffic per rank and step from a formula (ring
algorithms: what ``--algorithm ring`` makes the communicator's counters count, exactly),
and ``dp_bytes_per_step`` plain data parallelism's for the same model; the trainer logs
both before training.
"""

import math
from types import SimpleNamespace

from mpidl.comm.layout import even_split
from mpidl.engine._util import as_input
from mpidl.engine.attention import CausalAttention
from mpidl.engine.conv import Conv2d
from mpidl.engine.dropout import Dropout
from mpidl.engine.embedding import Embedding
from mpidl.engine.linear import Linear
from mpidl.engine.losses import Loss
from mpidl.engine.module import Sequential, ShapeError
from mpidl.engine.placement import Placement
from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.fusion import MiB, plan
from mpidl.runtime.sync.fused import FusedAllreduce
from mpidl.runtime.tensor_parallel import (ELEMENTWISE, ColumnParallelLinear,
                                           ParallelSoftmaxCrossEntropy, RowParallelLinear,
                                           TensorParallel)

MODES = ("conv-dp-fc-mp",)
FLAG = "--hybrid conv-dp-fc-mp"

OPTIONS = [
    Option("hybrid", str, None, "conv-dp-fc-mp: convolutions data parallel over all ranks, "
           "the fully connected block tensor parallel over the same ranks (Krizhevsky's "
           "one weird trick: activations all-gathered at the boundary, their gradients "
           "reduce-scattered); logs its bytes per step beside plain data parallelism's",
           "parallelism", choices=(None,) + MODES),
]


def check_options(name, given):
    """One line for what the hybrid cannot do (before any rank communicates)."""
    mode = given.get("hybrid")
    if not mode:
        return
    if mode not in MODES:
        raise ConfigError(f"--hybrid {mode!r}: the one hybrid layout is conv-dp-fc-mp")
    if name not in ("local", "allreduce"):
        raise ConfigError(f"{FLAG} cannot be used with --strategy {name}: it splits the "
                          "fully connected layers over ranks that train together (--strategy "
                          "allreduce)")
    refuse = {"tensor_parallel": (given.get("tensor_parallel") or 1) > 1,
              "zero": bool(given.get("zero")),
              "compression": given.get("compression") not in (None, "none"),
              "sync": given.get("sync") not in (None, "allreduce"),
              "precision": given.get("precision") not in (None, "fp32")}
    for key, bad in refuse.items():
        if bad:
            value = given[key]
            flag = f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}")
            why = ("the fully connected layers are already split over every rank"
                   if key == "tensor_parallel" else "not built for the hybrid")
            raise ConfigError(f"{FLAG} with {flag}: {why}; drop one of them")


# -- the traffic of ring collectives, per rank (what the communicator's counters count)

def ring_allreduce_bytes(n, p, rank, itemsize):
    """A ring all-reduce of ``n`` elements: every chunk but this rank's in the
    reduce-scatter phase, every chunk but the next rank's in the all-gather phase."""
    if p == 1 or n == 0:
        return 0
    counts, _ = even_split(n, p)
    return (2 * n - counts[rank] - counts[(rank + 1) % p]) * itemsize


def ring_allgather_bytes(counts, rank, itemsize):
    """A ring all-gather(v) of per-rank ``counts``: every block but the next rank's."""
    p = len(counts)
    return 0 if p == 1 else (sum(counts) - counts[(rank + 1) % p]) * itemsize


def ring_reduce_scatter_bytes(counts, rank, itemsize):
    """A ring reduce-scatter to per-rank ``counts``: every block but this rank's."""
    return 0 if len(counts) == 1 else (sum(counts) - counts[rank]) * itemsize


def buckets_bytes(sizes, p, rank):
    """Fused buckets ``[(elements, itemsize)]``, each all-reduced by a ring."""
    return sum(ring_allreduce_bytes(n, p, rank, isz) for n, isz in sizes)


# -- the layers at the boundary

class GatheredColumnParallelLinear(ColumnParallelLinear):
    """The hybrid's first fully connected layer: a column-parallel ``Linear`` whose input
    is this rank's samples. Forward all-gathers every rank's rows (the whole global batch,
    in rank order) and runs this rank's columns on them; backward leaves the input
    gradient partial and reduce-scatters it by samples, so each rank gets the gradient of
    its own rows, summed over every rank's columns (one reduce-scatter instead of the
    all-reduce a column-parallel layer does, and only the rows the rank needs)."""

    def __init__(self, linear, group, name, unit=1, algorithm="auto"):
        super().__init__(linear, group, name, unit)
        self.algorithm = algorithm
        self._rows = {}         # micro-batch key -> rows per rank of its forward
        self.last_rows = None   # rows per rank of the latest training forward

    def forward(self, x):
        x, _ = as_input(x, self.dtype, self.weight.data)
        self._check(x)
        if x.ndim != 2:
            raise ShapeError(f"{FLAG}: the first fully connected layer {self.name!r} gathers "
                             f"(samples, features) rows, got input shape {tuple(x.shape)}; "
                             "put a Flatten before it")
        f = self.in_features
        whole, counts = self.group.allgatherv(x, algorithm=self.algorithm,
                                              name=f"hybrid.{self.name}.x")
        rows = tuple(c // f for c in counts)
        self._rows[self._mb_key] = rows
        if self.training:
            self.last_rows = rows
        return super().forward(whole.reshape(-1, f))

    def _allreduce(self, a, what):
        if what == "dx":  # partial: the reduce-scatter in backward sums it
            return a
        return super()._allreduce(a, what)

    def backward(self, dy):
        rows = self._rows.pop(self._mb_key)
        dx = super().backward(dy)
        if dx is None:
            return None
        f = self.in_features
        mine = self.group.reduce_scatter(dx, counts=[r * f for r in rows],
                                         algorithm=self.algorithm,
                                         name=f"hybrid.{self.name}.dx")
        return mine.reshape(rows[self.group.rank], f)

    def __repr__(self):
        return "Gathered" + super().__repr__()


class WholeBatchLoss(Loss):
    """The loss of the FC block's output, which holds every rank's samples: the labels
    are all-gathered in the same rank order, and the loss (and its gradient) is the mean
    over the whole global batch, the same on every rank. ``correct`` counts this rank's
    own samples only, so the evaluation's sums over ranks count every sample once."""

    def __init__(self, inner, group, algorithm="auto"):
        self.inner, self.group, self.algorithm = inner, group, algorithm
        self.label_itemsize = 8  # of the labels last gathered (datasets give int64)

    def _gather(self, labels):
        from mpidl.backend import array_module  # noqa: PLC0415

        xp = array_module(labels)
        whole, counts = self.group.allgatherv(xp.asarray(labels).reshape(-1),
                                              algorithm=self.algorithm,
                                              name="hybrid.labels")
        self.label_itemsize = whole.itemsize
        return whole, counts

    def forward(self, logits, labels):
        whole, _ = self._gather(labels)
        return self.inner.forward(logits, whole)

    def backward(self):
        return self.inner.backward()

    def correct(self, logits, labels):
        from mpidl.backend import array_module  # noqa: PLC0415

        whole, counts = self._gather(labels)
        r = self.group.rank
        lo = sum(counts[:r])
        xp = array_module(whole)
        at = xp.arange(whole.size)
        # other ranks' rows get label -1, which no class matches
        mine = xp.where((at >= lo) & (at < lo + counts[r]), whole.astype("int64"), -1)
        return self.inner.correct(logits, mine)

    def __repr__(self):
        return f"WholeBatchLoss({self.inner!r})"


class SummedFusedAllreduce(FusedAllreduce):
    """The convolutions' gradients in fused buckets, **summed** over the ranks: each
    rank's gradient is its samples' share of the gradient of the global-batch mean (the
    loss is that mean on every rank), so the sum is the one-process gradient."""

    name = "fused-allreduce (sum)"

    def __init__(self, hybrid, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hybrid = hybrid

    def _fusion(self, named_params, bucket_bytes, scale, wire=None, part_of=None):
        return super()._fusion(named_params, bucket_bytes, 1.0, wire, part_of)

    def bytes_per_step(self):
        """The whole hybrid step's bytes on this rank (the formula, at the rows of the
        latest training step): what the epoch line reports as bytes_sent_per_step."""
        return self.hybrid.step_bytes()

    def describe(self):
        return [line.replace("fused all-reduce", "fused all-reduce (sum) of the "
                             "convolutions' gradients", 1) if i == 0 else line
                for i, line in enumerate(super().describe())]


# -- the runtime part

class Hybrid(TensorParallel):
    """The runtime part (``Runtime.tp``): finds the boundary, cuts the FC block over the
    data-parallel group (``over_dp``), and says what a step moves."""

    over_dp = True

    def __init__(self, ranks, algorithm="auto", accumulate=1, sync_bn=False):
        super().__init__(ranks)
        self.algorithm = algorithm
        self.accumulate = accumulate
        self.sync_bn = bool(sync_bn)
        self.boundary = None     # index of the first FC layer in the top-level Sequential
        self.conv_sync = None    # the SummedFusedAllreduce of the convolutions (the preset)
        self.model = None
        self._boundary_name = None
        self._train_loss = None

    # -- where the model is cut
    def find_boundary(self, model):
        """The index ``k`` of the top-level ``Sequential``'s first ``Linear``: layers
        ``[:k]`` are the convolutional part (data parallel), ``[k:]`` the FC block."""
        name = type(model).__name__
        if not isinstance(model, Sequential):
            raise ConfigError(f"{FLAG} needs a Sequential model (convolutions, then fully "
                              f"connected layers), got a {name}")
        layers = model.layers
        k = next((i for i, layer in enumerate(layers) if isinstance(layer, Linear)), None)
        if k is None:
            raise ConfigError(f"{FLAG}: the model has no fully connected (Linear) layer at "
                              "its top level to split; use plain data parallelism")
        conv = [f"{i}" for i in range(k) for _, m in layers[i].modules()
                if isinstance(m, Conv2d)]
        if not conv:
            raise ConfigError(f"{FLAG}: the model has no convolution before its first fully "
                              f"connected layer ({k}), so there is no conv->FC boundary; use "
                              "--tensor-parallel or plain data parallelism")
        split = (Linear, Embedding, CausalAttention)
        for i in range(len(layers)):
            for sub, m in layers[i].modules(f"{i}."):
                where = sub.rstrip(".") or str(i)
                if i < k and isinstance(m, split):
                    raise ConfigError(f"{FLAG}: layer {where} ({type(m).__name__}) sits "
                                      f"before the last convolution's boundary ({k}); the "
                                      "hybrid splits only the fully connected block after it")
                if i >= k and isinstance(m, Conv2d):
                    raise ConfigError(f"{FLAG}: convolution {where} comes after the first "
                                      f"fully connected layer ({k}); the hybrid needs every "
                                      "convolution before the fully connected block")
                if i > k and isinstance(m, Embedding):
                    raise ConfigError(f"{FLAG}: Embedding {where} in the fully connected "
                                      "block is not supported")
        nxt = next((j for j in range(k + 1, len(layers))
                    if not isinstance(layers[j], ELEMENTWISE)), None)
        if nxt is not None and not isinstance(layers[nxt], Linear):
            raise ConfigError(f"{FLAG}: the first fully connected layer ({k}) must be the "
                              f"last layer or be followed (through activations and dropout "
                              f"only) by another Linear to be split by columns; layer {nxt} "
                              f"is a {type(layers[nxt]).__name__}")
        return k

    def check(self, model):
        """ConfigError when the model has no conv->FC boundary, or a layer of the FC block
        is narrower than the number of ranks."""
        self.find_boundary(model)
        try:
            self._plan(model, None)
        except ConfigError as e:  # the walk speaks of --tensor-parallel: say what was given
            raise ConfigError(str(e).replace(f"--tensor-parallel {self.degree}",
                                             f"{FLAG} on {self.degree} ranks").replace(
                "use a smaller --tensor-parallel", "launch fewer ranks or widen it")) from None

    def _column(self, linear, group, name, unit=1):
        if name == self._boundary_name:
            return GatheredColumnParallelLinear(linear, group, name, unit, self.algorithm)
        return super()._column(linear, group, name, unit)

    def setup(self, model, group):
        """Cut the FC block over ``group`` (the data-parallel group: every rank)."""
        self.boundary = self.find_boundary(model)
        self._boundary_name = str(self.boundary)
        super().setup(model, group)
        self.model = model
        first = model.layers[self.boundary]
        if not isinstance(first, GatheredColumnParallelLinear):  # find_boundary rules it out
            raise ConfigError(f"{FLAG}: layer {self.boundary} was not split by columns")
        for i in range(self.boundary, len(model.layers)):
            for _, m in model.layers[i].modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    m.algorithm = self.algorithm
                if isinstance(m, Dropout):  # the whole batch, on every rank: one mask
                    m.whole_batch = True
        for name, p in model.named_parameters():
            sl = self.slices.get(name)
            if sl is not None:
                p.placement = Placement.sharded("dp", dim=sl.dim, index=sl.index,
                                                count=len(sl.counts))

    def in_fc(self, name):
        """Whether parameter ``name`` belongs to the FC block (not averaged over ranks)."""
        return int(name.split(".", 1)[0]) >= self.boundary

    def loss(self, loss):
        inner = super().loss(loss)
        if isinstance(inner, ParallelSoftmaxCrossEntropy):
            inner.algorithm = self.algorithm
        wrapped = WholeBatchLoss(inner, self.group, self.algorithm)
        if self._train_loss is None:  # the runtime asks for the training loss first
            self._train_loss = wrapped
        return wrapped

    def describe(self):
        return [f"{FLAG}: layers 0..{self.boundary - 1} data parallel over "
                f"{self.degree} ranks (gradients summed), layers {self.boundary}.. tensor "
                "parallel over the same ranks: " + ", ".join(f"{n} {k}" for n, k in self.layers)]

    # -- evaluation: every rank's forward is collective
    def lockstep(self, batches, x, y, batch_size, dtype=None):
        """``batches`` (this rank's piece of an evaluation set), then empty batches until
        this rank has run as many as the rank with the most."""
        from mpidl.data.loader import lockstep_batches  # noqa: PLC0415

        return lockstep_batches(batches, x, y, batch_size, self.degree, dtype)

    # -- bytes per step
    def _fc_terms(self, rows, rank):
        """{term: bytes} of one forward and backward of the FC block on ``rows`` (per
        rank) and of the boundary, on ``rank``."""
        p, b = self.degree, sum(rows)
        model = self.model
        first = model.layers[self.boundary]
        isz = first.weight.data.itemsize
        f = first.in_features
        per_rank = [r * f for r in rows]
        terms = {"activations all-gather": ring_allgather_bytes(per_rank, rank, isz),
                 "labels all-gather": ring_allgather_bytes(list(rows), rank,
                                                           self._label_itemsize()),
                 "activation gradients reduce-scatter": 0, "FC tensor-parallel all-reduces": 0}
        if first.needs_input_grad:
            terms["activation gradients reduce-scatter"] = ring_reduce_scatter_bytes(
                per_rank, rank, isz)
        tp = 0
        for i in range(self.boundary, len(model.layers)):
            for _, m in model.layers[i].modules():
                if isinstance(m, GatheredColumnParallelLinear):
                    continue
                if isinstance(m, ColumnParallelLinear) and m.needs_input_grad:
                    tp += ring_allreduce_bytes(b * m.in_features, p, rank, isz)
                elif isinstance(m, RowParallelLinear):
                    tp += ring_allreduce_bytes(b * m.out_features, p, rank, isz)
        if self.output_slice is not None:  # the parallel cross-entropy: max, then 2 sums
            tp += ring_allreduce_bytes(b, p, rank, isz) + ring_allreduce_bytes(2 * b, p, rank, isz)
        terms["FC tensor-parallel all-reduces"] = tp
        return terms

    def _label_itemsize(self):
        """Bytes per label: the training loss's last gathered labels (int64 before)."""
        return 8 if self._train_loss is None else self._train_loss.label_itemsize

    def bytes_per_step(self, rows, rank=0):
        """{term: bytes} this rank sends in one training step (ring algorithms), with
        ``rows[r]`` samples on rank r in each of the step's micro-batches; "total" sums
        them. The convolutions' buckets are all-reduced once per step; the boundary and
        the FC block's collectives run once per micro-batch."""
        k = self.accumulate
        terms = {"conv gradients all-reduce": buckets_bytes(
            [(b.wire.size, b.wire.itemsize) for b in self.conv_sync.fusion.buckets],
            self.degree, rank)}
        for key, v in self._fc_terms(rows, rank).items():
            terms[key] = k * v
        terms["total"] = sum(terms.values())
        return terms

    def dp_bytes_per_step(self, rank=0):
        """What plain data parallelism sends per rank and step for the same (whole) model:
        every gradient in fused buckets of the same size, each all-reduced by a ring."""
        shapes = self.full_shapes(self.model)
        stand_ins = [(n, SimpleNamespace(data=SimpleNamespace(
            size=math.prod(shapes[n]), nbytes=math.prod(shapes[n]) * p.data.itemsize,
            dtype=p.data.dtype))) for n, p in self.model.named_parameters()]
        groups = plan(stand_ins, int(self.conv_sync.bucket_mb * MiB))
        return buckets_bytes([(sum(s.data.size for _, s in g), g[0][1].data.dtype.itemsize)
                              for g in groups], self.degree, rank)

    def step_bytes(self, rank=None):
        """This rank's bytes of the latest training step (0 before the first)."""
        rows = self.model.layers[self.boundary].last_rows
        if rows is None:
            return 0
        return self.bytes_per_step(rows, self.group.rank if rank is None else rank)["total"]

    def start_lines(self, batch_size):
        """The log line before training: the formula's bytes per step on the first rank,
        every rank training on ``batch_size`` samples per micro-batch."""
        rows = [batch_size] * self.degree
        t = self.bytes_per_step(rows, 0)
        dp = self.dp_bytes_per_step(0)
        parts = " + ".join(f"{key} {_mb(v)}" for key, v in t.items() if key != "total")
        ratio = f"{t['total'] / dp:.3g}" if dp else "-"
        note = (" (--sync-bn's statistics all-reduces, the same in both, not included)"
                if self.sync_bn else "")
        return [f"{FLAG}: bytes per step on rank 0 (formula, ring algorithms): {parts} = "
                f"{_mb(t['total'])}; plain data parallelism (every gradient all-reduced): "
                f"{_mb(dp)}; hybrid / data parallel = {ratio}{note}"]


def _mb(nbytes):
    return f"{nbytes:,} B"


def runtime(comm, unused, sched, algorithm, bucket_mb, overlap, sync_bn, accumulate):
    """The ``allreduce`` preset with ``--hybrid conv-dp-fc-mp``: the convolutions'
    gradients summed in fused buckets, the FC block's kept as they are (no sync)."""
    from mpidl.runtime.placement import Replicated  # noqa: PLC0415
    from mpidl.runtime.runtime import Runtime  # noqa: PLC0415
    from mpidl.runtime.sync.base import GradSync  # noqa: PLC0415

    part = Hybrid(comm.size, algorithm, accumulate or 1, sync_bn)
    conv = SummedFusedAllreduce(part, algorithm, bucket_mb, overlap)
    part.conv_sync = conv
    syncs = [(lambda name: not part.in_fc(name), conv),
             (part.in_fc, GradSync())]
    rt = Runtime(comm, "allreduce+hybrid", sched, syncs, Replicated, sync_bn=sync_bn,
                 unused=unused, tensor_parallel=part)
    rt.checks.append(lambda model, optimizer: part.check(model))
    return rt

"""Tensor parallelism's step, replayed (``--tensor-parallel T``): the mesh's two groups.

The mesh puts the ``T`` ranks of a tensor-parallel group on consecutive ranks (``tp`` is
the innermost axis, ``mpidl.comm.mesh``) and data parallelism over every ``T``-th rank
(``dp``). Each rank's traffic is then two layouts:

- its **tp group's** all-reduces, inside the passes: the model is cut by the runtime's
  own ``TensorParallel`` against a group that records instead of sending
  (``RecordingGroup``), and one micro-batch of the real shape runs forward, loss and
  backward through it. What is recorded is what the layers call: the row-parallel
  outputs, the column-parallel input gradients, the vocabulary-parallel embedding, the
  parallel cross-entropy's maximum and sums; their algorithm as the communicator
  resolves it for a group of ``T``. The values are not summed (only sizes matter), so
  the recorded pass computes nothing meaningful.
- its **dp group's** step (``step.layout``) over the parameters this rank holds after the
  cut: its slices and the replicated rest, on ``p / T`` ranks; row-sparse gradients of
  the vocabulary-parallel embedding as rows of this rank's slice.

A rank's ``T`` pieces can differ (widths ``T`` does not divide: uneven slices), so both
layouts are made for every tp rank. The time: the tp all-reduces block inside the passes
(timed on the tp group's links), the compute of a layer holding slices is its measured
compute times its share of the layer's parameters, and the dp group's step runs as
``step.step_time`` says on its own links.
"""

from dataclasses import dataclass, field

from mpidl.comm import auto
from mpidl.comm.counters import FIELDS, KINDS

from . import collectives as col
from .step import Call, Compute, _dtype_name, add_blocking, calls_traffic, clip_calls
from .step import resolve, segment_bytes
from .step import layout as group_layout
from .step import step_time as group_time
from .step import traffic as group_traffic


class RecordingGroup:
    """Stands in for the tp group while the cut model runs one micro-batch: records each
    collective (``calls``: ``Call`` with ``phase`` the pass it is in), sums nothing. Its
    all-gathers hand back ``size`` copies of this rank's part (every rank alike: only
    shapes matter), its reduce-scatters this rank's share of the input, unsummed; each
    call's algorithm as the communicator resolves it (``Communicator._resolve`` on the
    sizes it would see)."""

    def __init__(self, rank, size, selector):
        self.rank, self.size = rank, size
        self.selector = selector
        self.phase = "forward-tp"
        self.calls = []

    def allreduce(self, x, out=None, op="sum", algorithm="auto", name=None):
        alg = resolve(self.selector, "allreduce", algorithm or "auto", x.nbytes, x.dtype)
        self.calls.append(Call("allreduce", name or "tp", alg, int(x.size), x.itemsize,
                               _dtype_name(x.dtype), phase=self.phase))
        return x if out is None else out

    def allgatherv(self, x, algorithm="auto", name=None):
        from mpidl.backend import array_module  # noqa: PLC0415

        counts = [int(x.size)] * self.size
        alg = resolve(self.selector, "allgatherv", algorithm or "auto",
                      sum(counts) * x.itemsize // self.size, x.dtype)
        self.calls.append(Call("allgatherv", name or "tp", alg, counts, x.itemsize,
                               _dtype_name(x.dtype), phase=self.phase))
        xp = array_module(x)
        return xp.concatenate([x.reshape(-1)] * self.size), counts

    def reduce_scatter(self, x, out=None, op="sum", algorithm="auto", name=None,
                       counts=None):
        from mpidl.comm.layout import even_split  # noqa: PLC0415

        alg = resolve(self.selector, "reduce_scatter", algorithm or "auto", x.nbytes, x.dtype)
        self.calls.append(Call("reduce_scatter", name or "tp", alg, int(x.size), x.itemsize,
                               _dtype_name(x.dtype), phase=self.phase))
        counts = list(counts) if counts is not None else even_split(x.size, self.size)[0]
        lo = sum(counts[:self.rank])
        return x.reshape(-1)[lo:lo + counts[self.rank]]


@dataclass
class Piece:
    """One tp rank's share: its tp group's calls for one micro-batch, the parameters it
    holds after the cut (``named``: name -> Parameter), the rows its row-sparse
    gradients hold for the batch given (name -> count), each top-level layer's fraction
    of the whole layer's parameters (its compute share) and output ``(shape, itemsize)``
    on this rank (a column-parallel layer's is its slice: what a pipeline stage ending
    there sends)."""

    calls: list
    named: list
    rows: dict
    share: dict
    outputs: list = field(default_factory=list)


def cut(make_model, degree, rank, x, y, loss, tables=None, chunks=None):
    """``Piece`` of tp rank ``rank`` of ``degree``: a fresh model from ``make_model()`` cut
    as the runtime cuts it, one micro-batch ``(x, y)`` through it (module doc).
    ``chunks``: a pipeline's layer boundaries (``pipeline.partition``'s): the pass then
    runs chunk by chunk as the stages run them, each after the first wanting its input's
    gradient (a column-parallel layer opening a chunk all-reduces its input gradient,
    for the stage before, where the whole model would skip it)."""
    from mpidl.runtime.sync.rowsparse import as_rows, sparse_param_names  # noqa: PLC0415
    from mpidl.runtime.tensor_parallel import TensorParallel  # noqa: PLC0415

    whole = {key: sum(q.data.size for _, q in layer.named_parameters())
             for key, layer in make_model().children()}
    model = make_model()
    model.needs_input_grad = False  # (as the runtime starts it: schedule.setup)
    group = RecordingGroup(rank, degree, auto.Selector(degree, auto.load() if tables is None
                                                       else tables))
    tp = TensorParallel(degree)
    tp.setup(model, group)
    loss = tp.loss(loss)
    model.zero_grad()
    if chunks is None:
        loss.forward(model(x), y)
        group.phase = "backward-tp"
        model.backward(loss.backward())
    else:
        from mpidl.engine.module import Sequential  # noqa: PLC0415

        pieces = []
        h = x
        for v in range(len(chunks) - 1):
            chunk = Sequential(*model.layers[chunks[v]:chunks[v + 1]],
                               names=range(chunks[v], chunks[v + 1]))
            chunk.needs_input_grad = v > 0
            h = chunk(h)
            pieces.append(chunk)
        loss.forward(h, y)
        group.phase = "backward-tp"
        dy = loss.backward()
        for chunk in reversed(pieces):
            if dy is None:
                break
            dy = chunk.backward(dy)
    sparse = sparse_param_names(model)
    rows = {name: int(as_rows(q).indices.size) for name, q in model.named_parameters()
            if name in sparse}
    model.zero_grad()
    share = {}
    for key, layer in model.children():
        mine = sum(q.data.size for _, q in layer.named_parameters())
        share[key] = mine / whole[key] if whole.get(key) else 1.0
    from .pipeline import layer_outputs  # noqa: PLC0415

    calls, group.calls = group.calls, []
    outputs = layer_outputs(model, x)  # (the all-reduces of this pass are dropped)
    return Piece(calls, model.named_parameters(), rows, share, outputs)


@dataclass
class MeshStep:
    """A step on a dp x tp mesh of ``p`` ranks: per tp rank ``j`` its ``Piece``
    (``pieces[j].calls``: its tp calls for one micro-batch, run ``micro`` times) and its
    dp group's layout (``dp[j]``). ``whole_params``: the uncut model's parameter count."""

    p: int
    degree: int
    pieces: list
    dp: list
    micro: int = 1
    whole_params: int = 0
    what: str = ""
    every: int = 1
    servers: int = 0
    calls: list = field(default_factory=list)  # (tp rank 0's dp calls, for --json)
    step_calls: list = field(default_factory=list)  # tp calls once a step (clipping's)


def groups_of(rank, degree):
    """``(dp rank, tp rank)`` of a world rank (tp innermost)."""
    return rank // degree, rank % degree


def topologies(p, degree, per_node):
    """The tp group's and the dp group's ``Topology`` (consecutive ranks per node)."""
    tp = col.Topology(degree, max(1, min(per_node, degree)))
    dp = col.Topology(p // degree, max(1, per_node // degree))
    return tp, dp


def traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {calls, ...}, "total": ..., "groups": {"tp": ..., "dp": ...}}}``:
    what ``Mesh.counters()`` shows for the tp and dp groups, and their sum."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    tp_topo, dp_topo = topologies(step.p, step.degree, per_node)
    out = {}
    for r in (range(step.p) if ranks is None else ranks):
        i, j = groups_of(r, step.degree)
        tp = calls_traffic(step.pieces[j].calls * step.micro + step.step_calls, j, tp_topo,
                           seg_bytes)
        dp = group_traffic(step.dp[j], dp_topo.per_node, ranks=[i], seg_bytes=seg_bytes)[i]
        summary = {k: {f: tp[k][f] + dp[k][f] for f in FIELDS} for k in (*KINDS, "total")}
        summary["groups"] = {"tp": tp, "dp": dp}
        out[r] = summary
    return out


def step_time(step, compute, batch, accumulate, machine, per_node, overlap, seg_bytes=None):
    """Predicted seconds of one step (``step.step_time``'s keys), the slowest tp rank's:
    each rank's compute at its parameter share of every layer, its tp all-reduces inside
    the passes on the tp group's links, its dp step on the dp group's links."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    tp_topo, dp_topo = topologies(step.p, step.degree, per_node)
    tp_links, dp_links = col.Links(machine, tp_topo), col.Links(machine, dp_topo)
    worst = None
    for piece, dp in zip(step.pieces, step.dp):
        layers = {k: (f * piece.share.get(k, 1.0), b * piece.share.get(k, 1.0))
                  for k, (f, b) in compute.layers.items()}
        passes = {"forward-tp": 0.0, "backward-tp": 0.0}
        for c in piece.calls:
            passes[c.phase] += col.time_allreduce(c.algorithm, tp_links, c.size, c.itemsize,
                                                  seg_bytes)
        held = sum(q.data.size for _, q in piece.named) / max(step.whole_params, 1)
        mine = Compute(layers, compute.update_s * held, compute.source, compute.cv,
                       compute.on_cores)
        t = group_time(dp, mine, batch, accumulate, dp_links, overlap, seg_bytes,
                       in_pass=(passes["forward-tp"], passes["backward-tp"]))
        t["comm"] += accumulate * (passes["forward-tp"] + passes["backward-tp"])
        add_blocking(t, step.step_calls, tp_links, seg_bytes)
        if worst is None or t["total"] > worst["total"]:
            worst = t
    return worst


def pieces_of(make_model, degree, batch, loss, tables=None, chunks=None):
    """Every tp rank's ``Piece`` (``cut``), and the uncut model's parameter count."""
    pieces = [cut(make_model, degree, j, *batch, loss, tables, chunks)
              for j in range(degree)]
    return pieces, sum(q.data.size for _, q in make_model().named_parameters())


def layout(pieces, whole_params, p, algorithm="auto", bucket_mb=4.0, micro=1, tables=None,
           rows=None, sparse=True, zero=0, zero_keep=(), clip=0):
    """``MeshStep`` of ``p`` ranks over ``pieces_of``'s pieces (one per tp rank).
    ``rows``: the rows each dp rank's row-sparse gradients hold, per tp rank
    (``rows[j][name]``: a count per dp rank; default: the piece's batch's on every dp
    rank); ``sparse=False``: they go dense in the buckets (``--sparse-grads dense``);
    ``zero``: the dp group's ZeRO stage (its buckets of the slices sharded; stage 3
    gathers them for every pass, but ``zero_keep``'s, ``step.layout``'s); ``clip``: under
    ``--clip-grad-norm`` the elements its norm counts, summed over the tp group (and
    under ZeRO the dp group) once a step."""
    degree = len(pieces)
    d = p // degree
    dp = []
    for j, piece in enumerate(pieces):
        names = sorted(piece.rows) if sparse else []
        sizes = (rows or {}).get(j) or {name: [piece.rows[name]] * d for name in names}
        dp.append(group_layout(piece.named, d, algorithm, bucket_mb, names, sizes,
                               tables=tables, alone=True, zero=zero, micro=micro,
                               zero_keep=zero_keep, clip=clip))
    return MeshStep(p, degree, pieces, dp, micro=micro, whole_params=whole_params,
                    what=f"tensor parallelism {degree} x data parallelism {d}",
                    calls=dp[0].calls, step_calls=clip_calls(clip) if clip else [])

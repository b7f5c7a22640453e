"""The conv-DP/FC-MP hybrid's step, replayed (``--hybrid conv-dp-fc-mp``): one group, two
parts.

Every rank trains on its own piece of the batch, and all of the step's collectives run
on the one data-parallel group of all ``p`` ranks (``mpidl.runtime.hybrid``):

- the **boundary and the fully connected block's**: the model is cut by the runtime's
  own ``Hybrid`` against a group that records instead of sending
  (``tensor.RecordingGroup``), and one micro-batch of the real shape runs forward, loss
  and backward through it. Recorded are what the layers call: the activations'
  all-gather at the first FC layer, the labels' all-gather in the loss, the FC block's
  tensor-parallel all-reduces (on every rank's rows), the parallel cross-entropy's when
  the logits are sliced, and the reduce-scatter of the activations' gradient back to
  the ranks' rows; once per micro-batch. Every rank is given the same number of rows
  (a run whose pieces are uneven differs by those rows).
- the **convolutions' gradients**: fused buckets summed over the ranks
  (``step.layout`` over the parameters before the boundary), overlapping backward as
  plain data parallelism's do; ``--sync-bn``'s statistics all-reduces inside the passes.

The time: the recorded calls block inside the passes; a fully connected layer's compute
is its measured compute per sample times the ``p`` ranks' rows it runs on times this
rank's share of its parameters; the convolutions' buckets as ``step.step_time`` says.
"""

from dataclasses import dataclass, field

from mpidl.comm import auto

from . import collectives as col
from .step import Compute, add_blocking, call_time, calls_traffic, clip_calls, segment_bytes
from .step import layout as group_layout
from .step import step_time as group_time
from .tensor import RecordingGroup


@dataclass
class HybridStep:
    """A step of ``p`` ranks: the boundary's and FC block's calls for one micro-batch
    (``fc_calls``, run ``micro`` times), the convolutions' layout (``conv``), each
    top-level layer's compute factor on this rank (``factor``: ``p`` x its parameter
    share for an FC layer, 1 for the rest) and the share of all parameters it holds."""

    p: int
    fc_calls: list
    conv: object
    factor: dict
    held: float
    boundary: int
    micro: int = 1
    what: str = ""
    every: int = 1
    servers: int = 0
    calls: list = field(default_factory=list)  # (the convolutions' buckets, for --json)
    step_calls: list = field(default_factory=list)  # once a step (clipping's norm)


def layout(make_model, p, x, y, loss, algorithm="auto", bucket_mb=4.0, micro=1,
           sync_bn=False, tables=None, rank=0, clip=0):
    """``HybridStep`` of ``p`` ranks, rank ``rank``'s view (its FC slices), for one
    micro-batch ``(x, y)`` per rank (module doc); ``make_model()`` builds the whole
    model afresh (it is cut). ``clip``: under ``--clip-grad-norm`` the elements its norm
    counts (summed over the group once a step: its FC slices differ by rank)."""
    from mpidl.runtime.hybrid import Hybrid  # noqa: PLC0415

    from .step import sync_bn_layers  # noqa: PLC0415

    whole = {key: sum(q.data.size for _, q in layer.named_parameters())
             for key, layer in make_model().children()}
    model = make_model()
    bn = sync_bn_layers(model) if sync_bn else ()
    model.needs_input_grad = False  # (as the runtime starts it: schedule.setup)
    selector = auto.Selector(p, auto.load() if tables is None else tables)
    group = RecordingGroup(rank, p, selector)
    part = Hybrid(p, algorithm, micro, sync_bn)
    part.setup(model, group)
    loss = part.loss(loss)
    model.zero_grad()
    loss.forward(model(x), y)
    group.phase = "backward-tp"
    model.backward(loss.backward())
    model.zero_grad()
    factor = {}
    for key, layer in model.children():
        mine = sum(q.data.size for _, q in layer.named_parameters())
        fc = int(key) >= part.boundary
        factor[key] = p * mine / whole[key] if fc and whole.get(key) else (p if fc else 1.0)
    named = model.named_parameters()
    conv = group_layout([(n, q) for n, q in named if not part.in_fc(n)], p, algorithm,
                        bucket_mb, tables=tables, sync_bn=bn, micro=micro)
    held = sum(q.data.size for _, q in named) / max(sum(whole.values()), 1)
    return HybridStep(p, group.calls, conv, factor, held, part.boundary, micro,
                      what=f"hybrid conv-dp-fc-mp over {p} ranks (layers 0..{part.boundary - 1}"
                      " data parallel, the rest tensor parallel)", calls=conv.calls,
                      step_calls=clip_calls(clip) if clip else [])


def traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {...}, "total": ...}}``: what the group's counters show."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    topo = col.Topology(step.p, max(1, min(per_node, step.p)))
    calls = step.fc_calls * step.micro + step.conv.calls + step.step_calls
    return {r: calls_traffic(calls, r, topo, seg_bytes)
            for r in (range(step.p) if ranks is None else ranks)}


def step_time(step, compute, batch, accumulate, links, overlap, seg_bytes=None):
    """Predicted seconds of one step (``step.step_time``'s keys) (module doc)."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    passes = {"forward-tp": 0.0, "backward-tp": 0.0}
    for c in step.fc_calls:
        passes[c.phase] += call_time(c, links, seg_bytes)
    layers = {k: (f * step.factor.get(k, 1.0), b * step.factor.get(k, 1.0))
              for k, (f, b) in compute.layers.items()}
    mine = Compute(layers, compute.update_s * step.held, compute.source, compute.cv,
                   compute.on_cores)
    t = group_time(step.conv, mine, batch, accumulate, links, overlap, seg_bytes,
                   in_pass=(passes["forward-tp"], passes["backward-tp"]))
    t["comm"] += accumulate * (passes["forward-tp"] + passes["backward-tp"])
    return add_blocking(t, step.step_calls, links, seg_bytes)

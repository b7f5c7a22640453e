"""Pipeline parallelism's step, replayed (``--pipeline-stages P``): the stages' messages
and each stage's data-parallel step.

The mesh puts the pipeline axis outermost (``mpidl.comm.mesh``): stage ``s`` of
data-parallel replica ``i`` is world rank ``s * D + i`` (``D = p / P``), so a replica's
stages are ``D`` ranks apart and each stage's data-parallel group is ``D`` consecutive
ranks. The model's top-level layers are cut into ``P * v`` pieces by the runtime's own
``partition`` (``mpidl.runtime.pipeline``) over the same costs: given (``--stage-costs
c1,c2,...``), one per layer (``--stage-costs layers``), or, by default, the machine
file's measured compute per layer (the run measures its own on its first micro-batch,
so where two layers cost nearly the same its cut may fall elsewhere: give the costs
to predict a run exactly).

Each rank's traffic is then two parts:

- its **pipeline group's** point-to-point messages: walking the schedule's actions for
  its rank (``mpidl.runtime.pipeline_schedule``, the lists the runtime walks), a forward
  of a micro-batch through a chunk that is not the last sends its output to the next
  stage and one that is not the first receives its input; a backward sends the input
  gradient back (not from the first stage) and receives its output gradient (not on the
  last). An activation and its gradient have the shape of the piece's last layer's
  output for one micro-batch (``layer_outputs``). Counted as the communicator counts
  them: a call per send and per receive, messages and bytes for the sends. The step's
  loss, broadcast over the group, goes through mpi4py itself and is not counted; the
  first message of each micro-batch size between two stages also sends its shape (a
  pickled object): a first step's, left out (the layout is of the steps after it).
- its **data-parallel group's** step (``step.layout``) over the parameters its pieces
  hold, on ``D`` ranks (a group of one still calls). A pipeline's gradients are synced
  after the step's last backward (its backward passes are spread over the schedule), so
  they never overlap it.

The time: the schedule's own event simulation (``Plan.simulate``) with each virtual
stage's forward and backward the sum of its layers' measured compute for a micro-batch
(``--recompute``: the forward again in backward; ``zb``'s split backward takes half of
it for the input gradient and half for the weights, the two products of a Linear or a
convolution being equally large) and each message between stages as long as the
calibration says for its bytes and link; then each stage's data-parallel step after its
last backward, its share of the optimizer update, and the loss's broadcast; the slowest
stage ends the step.
"""

import math
from dataclasses import dataclass, field

from mpidl.comm.counters import FIELDS, KINDS
from mpidl.errors import ConfigError

from . import collectives as col
from .step import call_time, segment_bytes, slowest_of
from .step import layout as group_layout
from .step import traffic as group_traffic


@dataclass
class Message:
    """A message of one step, between pipeline ranks ``src`` and ``dest``."""

    src: int
    dest: int
    nbytes: int
    what: str  # "activation" or "gradient"


@dataclass
class PipelineStep:
    """A step on a ``pp x dp`` mesh of ``p`` ranks: the plan, the cut (``bounds``: the
    layer boundaries of the ``P * v`` pieces), every pipeline rank's messages of one
    step (``messages``), held parameters (``named[s]``) and data-parallel layout
    (``dp[s]``); ``boundary_bytes[v]``: the bytes of the message between virtual stages
    ``v`` and ``v + 1``."""

    p: int
    degree: int
    plan: object
    bounds: list
    messages: list
    named: list
    dp: list
    boundary_bytes: list
    whole_params: int = 0
    cost_source: str = ""
    what: str = ""
    every: int = 1
    servers: int = 0
    calls: list = field(default_factory=list)  # (stage 0's dp calls, for --json)


def plan_of(stages, schedule, micro):
    """The runtime's ``Plan`` for ``--pipeline-stages``, ``--schedule`` and
    ``--micro-batches`` (one ConfigError line for a schedule it cannot build)."""
    from mpidl.runtime import pipeline_schedule  # noqa: PLC0415

    kind, chunks = pipeline_schedule.parse(schedule or "1f1b")
    return pipeline_schedule.build(kind, int(stages), int(micro), chunks)


def stage_costs(spec, n, measured=None):
    """``(costs, source)``: the cost per top-level layer the cut balances (module doc).
    ``measured``: the machine file's seconds per layer, or None."""
    from mpidl.runtime.pipeline import Pipeline  # noqa: PLC0415

    if spec in (None, "", "measured"):
        if measured is not None:
            return list(measured), "the machine file's measured"
        return [1.0] * n, "one per layer (no measured compute)"
    if spec == "layers":
        return [1.0] * n, "one per layer"
    return Pipeline(1, stage_costs=spec)._parse_costs(spec, n), "given"


def layer_outputs(model, x):
    """Each top-level layer's output ``(shape, itemsize)`` for the input ``x``: what a
    stage ending at that layer sends (the model's saved contexts are dropped)."""
    out, h = [], x
    for layer in model.layers:
        with layer.micro_batch("simulate"):
            h = layer(h)
            layer.discard_saved()
        out.append((tuple(h.shape), int(h.dtype.itemsize)))
    return out


def messages_of(plan, bounds, outputs):
    """Every pipeline rank's messages of one step, and the bytes of each boundary's
    (module doc); ``outputs``: ``layer_outputs`` for one micro-batch."""
    S, P = plan.virtual_stages, plan.P
    sizes = []
    for v in range(S - 1):
        shape, itemsize = outputs[bounds[v + 1] - 1]
        n = 1
        for d in shape:
            n *= d
        sizes.append(n * itemsize)
    acts = plan.actions  # (async: the steady step's lists, carried backwards included)
    out = []
    for r in range(P):
        for op, _, c in acts[r]:
            vs = c * P + r
            if op == "F" and vs < S - 1:
                out.append(Message(r, plan.place(vs + 1)[0], sizes[vs], "activation"))
            elif op == "B" and vs > 0:
                out.append(Message(r, plan.place(vs - 1)[0], sizes[vs - 1], "gradient"))
    return out, sizes


def held_names(named, bounds, plan, rank):
    """The parameters pipeline rank ``rank`` keeps, in the order the runtime's cut
    model lists them (its chunks' layers in order; names as in the whole model)."""
    by_layer = {}
    for name, q in named:
        by_layer.setdefault(name.split(".", 1)[0], []).append((name, q))
    out = []
    for c in range(plan.v):
        v = c * plan.P + rank
        for i in range(bounds[v], bounds[v + 1]):
            out += by_layer.get(str(i), [])
    return out


def layout(model, p, plan, costs, x, algorithm="auto", bucket_mb=4.0, sparse=(),
           rows=None, tables=None, cost_source=""):
    """``PipelineStep`` of ``p`` ranks for ``model`` (whole, built from the seed) cut by
    ``costs`` over ``plan``; ``x``: one micro-batch of input (its shape sets the
    messages). ``sparse``: the row-sparse parameters gathered as rows; ``rows[name]``:
    the rows each dp rank's gradient of it holds after a step (a count per dp rank)."""
    from mpidl.runtime.pipeline import partition  # noqa: PLC0415

    P = plan.P
    if p % P:
        raise ConfigError(f"--pipeline-stages {P} does not divide {p} ranks")
    d = p // P
    layers = list(model.layers)
    if len(costs) != len(layers):
        raise ConfigError(f"pipeline: {len(costs)} layer costs for {len(layers)} top-level "
                          "layers")
    bounds = partition(costs, plan.virtual_stages)
    messages, sizes = messages_of(plan, bounds, layer_outputs(model, x))
    named_all = model.named_parameters()
    named, dp = [], []
    for s in range(P):
        mine = held_names(named_all, bounds, plan, s)
        names = sorted(n for n, _ in mine if n in set(sparse))
        named.append(mine)
        dp.append(group_layout(mine, d, algorithm, bucket_mb, names,
                               {n: list(rows[n]) for n in names}, tables=tables,
                               alone=True))
    kind = plan.kind + (f":{plan.v}" if plan.v > 1 else "")
    return PipelineStep(p, P, plan, bounds, messages, named, dp, sizes,
                        whole_params=sum(q.data.size for _, q in named_all),
                        cost_source=cost_source,
                        what=f"pipeline {P} stages ({kind}, {plan.M} micro-batches) x data "
                        f"parallelism {d}", calls=dp[0].calls)


def groups_of(rank, step):
    """``(pipeline rank, dp rank)`` of a world rank (the pipeline axis outermost)."""
    d = step.p // step.degree
    return rank // d, rank % d


def traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {...}, "total": ..., "groups": {"pp": ..., "dp": ...}}}``: what
    ``Mesh.counters()`` shows for the pipeline and data-parallel groups, and their sum."""
    d = step.p // step.degree
    dp_per_node = max(1, min(per_node, d))
    p2p = {s: [0, 0, 0, 0] for s in range(step.degree)}
    for m in step.messages:
        row = p2p[m.src]
        row[0] += 1
        row[1] += 1
        row[2] += m.nbytes
        p2p[m.dest][0] += 1
    out = {}
    for r in (range(step.p) if ranks is None else ranks):
        s, i = groups_of(r, step)
        pp = {kind: dict(zip(FIELDS, p2p[s] if kind == "p2p" else [0, 0, 0, 0]))
              for kind in KINDS}
        pp["total"] = dict(pp["p2p"])
        dp = group_traffic(step.dp[s], dp_per_node, ranks=[i], seg_bytes=seg_bytes)[i]
        summary = {k: {f: pp[k][f] + dp[k][f] for f in FIELDS} for k in (*KINDS, "total")}
        summary["groups"] = {"pp": pp, "dp": dp}
        out[r] = summary
    return out


def step_time(step, compute, micro, machine, per_node, recompute=False, seg_bytes=None):
    """Predicted seconds of one step (``step.step_time``'s keys, and ``bubble``: the
    schedule's idle fraction) (module doc)."""
    plan, P = step.plan, step.degree
    d = step.p // P
    S = plan.virtual_stages
    keys = list(compute.layers)
    fwd, bwd = [], []
    for v in range(S):
        lo, hi = step.bounds[v], step.bounds[v + 1]
        fwd.append(micro * sum(compute.layers[k][0] for k in keys[lo:hi]))
        bwd.append(micro * sum(compute.layers[k][1] for k in keys[lo:hi]))
    if recompute:
        bwd = [b + f for f, b in zip(fwd, bwd)]
    weight = [0.0] * S
    if plan.split_backward:
        weight = [b / 2 for b in bwd]
        bwd = list(weight)
    world = col.Topology(step.p, max(1, min(per_node, step.p)))
    links = col.Links(machine, world)
    latency = 0.0
    for v, nbytes in enumerate(step.boundary_bytes):  # (replica 0's stages: d ranks apart)
        a, b = plan.place(v)[0] * d, plan.place(v + 1)[0] * d
        latency = max(latency, links.message(world.node(a) != world.node(b), nbytes))
    timeline = plan.simulate(fwd, bwd, weight, latency)
    dp_links = col.Links(machine, col.Topology(d, max(1, min(per_node, d))))
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    loss_bcast = math.ceil(math.log2(P)) * links.message(world.nodes > 1, 64)
    worst = None
    for s in range(P):
        spans = [sp for sp in timeline.spans if sp[0] == s]
        done = max((sp[5] for sp in spans), default=0.0)
        busy = sum(sp[5] - sp[4] for sp in spans)
        f_s = sum(sp[5] - sp[4] for sp in spans if sp[1] == "F")
        dp_s = sum(call_time(c, dp_links, seg_bytes) for c in step.dp[s].calls) \
            if d > 1 else 0.0
        held = sum(q.data.size for _, q in step.named[s]) / max(step.whole_params, 1)
        update = compute.update_s * held
        skew = compute.cv * busy * slowest_of(d)
        total = done + dp_s + update + skew + loss_bcast
        sends = sum(1 for m in step.messages if m.src == s)
        t = {"forward": f_s, "backward": busy - f_s, "comm": dp_s + sends * latency,
             "exposed_comm": total - busy - update - skew, "update": update,
             "compression": 0.0, "skew": skew, "total": total,
             "bubble": timeline.bubble}
        if worst is None or t["total"] > worst["total"]:
            worst = t
    return worst

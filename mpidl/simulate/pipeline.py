"""Pipeline parallelism's step, replayed (``--pipeline-stages P``): the stages' messages
and each stage's data-parallel step.

The mesh puts the pipeline axis outermost (``mpidl.comm.mesh``): stage ``s`` of
data-parallel replica ``i`` is world rank ``s * D + i`` (``D = p / P``), so a replica's
stages are ``D`` ranks apart and each stage's data-parallel group is ``D`` consecutive
ranks. With tensor parallelism too (3-D, ``--tensor-parallel T``: tp innermost, rank
``(s * D + i) * T + j``), every tp rank ``j`` has its own piece of each stage: the model
cut by ``TensorParallel`` (``tensor.cut``, its recording pass run chunk by chunk as the
stages run it), and its tp group's calls are those of its stage's layers. The model's top-level layers are cut into ``P * v`` pieces by the runtime's own
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
  Tied weights on two stages (``--tie-weights``) add the owner's weight to the head's
  stage at the step's start and each micro-batch's gradient of it back, after the
  head's backward (``mpidl.runtime.pipeline``);
- its **data-parallel group's** step (``step.layout``, ZeRO stage 1 or 2 if asked) over
  the parameters its pieces hold, on ``D`` ranks (a group of one still calls). A
  pipeline's gradients are synced after the step's last backward (its backward passes
  are spread over the schedule), so they never overlap it;
- with tensor parallelism, its **tp group's** all-reduces: its stage's layers' calls
  (the last stage's the parallel cross-entropy's), once per micro-batch.

The time: the schedule's own event simulation (``Plan.simulate``) with each virtual
stage's forward and backward the sum of its layers' measured compute for a micro-batch
(``--recompute``: the forward again in backward; ``zb``'s split backward takes half of
it for the input gradient and half for the weights, the two products of a Linear or a
convolution being equally large) and each message between stages as long as the
calibration says for its bytes and link (a layer holding tensor-parallel slices
computes its share of the parameters' compute, and its tp all-reduces block inside the
pass); then each stage's data-parallel step after its last backward, its share of the
optimizer update, and the loss's broadcast; the slowest stage (and tp rank) ends the
step.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from mpidl.comm.counters import FIELDS, KINDS
from mpidl.errors import ConfigError

from . import collectives as col
from .step import call_time, clip_calls, segment_bytes, slowest_of
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
    """A step on a ``pp x dp x tp`` mesh of ``p`` ranks (``tp`` = 1 without tensor
    parallelism): the plan, the cut (``bounds``: the layer boundaries of the ``P * v``
    pieces) and, for every pipeline rank ``s`` and tp rank ``j``: the parameters held
    (``named[s][j]``), the data-parallel layout (``dp[s][j]``), the tp group's calls for
    one micro-batch (``tp_calls[s][j]``) and the layer compute factors (``share[j]``);
    per tp rank, the pipeline ranks' messages of one step (``messages[j]``) and each
    boundary's bytes (``boundary_bytes[j][v]``: between virtual stages ``v``, ``v + 1``)."""

    p: int
    degree: int
    plan: object
    bounds: list
    messages: list
    named: list
    dp: list
    boundary_bytes: list
    tp: int = 1
    tp_calls: list = None
    share: list = None
    micro: int = 1
    whole_params: int = 0
    cost_source: str = ""
    what: str = ""
    every: int = 1
    servers: int = 0
    calls: list = field(default_factory=list)  # (stage 0's dp calls, for --json)
    # fp16: the stages agree on an overflow, one MPI all-reduce on the pipeline group per
    # step (counted as a call; its four bytes are not priced)
    overflow_agreement: bool = False
    # --clip-grad-norm: its MPI all-reduces once a step on the pipeline group (and the tp
    # group): counted as calls, not priced (as the overflow's)
    step_calls: list = field(default_factory=list)


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


def messages_of(plan, bounds, outputs, ties=(), tied_per_step=False):
    """Every pipeline rank's messages of one step, and the bytes of each boundary's
    (module doc); ``outputs``: ``layer_outputs`` for one micro-batch; ``ties``: ``(owner
    layer, head layer, bytes)`` of each tied weight, whose gradient goes back once per
    micro-batch or (``tied_per_step``) once per step."""
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
    from mpidl.runtime.pipeline import piece_of  # noqa: PLC0415

    piece = piece_of(bounds)
    for j, i, nbytes in ties:
        owner, head = (plan.place(piece(str(k)))[0] for k in (j, i))
        if owner != head:
            out.append(Message(owner, head, nbytes, "tied weight"))
            out += [Message(head, owner, nbytes, "tied gradient")] * (
                1 if tied_per_step else plan.M)
    return out, sizes


def held_names(named, bounds, plan, rank):
    """The parameters pipeline rank ``rank`` keeps, in the order the runtime's cut
    model lists them (its chunks' layers in order; names as in the whole model)."""
    by_layer = {}
    for name, q in named:
        by_layer.setdefault(name.split(".", 1)[0], []).append((name, q))
    return [item for i in layers_of(bounds, plan, rank) for item in by_layer.get(str(i), [])]


def layout(model, p, plan, costs, x, algorithm="auto", bucket_mb=4.0, sparse=(),
           rows=None, tables=None, cost_source="", pieces=None, zero=0, recompute=False,
           tied_per_step=False, sync_bn=False, wire=None, clip=0):
    """``PipelineStep`` of ``p`` ranks for ``model`` (whole, built from the seed) cut by
    ``costs`` over ``plan``; ``x``: one micro-batch of input (its shape sets the
    messages). ``sparse``: the row-sparse parameters gathered as rows; ``rows[j][name]``:
    the rows each dp rank's gradient of it holds after a step on tp rank ``j`` (a count
    per dp rank). ``pieces``: with tensor parallelism, ``tensor.pieces_of``'s pieces, one
    per tp rank (the model cut, its calls, its layers' outputs), or a function of the
    cut's boundaries returning them (``tensor.pieces_of(..., chunks=bounds)``: the pass
    run chunk by chunk, as the stages run it). ``zero``: each stage's dp group's ZeRO
    stage; ``recompute``: ``--recompute`` (stage 3 gathers for the forward backward runs
    again); ``tied_per_step``: ``--tied-exchange step``; ``sync_bn``: ``--sync-bn`` (each
    stage's BatchNorms all-reduce over its dp group in every pass: counted with its dp
    group's calls; without tensor parallelism); ``wire``: mixed precision's bucket dtype
    (each stage's buckets 2-byte; fp16's overflow agreed over the stages, and with ZeRO
    over each dp group); ``clip``: under ``--clip-grad-norm`` the elements its norm counts
    (summed over the pipeline and tp groups, and under ZeRO the dp groups)."""
    from mpidl.runtime.pipeline import partition, piece_of, tied_pairs  # noqa: PLC0415

    from .step import sync_bn_layers  # noqa: PLC0415

    n = len(model.layers)
    if len(costs) != n:
        raise ConfigError(f"pipeline: {len(costs)} layer costs for {n} top-level layers")
    bounds = partition(costs, plan.virtual_stages)
    if callable(pieces):
        pieces = pieces(bounds)
    P, T = plan.P, len(pieces) if pieces else 1
    if p % (P * T):
        raise ConfigError(f"--pipeline-stages {P} x --tensor-parallel {T} does not divide "
                          f"{p} ranks")
    d = p // (P * T)
    if sync_bn and T > 1:
        raise ConfigError("mpidl simulate: --sync-bn with --pipeline-stages and "
                          "--tensor-parallel is not modelled yet")
    piece = piece_of(bounds)
    # (a group of one is not synchronized; a chunk after the first computes every input
    # gradient)
    bn = [(k, c, dt, needs or piece(k) > 0) for k, c, dt, needs in sync_bn_layers(model)] \
        if sync_bn and d > 1 else []
    if pieces:
        per_tp = [(pc.named, pc.outputs, pc.calls, pc.share) for pc in pieces]
    else:
        per_tp = [(model.named_parameters(), layer_outputs(model, x), [], None)]
    # each tied weight by its name in the whole model (a tp rank's piece: its slice)
    name_of = {id(q): k for k, q in model.named_parameters()}
    pairs = [(j, i, name_of[id(model.layers[i].weight)])
             for j, i in tied_pairs(model.layers, f"--pipeline-stages {P}")]
    messages, sizes, named, dp, tp_calls = [], [], [], [], []
    for named_j, outputs, _, _ in per_tp:
        held = dict(named_j)
        ties = [(j, i, int(held[k].data.size * held[k].data.dtype.itemsize))
                for j, i, k in pairs]
        m, b = messages_of(plan, bounds, outputs, ties, tied_per_step)
        messages.append(m)
        sizes.append(b)
    for s in range(P):
        mine = set(layers_of(bounds, plan, s))
        named.append([])
        dp.append([])
        tp_calls.append([])
        for j, (named_j, _, calls, _) in enumerate(per_tp):
            held = held_names(named_j, bounds, plan, s)
            names = sorted(k for k, _ in held if k in set(sparse))
            named[s].append(held)
            dp[s].append(group_layout(held, d, algorithm, bucket_mb, names,
                                      {k: list(rows[j][k]) for k in names}, tables=tables,
                                      alone=True, zero=zero, micro=plan.M,
                                      zero_recompute=recompute, part_of=piece,
                                      sync_bn=[b for b in bn if int(b[0].split(".")[0])
                                               in mine],
                                      bn_forwards=2 if recompute else 1, wire=wire,
                                      clip=clip))
            tp_calls[s].append([c for c in calls if call_layer(c.name, n) in mine])
    kind = plan.kind + (f":{plan.v}" if plan.v > 1 else "")
    whole = sum(q.data.size for _, q in model.named_parameters())
    tp_text = f" x tensor parallelism {T}" if T > 1 else ""
    return PipelineStep(p, P, plan, bounds, messages, named, dp, sizes, tp=T,
                        tp_calls=tp_calls, share=[sh for *_, sh in per_tp], micro=plan.M,
                        whole_params=whole, cost_source=cost_source,
                        what=f"pipeline {P} stages ({kind}, {plan.M} micro-batches)"
                        f"{tp_text} x data parallelism {d}", calls=dp[0][0].calls,
                        overflow_agreement=wire is not None and np.dtype(wire) == np.float16,
                        step_calls=clip_calls(clip) if clip else [])


def layers_of(bounds, plan, rank):
    """The top-level layers pipeline rank ``rank`` holds (its chunks', in order)."""
    out = []
    for c in range(plan.v):
        v = c * plan.P + rank
        out += list(range(bounds[v], bounds[v + 1]))
    return out


def call_layer(name, n):
    """The top-level layer a tensor-parallel call belongs to, from its name
    (``tp.<layer>...``; the parallel cross-entropy's ``tp.loss...``: the last layer's)."""
    part = name.split(".")[1] if "." in name else ""
    return int(part) if part.isdigit() else n - 1


def groups_of(rank, step):
    """``(pipeline rank, dp rank, tp rank)`` of a world rank (pp outermost, tp innermost)."""
    d = step.p // (step.degree * step.tp)
    return rank // (d * step.tp), (rank // step.tp) % d, rank % step.tp


def traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {...}, "total": ..., "groups": {"pp": ..., "dp": ... [, "tp":
    ...]}}}``: what ``Mesh.counters()`` shows for each group, and their sum."""
    from .step import calls_traffic  # noqa: PLC0415
    from .tensor import topologies  # noqa: PLC0415

    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    T = step.tp
    d = step.p // (step.degree * T)
    tp_topo, dp_topo = topologies(d * T, T, per_node)
    p2p = []
    for msgs in step.messages:
        table = {s: [0, 0, 0, 0] for s in range(step.degree)}
        for m in msgs:
            row = table[m.src]
            row[0] += 1
            row[1] += 1
            row[2] += m.nbytes
            table[m.dest][0] += 1
        p2p.append(table)
    out = {}
    for r in (range(step.p) if ranks is None else ranks):
        s, i, j = groups_of(r, step)
        pp = {kind: dict(zip(FIELDS, p2p[j][s] if kind == "p2p" else [0, 0, 0, 0]))
              for kind in KINDS}
        native = step.overflow_agreement + len(step.step_calls)  # (MPI's: calls only)
        if native:
            pp["allreduce"].update(calls=native, native_calls=native)
        pp["total"] = {f: sum(pp[k][f] for k in KINDS) for f in FIELDS}
        groups = {"pp": pp, "dp": group_traffic(step.dp[s][j], dp_topo.per_node, ranks=[i],
                                                seg_bytes=seg_bytes)[i]}
        if T > 1:
            groups["tp"] = calls_traffic(step.tp_calls[s][j] * step.micro + step.step_calls,
                                         j, tp_topo, seg_bytes)
        summary = {k: {f: sum(g[k][f] for g in groups.values()) for f in FIELDS}
                   for k in (*KINDS, "total")}
        summary["groups"] = groups
        out[r] = summary
    return out


def step_time(step, compute, micro, machine, per_node, recompute=False, seg_bytes=None):
    """Predicted seconds of one step (``step.step_time``'s keys, and ``bubble``: the
    schedule's idle fraction), the slowest tp rank's (module doc)."""
    from .tensor import topologies  # noqa: PLC0415

    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    worst = None
    T = step.tp
    d = step.p // (step.degree * T)
    tp_topo, dp_topo = topologies(d * T, T, per_node)
    tp_links, dp_links = col.Links(machine, tp_topo), col.Links(machine, dp_topo)
    for j in range(T):
        t = _step_time(step, j, compute, micro, machine, per_node, recompute, seg_bytes,
                       tp_links, dp_links)
        if worst is None or t["total"] > worst["total"]:
            worst = t
    return worst


def _step_time(step, j, compute, micro, machine, per_node, recompute, seg_bytes, tp_links,
               dp_links):
    plan, P = step.plan, step.degree
    d = step.p // (P * step.tp)
    S = plan.virtual_stages
    keys = list(compute.layers)
    share = step.share[j] if step.share and step.share[j] else {}
    n = len(keys)
    in_pass = [[0.0, 0.0] for _ in range(S)]  # tp all-reduces per virtual stage and pass
    for s in range(P):
        for c in step.tp_calls[s][j]:
            layer = call_layer(c.name, n)
            v = next(v for v in range(S) if step.bounds[v] <= layer < step.bounds[v + 1])
            in_pass[v][c.phase != "forward-tp"] += col.time_allreduce(
                c.algorithm, tp_links, c.size, c.itemsize, seg_bytes)
    fwd, bwd = [], []
    for v in range(S):
        lo, hi = step.bounds[v], step.bounds[v + 1]
        fwd.append(micro * sum(compute.layers[k][0] * share.get(k, 1.0) for k in keys[lo:hi])
                   + in_pass[v][0])
        bwd.append(micro * sum(compute.layers[k][1] * share.get(k, 1.0) for k in keys[lo:hi])
                   + in_pass[v][1])
    if recompute:
        bwd = [b + f for f, b in zip(fwd, bwd)]
    weight = [0.0] * S
    if plan.split_backward:
        weight = [b / 2 for b in bwd]
        bwd = list(weight)
    world = col.Topology(step.p, max(1, min(per_node, step.p)))
    links = col.Links(machine, world)
    latency = 0.0
    for v, nbytes in enumerate(step.boundary_bytes[j]):  # (replica 0's stages)
        a = plan.place(v)[0] * d * step.tp
        b = plan.place(v + 1)[0] * d * step.tp
        latency = max(latency, links.message(world.node(a) != world.node(b), nbytes))
    timeline = plan.simulate(fwd, bwd, weight, latency)
    loss_bcast = math.ceil(math.log2(P)) * links.message(world.nodes > 1, 64)
    worst = None
    for s in range(P):
        spans = [sp for sp in timeline.spans if sp[0] == s]
        done = max((sp[5] for sp in spans), default=0.0)
        busy = sum(sp[5] - sp[4] for sp in spans)
        f_s = sum(sp[5] - sp[4] for sp in spans if sp[1] == "F")
        dp_s = sum(call_time(c, dp_links, seg_bytes) for c in step.dp[s][j].calls) \
            if d > 1 else 0.0
        held = sum(q.data.size for _, q in step.named[s][j]) / max(step.whole_params, 1)
        update = compute.update_s * held * step.dp[s][j].update_share
        skew = compute.cv * busy * slowest_of(d)
        total = done + dp_s + update + skew + loss_bcast
        sends = sum(1 for m in step.messages[j] if m.src == s)
        tp_f, tp_b = (step.micro * sum(x[k] for v, x in enumerate(in_pass)
                                       if plan.place(v)[0] == s) for k in (0, 1))
        t = {"forward": f_s - tp_f, "backward": busy - f_s - tp_b,
             "comm": dp_s + sends * latency + tp_f + tp_b,
             "exposed_comm": total - busy - update - skew + tp_f + tp_b, "update": update,
             "compression": 0.0, "skew": skew, "total": total, "bubble": timeline.bubble}
        if worst is None or t["total"] > worst["total"]:
            worst = t
    return worst

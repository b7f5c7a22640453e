"""Pipeline parallelism: the model's layers cut into stages over the mesh's ``pp`` axis.

``--pipeline-stages P`` cuts the model's top-level layer sequence into ``P * v``
contiguous pieces (``v`` = chunks per rank, 1 unless the schedule is interleaved),
balanced by cost: by default each layer's forward + backward time measured on the run's
first micro-batch (on world rank 0, broadcast, so every rank cuts alike), or a cost per
layer the user gives (``--stage-costs``). Every rank builds the whole model from the
seed, then keeps its pieces (the same ``Parameter`` objects, under their names in the
whole model, so checkpoints and parameter names do not depend on the layout); built
lazily (``mpidl.engine.lazy``, what ``mpidl train`` does), the layers of other stages are
never drawn.

A step runs the schedule's list of actions for this rank (``pipeline_schedule``): a
forward of a micro-batch through a chunk takes its input from the data (the first
stage) or from the previous stage, a backward its output gradient from the loss (the
last stage) or from the next stage. Messages are non-blocking sends and blocking
receives of exactly the message an action needs, tagged by (micro-batch, virtual stage,
direction); no rank relies on MPI's eager buffering, and the lists are deadlock-free by
construction (``pipeline_schedule``). The first message of a new micro-batch size
between two stages carries the shape (an object message); later ones are bare arrays.

The step is the same as one process accumulating gradients over the same micro-batches
(``schedule.MicroBatches``): each micro-batch's loss gradient is scaled by 1/M, and
every parameter's gradient is accumulated in micro-batch order whatever the schedule
(the plans keep backward in that order), so the parameters after a step are bitwise
those of one process. The loss is the last stage's, broadcast over the pipeline group.

``--schedule async`` (PipeDream-2BW) is the exception, by design: no flush, so a stage
carries the backwards of its last ``P - 1 - s`` micro-batches into the next step, where
they run with the weights their forwards saw (stashed at the update: two versions) and
into that step's gradient; each step applies the previous step's gradient, once its
backwards are all done (``W(t+1) = W(t) - lr grad f(W(t-1))``; the first step applies
none). It is then bitwise one process applying each step's gradient a step later. A
checkpoint drains the pipeline (runs the carried backwards: the arithmetic is the same,
only the timing changes) and keeps every rank's pending gradient, so a resumed run
continues exactly; the end of training drains and drops it.

``--recompute``: a forward keeps only the stage's input (and the layers' buffers as
they were: BatchNorm statistics, dropout counters); backward runs the forward again
from them, so the same masks are drawn and statistics are not counted twice.

Tied weights (``--tie-weights``: a ``TiedHead`` on the last stage reading the first
stage's ``Embedding`` weight): the stage that holds the Embedding owns the ``Parameter``
(its optimizer steps it, its data-parallel group syncs it, checkpoints keep it under
the Embedding's name); the head's stage computes with a copy it receives from the owner
at the start of every step (and of every evaluation batch), and after the head's
backward of each micro-batch sends that micro-batch's gradient to the owner, which adds
it just before the Embedding's backward of the same micro-batch. The owner's gradient
is then accumulated in one process's order (head, embedding, head, embedding, ...), so
the step is bitwise one process at any M; the price is one message of the weight's size
per micro-batch. ``--tied-exchange step`` does it Megatron-LM's way instead: the head
sums its gradient over the step and sends it once, after its last backward, and the
owner adds it after its own (M times fewer messages; for M > 1 the sum is rounded in
another order than one process's). Not built with ``async`` (its stashed weight
versions), ``--emulate-compute`` or ZeRO stage 3.

``--emulate-compute`` (benchmarks): each action sleeps for its measured time instead
of computing (still sending real arrays of the real shapes), so P stages overlap even
on a machine with fewer cores than ranks; the losses are then meaningless.
"""

import bisect
import time
from contextlib import contextmanager, nullcontext

import numpy as np

from mpidl import backend
from mpidl.backend import array_module, to_device, to_numpy
from mpidl.engine.attention import TiedHead
from mpidl.engine.lazy import drawn, is_lazy
from mpidl.engine.module import Parameter, Sequential, SparseGrad
from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime import pipeline_schedule

_clock = time.perf_counter

OPTIONS = [
    Option("pipeline_stages", int, 1, "pipeline parallelism: cut the model's layers into P "
           "stages on P ranks (data parallelism runs over ranks / P, / tensor-parallel)",
           "parallelism", metavar="P",
           check=lambda p: None if p >= 1 else "must be at least 1"),
    Option("pipeline_schedule", str, "1f1b", "pipeline schedule: gpipe, 1f1b, "
           "interleaved[:v], zb, or async (PipeDream-2BW: no flush, weights one step "
           "stale) (--schedule takes these names too)", "parallelism",
           metavar="NAME", shares="schedule", claims=pipeline_schedule.is_pipeline_schedule),
    Option("micro_batches", int, None, "micro-batches per step and data-parallel rank, "
           "the same as --accumulate M (--batch-size is the micro-batch)", "parallelism",
           metavar="M", check=lambda m: None if m >= 1 else "must be at least 1",
           same_as="accumulate"),
    Option("recompute", bool, False, "pipeline: keep only each stage's input per "
           "micro-batch and run its forward again in backward", "parallelism"),
    Option("emulate_compute", bool, False, "pipeline benchmarks: each stage sleeps its "
           "measured compute time instead of computing (losses are meaningless)",
           "parallelism"),
    Option("tied_exchange", str, "micro-batch", "tied weights on two pipeline stages: "
           "micro-batch (the head's gradient of each micro-batch goes to the embedding's "
           "stage: bitwise one process) or step (summed over the step and sent once, "
           "Megatron-LM's way: M times fewer messages, rounded differently)",
           "parallelism", choices=("micro-batch", "step")),
    Option("stage_costs", str, None, "how the pipeline stages are balanced: measured "
           "(default: each layer timed on the first batch), layers (equal cost), or one "
           "cost per top-level layer, comma-separated", "parallelism", metavar="COSTS"),
]


def check_degree(stages, tensor_parallel, ranks):
    """P x T must divide the ranks: one ConfigError line otherwise."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"--pipeline-stages must be a whole number >= 1, got {stages!r}")
    if ranks % (stages * tensor_parallel):
        what = (f"--pipeline-stages {stages}" if tensor_parallel == 1 else
                f"--pipeline-stages {stages} x --tensor-parallel {tensor_parallel} = "
                f"{stages * tensor_parallel}")
        raise ConfigError(f"{what} does not divide the {ranks} rank(s): launch a multiple "
                          "of it (data parallelism takes the rest)")
    return stages


def partition(costs, pieces):
    """Cut ``costs`` (one per layer) into ``pieces`` contiguous non-empty runs with the
    smallest largest sum; returns the ``pieces + 1`` boundaries. Ties go to the earliest
    cut, so the result depends on the costs only."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest sum cutting the first i layers into k pieces
    best = [[inf] * (n + 1) for _ in range(pieces + 1)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    best[0][0] = 0.0
    for k in range(1, pieces + 1):
        for i in range(k, n - (pieces - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12 * max(1.0, abs(v)):
                    best[k][i], cut[k][i] = v, j
    bounds = [n]
    for k in range(pieces, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def piece_of(bounds):
    """``name -> the piece of the cut at ``bounds`` (the virtual stage) that holds the
    parameter's top-level layer``: the fused buckets' ``part_of`` (``runtime.fusion``),
    so that with interleaved chunks no bucket holds two chunks' parameters; ``mpidl
    simulate`` lays its buckets out with the same function."""
    def piece(name):
        return bisect.bisect_right(bounds, int(name.split(".", 1)[0])) - 1
    return piece


def tied_pairs(layers, what):
    """``[(j, i)]``: top-level layer ``i`` is a ``TiedHead`` computing with the weight of
    the earlier layer ``j`` (``--tie-weights``), the one way stages can share a parameter
    (module doc); any other parameter held by two top-level layers is one ConfigError
    line, ``what`` naming the flag."""
    owner, pairs = {}, []
    for i, layer in enumerate(layers):
        for _, p in layer.named_parameters():
            j = owner.setdefault(id(p), i)
            if j == i:
                continue
            if not (isinstance(layer, TiedHead) and layer.weight is p):
                raise ConfigError(f"{what}: layers {j} and {i} share a parameter, which "
                                  "stages can share only as a TiedHead's weight tied to an "
                                  "earlier layer (--tie-weights): untie them")
            pairs.append((j, i))
    return pairs


class _Tie:
    """This rank's side of a tied weight whose two layers sit on different stages: the
    ``owner`` side (``param``: the Parameter it steps) or the ``head`` side (``param``:
    the copy the head computes with), on chunk ``chunk``; ``peer``: the other side's
    pipeline rank; the virtual stages of both sides name the messages' tags (the head's
    its gradients, the owner's the weight)."""

    def __init__(self, side, param, chunk, peer, head_vs, owner_vs):
        self.side, self.param, self.chunk, self.peer = side, param, chunk, peer
        self.head_vs, self.owner_vs = head_vs, owner_vs


def _snapshot(layer):
    """Copies of the buffers of ``layer`` and everything under it (BatchNorm statistics,
    dropout counters): what a forward changes besides its saved contexts."""
    return [(name, b.copy()) for name, b in layer.named_buffers() if hasattr(b, "copy")]


def _restore(layer, snapshot):
    for name, value in snapshot:
        layer.set_buffer(name, value.copy())


@contextmanager
def _deferring(layer, into):
    """Within the block, ``layer`` and everything under it append their weight-gradient
    computations to the list ``into`` instead of running them (``Layer.deferred_grads``)."""
    marked = [m for _, m in layer.modules()]
    for m in marked:
        m.deferred_grads = into
    try:
        yield
    finally:
        for m in marked:
            m.deferred_grads = None


class _Walk:
    """What one walk over a step's actions reads and counts."""

    def __init__(self, x, y, m, loss):
        self.x, self.y, self.m, self.loss = x, y, m, loss
        self.sends, self.spans = [], []
        self.total, self.fwd_s, self.bwd_s = 0.0, 0.0, 0.0
        self.peak = self.peak_bytes = 0
        self.t0 = _clock()


class Pipeline:
    """The pipeline part of a runtime, and the step's schedule (``run``)."""

    name = "pipeline"

    def __init__(self, stages, schedule="1f1b", micro_batches=1, recompute=False,
                 emulate_compute=False, stage_costs=None, tied_exchange="micro-batch"):
        self.degree = int(stages)
        self.kind, self.chunks = pipeline_schedule.parse(schedule)
        self.k = int(micro_batches)
        self.plan = pipeline_schedule.build(self.kind, self.degree, self.k, self.chunks)
        self.recompute = bool(recompute)
        # called before each forward and backward pass of a micro-batch (ZeRO stage 3
        # gathers its parameters afresh for each: ``zero.ParamGathers.new_pass``)
        self.pass_hook = None
        self.emulate = emulate_compute  # False, True (measured times) or {op: [s per chunk]}
        self.cost_spec = stage_costs
        self.zero_stage = 0         # set by the ZeRO preset (stage 3: no tied weights)
        self._ties = []             # this rank's _Tie sides (after cut)
        if tied_exchange not in ("micro-batch", "step"):
            raise ConfigError(f"--tied-exchange must be micro-batch or step, got "
                              f"{tied_exchange!r}")
        self.tied_per_step = tied_exchange == "step"
        self.group = None
        self.rank = 0
        self.bounds = None          # layer boundaries of the P * v pieces
        self.costs = None           # the cost per layer the cut was balanced with
        self.cost_source = None
        self.times = None           # measured {"F"|"B"|"W": [seconds per virtual stage]}
        self.whole_shapes = None
        # the schedule's per-step figures (the runtime reads them like MicroBatches')
        self.measure_activations = False
        self.activation_bytes = 0
        self.forward_s = self.backward_s = self.straggle_s = 0.0
        # this replica's share of the global batch over the mean share (set by the
        # trainer when a run keeps its global batch on replicas that do not divide it)
        self.grad_weight = 1.0
        self.peak_in_flight = 0
        self.busy_s = self.step_s = 0.0
        self._totals = [0.0, 0.0]   # busy and step seconds since the last metrics()
        self.spans = []
        # what a step leaves for the next (async; empty after a step of the others)
        self._batch = 0             # steps run: micro-batch mb of this step is number
                                    # _batch * M + mb (its layers' contexts, its tags)
        self._kept, self._outputs, self._grads, self._deferred = {}, {}, {}, {}
        self._held = 0              # forwards whose backward has not run
        self._open = False          # async: the previous step's backwards are carried
        self._prev_grads = None     # async: {name: gradient} of the previous step
        self._stash = None          # async: {name: weights} the previous step ran with
        self.weight_versions = 1    # async: the most weight versions held (2BW: 2)
        self._later_sends, self._carried_sends = [], []

    # -- set-up
    def check(self, model):
        """Local: the model can be cut into this many pieces (ConfigError otherwise)."""
        layers = getattr(model, "layers", None)
        if not isinstance(model, Sequential) or not layers:
            raise ConfigError(f"--pipeline-stages {self.degree}: the model must be a "
                              "Sequential of layers to cut into stages, got "
                              f"{type(model).__name__}")
        pieces = self.degree * self.chunks
        if len(layers) < pieces:
            what = (f"--pipeline-stages {self.degree}" if self.chunks == 1 else
                    f"--pipeline-stages {self.degree} with --schedule interleaved:"
                    f"{self.chunks} ({pieces} chunks)")
            raise ConfigError(f"{what} needs at least {pieces} top-level layers to place, "
                              f"but the model has {len(layers)}: use fewer stages"
                              + (" or chunks" if self.chunks > 1 else "")
                              + " or a deeper model")
        tied = tied_pairs(layers, f"--pipeline-stages {self.degree}")
        if self.tied_per_step and not tied:
            raise ConfigError("--tied-exchange step: the model has no tied weights "
                              "(--tie-weights) for it to exchange")
        if tied:
            refuse = {"--schedule async": self.kind == "async",
                      "--emulate-compute": bool(self.emulate),
                      "--zero 3": self.zero_stage == 3}
            for flag, bad in refuse.items():
                if bad:
                    raise ConfigError(f"--pipeline-stages {self.degree} with tied weights "
                                      f"(--tie-weights) and {flag} is not built yet: drop "
                                      "one of them")
        spec = self.cost_spec
        if spec not in (None, "", "measured", "layers"):
            self._parse_costs(spec, len(layers))

    def _parse_costs(self, spec, n):
        try:
            costs = [float(c) for c in str(spec).split(",")]
        except ValueError:
            raise ConfigError(f"--stage-costs {spec!r}: expected measured, layers, or one "
                              f"number per top-level layer ({n}), comma-separated") from None
        if len(costs) != n or any(not (c >= 0 and c < float("inf")) for c in costs):
            raise ConfigError(f"--stage-costs: expected {n} costs >= 0 (one per top-level "
                              f"layer), got {len(costs)}: {spec!r}")
        return costs

    def setup(self, model):
        """(As a schedule: the cut sets every chunk's input-gradient flag; nothing to
        do here.)"""

    def cut(self, model, optimizer, group, world, sample=None, tp=None):
        """Collective: decide the cut (the same on every rank), keep this rank's pieces
        of ``model`` and of ``optimizer`` (the runtime ran ``check`` before)."""
        self.group, self.rank = group, group.rank
        layers = list(model.layers)
        n = len(layers)
        spec = self.cost_spec
        measured = None
        if spec in (None, "", "measured") and sample is not None:
            self.cost_source = "measured"
        elif spec in (None, "", "measured", "layers"):
            self.cost_source = "one per layer" + ("" if spec == "layers" else
                                                  " (no batch to time them on)")
        else:
            self.cost_source = "given"
        # (emulated compute needs the times, and the shapes the stages send, in any case)
        if sample is not None and (self.cost_source == "measured" or self.emulate):
            # world rank 0's times are used; the other ranks time the layers too only
            # where a layer's forward is collective (tensor parallelism)
            if tp is not None or world is None or world.rank == 0:
                measured = self._measure(layers, sample)
            if world is not None:
                with world.waiting("in the broadcast of measured layer times (pipeline)"):
                    measured = world.mpi.bcast(measured, root=0)
        if self.cost_source == "measured":
            self.costs = [f + b + w for f, b, w in zip(*measured[:3])]
        elif self.cost_source == "given":
            self.costs = self._parse_costs(spec, n)
        else:
            self.costs = [1.0] * n
        S = self.plan.virtual_stages
        self.bounds = partition(self.costs, S)
        if measured is not None:
            self.times = {op: [sum(t[self.bounds[v]:self.bounds[v + 1]]) for v in range(S)]
                          for op, t in zip("FBW", measured[:3])}
            self._shapes_measured = measured[3]
        if self.emulate and measured is None:
            raise ConfigError("--emulate-compute needs the layers timed on a batch (their "
                              "times, and the shapes the stages send): set the runtime's "
                              "sample_batch = (x, y) before setup (mpidl train does)")
        self.whole_shapes = (tp.full_shapes(model) if tp is not None else
                             {k: tuple(v.shape) for k, v in model.state_dict().items()})
        self._check_tags()
        P = self.degree
        self._ties = self._cut_ties(layers)
        # keep my chunks: virtual stage c * P + rank
        mine = []
        self.chunk_layers = []
        for c in range(self.chunks):
            v = c * P + self.rank
            lo, hi = self.bounds[v], self.bounds[v + 1]
            chunk = Sequential(*layers[lo:hi], names=range(lo, hi))
            chunk.needs_input_grad = v > 0
            self.chunk_layers.append(chunk)
            mine += list(range(lo, hi))
        model.layers = [layers[i] for i in mine]
        model.names = [str(i) for i in mine]
        kept = dict(model.named_parameters())
        self._params = list(kept.items())
        if optimizer is not None:
            optimizer.params = type(optimizer.params)(
                (k, p) for k, p in optimizer.params.items() if k in kept)
            optimizer.state = {k: v for k, v in optimizer.state.items() if k in kept}
        # receive buffers on the device of the model (a stage may hold no parameter)
        self._xp = next((array_module(p.data) for p in kept.values()), backend.xp())
        self._told, self._shapes = set(), {}
        self._emulated = {}
        self._sleep_s = self._emulated_times() if self.emulate else None

    def _cut_ties(self, layers):
        """This rank's sides of the tied weights the cut puts on two stages; the head's
        layer gets a copy of the weight that is no parameter of its stage (module doc)."""
        piece, place = piece_of(self.bounds), self.plan.place
        ties = []
        for j, i in tied_pairs(layers, f"--pipeline-stages {self.degree}"):
            owner_vs, head_vs = piece(str(j)), piece(str(i))
            if owner_vs == head_vs:
                continue  # one piece: one process's order as it is
            (owner, owner_chunk), (head, head_chunk) = place(owner_vs), place(head_vs)
            if owner == head:
                raise ConfigError(f"--pipeline-stages {self.degree}: the tied layers {j} "
                                  f"and {i} land on two chunks of stage {owner}, which is "
                                  "not built: use another --schedule or untie them")
            p = layers[i].weight  # (the TiedHead holds the Parameter itself)
            if self.rank == owner:
                ties.append(_Tie("owner", p, owner_chunk, head, head_vs, owner_vs))
            elif self.rank == head:
                copy = Parameter(to_device(p.data.values()) if is_lazy(p.data) else
                                 p.data.copy(), placement=p.placement)
                layers[i].weight = copy
                del layers[i]._params["weight"]
                ties.append(_Tie("head", copy, head_chunk, owner, head_vs, owner_vs))
        return ties

    def _share_tied(self, sends):
        """The owners' tied weights to the heads' copies (a step's or an evaluation's
        start): the owner sends, the head waits for it."""
        for t in self._ties:
            tag = self._tied_tag(None, t.owner_vs)
            if t.side == "owner":
                sends.append(self.group.isend(t.param.data, t.peer, tag))
            else:
                self.group.recv(t.param.data, t.peer, tag)

    def _recv_tied(self, key, c):
        """Owner: ``[(Parameter, the head's gradient of micro-batch key)]`` for this
        chunk's backward of it, to add before that backward (one process's order);
        ``key`` None: the head's sum over the step (``--tied-exchange step``), for every
        chunk."""
        out = []
        if self.tied_per_step != (key is None):
            return out
        for t in self._ties:
            if t.side == "owner" and (key is None or t.chunk == c):
                data = t.param.data
                buf = self._xp.empty(data.shape, dtype=data.dtype)
                tag = self._tied_tag(key, t.head_vs)
                out.append((t.param, self.group.recv(buf, t.peer, tag)))
        return out

    def _send_tied(self, key, c, sends):
        """Head: send micro-batch ``key``'s gradient of the tied weight to its owner (key
        None: the sum over the step, ``--tied-exchange step``)."""
        if self.tied_per_step != (key is None):
            return
        for t in self._ties:
            if t.side == "head" and (key is None or t.chunk == c):
                g, t.param.grad = t.param.grad, None
                tag = self._tied_tag(key, t.head_vs)
                sends.append(self.group.isend(g, t.peer, tag))

    def part_of(self):
        """The fused buckets' ``part_of`` for this rank's chunks (after ``cut``)."""
        return piece_of(self.bounds)

    def _check_tags(self):
        from mpidl.comm.p2p import _tag_ub  # noqa: PLC0415

        need = 4 * self._tag_span * self.plan.virtual_stages
        if need > _tag_ub():
            raise ConfigError(f"--micro-batches {self.k} with {self.plan.virtual_stages} "
                              f"pipeline stages needs {need} message tags, more than this "
                              f"MPI allows ({_tag_ub()}): use fewer micro-batches")

    def _measure(self, layers, sample):
        """Per layer: forward, input-gradient and weight-gradient seconds on ``sample``
        (the best of three), and the output shape and dtype; nothing of the model is
        changed (buffers restored, gradients and contexts dropped). A lazily built
        layer's parameters are drawn for its forward and for its backward only, and each
        layer's gradients are dropped once timed, so no more than one layer's parameters
        and gradients are held at a time."""
        x = sample[0]
        snap = [_snapshot(layer) for layer in layers]
        fwd, bwd, wgt = [np.inf] * len(layers), [np.inf] * len(layers), [np.inf] * len(layers)
        shapes = []
        for rep in range(3):
            h, outs = x, []
            for i, layer in enumerate(layers):
                with drawn(layer), layer.micro_batch("measure"):
                    t = _clock()
                    h = layer(h)
                    fwd[i] = min(fwd[i], _clock() - t)
                outs.append(h)
            if rep == 0:
                shapes = [(tuple(o.shape), str(o.dtype)) for o in outs]
            dy = outs[-1].copy()
            for i in range(len(layers) - 1, -1, -1):
                layer = layers[i]
                deferred = []
                with drawn(layer):
                    with _deferring(layer, deferred), layer.micro_batch("measure"):
                        t = _clock()
                        dy = layer.backprop(dy)
                        bwd[i] = min(bwd[i], _clock() - t)
                    t = _clock()
                    for fn in deferred:
                        fn()
                    wgt[i] = min(wgt[i], _clock() - t)
                for _, p in layer.named_parameters():  # timed: no layer's gradient is kept
                    p.grad = None
                if dy is None:
                    for earlier in layers[:i]:
                        with earlier.micro_batch("measure"):
                            earlier.discard_saved()
                    break
        for layer, s in zip(layers, snap):
            _restore(layer, s)
            for _, p in layer.named_parameters():
                p.grad = None
        fwd, bwd, wgt = ([0.0 if v == np.inf else float(v) for v in t] for t in (fwd, bwd, wgt))
        return fwd, bwd, wgt, shapes

    # -- a step
    @property
    def _tag_span(self):
        """Micro-batch numbers whose messages can be in flight at once: a step's, and
        (async) the previous step's."""
        return self.k * (2 if self.plan.flushless else 1)

    def _tag(self, key, vs, kind):
        mb = key % self._tag_span
        # kind 0: activation, 1: its gradient, 2: a shape, 3: a tied weight or its gradient
        return (mb * self.plan.virtual_stages + vs) * 4 + kind

    def _tied_tag(self, key, vs):
        """The tag of a tied weight's message (kind 3) for micro-batch ``key``, named by
        the sending side's virtual stage ``vs`` (the owner's weight, the head's gradient),
        which keeps the two directions apart. ``key`` None, a once-per-step message (the
        weight's share, ``--tied-exchange step``'s sum), takes micro-batch 0's slot: a
        run sends its gradients either per step or per micro-batch, never both."""
        return self._tag(0 if key is None else key, vs, 3)

    def _send_act(self, out, mb, vs, m, sends):
        dest = self.plan.place(vs + 1)[0]
        key = (vs, m)
        if key not in self._told:
            self._told.add(key)
            sends.append(self.group.isend_obj((tuple(out.shape), str(out.dtype)), dest,
                                              self._tag(mb, vs, 2)))
        sends.append(self.group.isend(out, dest, self._tag(mb, vs, 0)))

    def _recv_act(self, mb, vs, m):
        src = self.plan.place(vs - 1)[0]
        key = (vs - 1, m)
        if key not in self._shapes:
            (shape, dtype), _, _ = self.group.recv_obj(src, self._tag(mb, vs - 1, 2))
            self._shapes[key] = (shape, dtype)
        shape, dtype = self._shapes[key]
        buf = self._xp.empty(shape, dtype=dtype)
        return self.group.recv(buf, src, self._tag(mb, vs - 1, 0))

    def _recv_grad(self, mb, vs, like):
        src = self.plan.place(vs + 1)[0]
        buf = self._xp.empty(like[0], dtype=like[1])
        return self.group.recv(buf, src, self._tag(mb, vs + 1, 1))

    def _sleep(self, seconds, sends):
        """Emulated compute: sleep, testing the sends in flight every millisecond so
        MPI moves them on meanwhile (as a device would compute while the host talks)."""
        end = _clock() + seconds
        while True:
            left = end - _clock()
            if left <= 0:
                return
            for s in sends:
                if not s.done:
                    s.test()
            time.sleep(min(left, 1e-3))

    def _emulated_times(self):
        """{op: seconds per virtual stage} the emulation sleeps: the times given, or the
        measured ones (whose B is the input-gradient pass: without a split backward, the
        backward pass is B + W)."""
        if isinstance(self.emulate, dict):
            return {op: list(self.emulate.get(op, [0.0] * self.plan.virtual_stages))
                    for op in "FBW"}
        t = self.times
        if self.plan.split_backward:
            return dict(t)
        return {"F": t["F"], "B": [b + w for b, w in zip(t["B"], t["W"])], "W": t["W"]}

    def _zeros(self, shape, dtype):
        key = (tuple(shape), str(dtype))
        if key not in self._emulated:
            self._emulated[key] = self._xp.zeros(shape, dtype=dtype)
        return self._emulated[key]

    @property
    def gradients_ready(self):
        """Whether this step ends with a gradient to apply: always, but for an async
        pipeline's first step (nothing of an earlier step to apply yet)."""
        return not self.plan.flushless or self._prev_grads is not None

    def run(self, model, loss, x, y, arm=None):
        """One step of this rank's actions; returns the mean loss over the M
        micro-batches (the last stage's, broadcast over the pipeline group)."""
        plan, M, r = self.plan, self.k, self.rank
        S = plan.virtual_stages
        n = len(y)
        if n % M:
            raise ValueError(f"a batch of {n} samples does not split into --micro-batches "
                             f"{M} equal micro-batches")
        # (async: the first step, and the first after a drain, carry nothing in)
        actions = plan.opening[r] if plan.flushless and not self._open else plan.actions[r]
        walk = _Walk(x, y, n // M, loss)
        if self._ties:
            self._share_tied(walk.sends)
        self._walk(actions, walk)
        if self._ties and self.tied_per_step:  # the head's sum, after both sides' backwards
            self._send_tied(None, None, walk.sends)
            for p, g in self._recv_tied(None, None):
                p.accumulate(g)
        if plan.flushless:
            self._turn_over()
        else:
            self._batch += 1
        self._wait_sends(walk.sends)
        self.step_s = _clock() - walk.t0
        self.busy_s = walk.fwd_s + walk.bwd_s
        self._totals[0] += self.busy_s
        self._totals[1] += self.step_s
        self.spans = walk.spans
        self.forward_s, self.backward_s = walk.fwd_s, walk.bwd_s
        self.peak_in_flight = max(self.peak_in_flight, walk.peak)
        if self.measure_activations:
            self.activation_bytes = max(self.activation_bytes, walk.peak_bytes)
        last = plan.place(S - 1)[0]
        with self.group.waiting("in the broadcast of the step's loss from the last stage"):
            total = self.group.mpi.bcast(walk.total if r == last else None, root=last)
        return total / M

    def _walk(self, actions, walk):
        """Run ``actions`` of this rank; ``mb`` < 0 (async) is micro-batch M + mb of the
        previous step, run with the weights and into the gradients of that step."""
        plan, M, P, S = self.plan, self.k, self.degree, self.plan.virtual_stages
        emulate = bool(self.emulate)
        m = walk.m
        for op, mb, c in actions:
            vs = c * P + self.rank
            chunk = self.chunk_layers[c]
            key = self._batch * M + mb  # the micro-batch's number since the start
            if op == "F":
                inp = walk.x[mb * m:(mb + 1) * m] if vs == 0 else self._recv_act(key, vs, m)
                t0 = _clock()
                if emulate:
                    self._sleep(self._sleep_s["F"][vs], walk.sends)
                    shape, dtype = self._emulated_out(vs, m)
                    out = self._zeros(shape, dtype)
                    self._kept[(key, c)] = inp
                else:
                    out = self._forward(chunk, key, c, inp, self._kept)
                if vs == S - 1:
                    if not emulate:
                        ys = walk.y[mb * m:(mb + 1) * m]
                        walk.total += float(walk.loss.forward(out, ys))
                        dy = walk.loss.backward()
                        if M > 1:
                            dy *= 1.0 / M
                        if self.grad_weight != 1.0:
                            dy *= self.grad_weight
                    else:
                        dy = out
                    self._grads[key, c] = dy
                else:
                    self._outputs[key, c] = (tuple(out.shape), out.dtype)
                    self._send_act(out, key, vs, m, walk.sends)
                t1 = _clock()
                walk.fwd_s += t1 - t0
                self._held += 1
                walk.peak = max(walk.peak, self._held)
                if self.measure_activations:
                    walk.peak_bytes = max(walk.peak_bytes, self._held_bytes(self._kept, walk.x))
            elif op == "B":
                dy = self._grads.pop((key, c)) if vs == S - 1 else self._recv_grad(
                    key, vs, self._outputs.pop((key, c)))
                tied = self._recv_tied(key, c) if self._ties else ()
                t0 = _clock()
                if emulate:
                    self._sleep(self._sleep_s["B"][vs], walk.sends)
                    inp = self._kept.pop((key, c))
                    dx = self._zeros(inp.shape, inp.dtype) if vs > 0 else None
                elif mb < 0:
                    with self._previous_version():
                        dx = self._backward(chunk, key, c, dy, self._kept, self._deferred)
                elif self._ties:
                    for p, g in tied:  # the head's part first, as one process adds it
                        p.accumulate(g)
                    dx = self._backward(chunk, key, c, dy, self._kept, self._deferred)
                    self._send_tied(key, c, walk.sends)
                else:
                    dx = self._backward(chunk, key, c, dy, self._kept, self._deferred)
                t1 = _clock()
                walk.bwd_s += t1 - t0
                self._held -= 1
                if vs > 0:
                    req = self.group.isend(dx, plan.place(vs - 1)[0], self._tag(key, vs, 1))
                    # async: the previous stage may take it only in the next step
                    later = plan.flushless and mb >= M - plan.carried(plan.place(vs - 1)[0])
                    (self._later_sends if later else walk.sends).append(req)
                walk.spans.append((op, mb, c, t0 - walk.t0, t1 - walk.t0))
                continue
            else:  # the weight-gradient pass
                t0 = _clock()
                if emulate:
                    self._sleep(self._sleep_s["W"][vs], walk.sends)
                else:
                    for fn in self._deferred.pop((key, c)):
                        fn()
                t1 = _clock()
                walk.bwd_s += t1 - t0
            walk.spans.append((op, mb, c, t0 - walk.t0, t1 - walk.t0))

    def _wait_sends(self, sends):
        """Wait for this step's sends (the next stage took them in this step), and for
        the previous step's that waited for it (async)."""
        carried, self._carried_sends = self._carried_sends, self._later_sends
        self._later_sends = []
        for s in carried + sends:
            s.wait()

    # -- async (PipeDream-2BW)
    @contextmanager
    def _previous_version(self):
        """Within the block the parameters hold the stashed weights, and gradients go to
        the previous step's: a backward of a micro-batch that ran forward before the
        last update."""
        params = self._params
        live = [(p.data, p.grad) for _, p in params]
        for name, p in params:
            p.data, p.grad = self._stash[name], self._prev_grads.get(name)
        try:
            yield
        finally:
            for (name, p), (data, grad) in zip(params, live):
                self._prev_grads[name] = p.grad
                p.data, p.grad = data, grad

    def _turn_over(self):
        """After an async step's actions: the previous step's gradient is complete and
        goes to the parameters for this step's update (none after the first step); this
        step's (partial where backwards are carried) waits for the next step; the weights
        this step ran with are stashed for its carried backwards."""
        ready = self._prev_grads
        self._prev_grads = {name: p.grad for name, p in self._params}
        for name, p in self._params:
            p.grad = None if ready is None else ready.get(name)
        self._open = True
        self._batch += 1
        if self.plan.carried(self.rank):
            if self._stash is None:
                self._stash = {name: p.data.copy() for name, p in self._params}
            else:  # the previous stash is done with: reuse its memory
                for name, p in self._params:
                    self._stash[name][...] = p.data
        self.weight_versions = max(self.weight_versions, 1 + (self._stash is not None))

    def drain(self):
        """async: run the backwards the last step carried (its gradient is then complete,
        in ``pending_gradient``) and wait for every message, so nothing is left in flight;
        the next step starts a new pipeline and applies that gradient. A no-op otherwise,
        or when nothing is carried."""
        if not self.plan.flushless or not self._open:
            return
        walk = _Walk(None, None, 0, None)
        self._walk(self.plan.closing[self.rank], walk)
        self._open = False
        self._wait_sends(walk.sends)
        self._wait_sends([])

    def discard_pending(self):
        """After ``drain``: forget the last step's gradient (the end of training)."""
        self._prev_grads = None

    def pending_state(self):
        """async, for a checkpoint: ``drain`` (collective over the pipeline group), then
        the gradient the next step applies, this rank's own (before the data-parallel
        reduction), as host arrays {name: array, or {indices, values, shape} for a
        row-sparse one}; None when nothing is pending."""
        self.drain()
        if self._prev_grads is None:
            return None
        out = {}
        for name, g in self._prev_grads.items():
            if isinstance(g, SparseGrad):
                out[name] = {"indices": to_numpy(g.indices), "values": to_numpy(g.values),
                             "shape": list(g.shape)}
            elif g is not None:
                out[name] = to_numpy(g)
        return out

    def resume_pending(self, grads):
        """Take back what ``pending_state`` saved: the next step applies it, as the step
        after the checkpoint would have (None: the next step is a first step)."""
        self._open = False
        if grads is None:
            self._prev_grads = None
            return
        xp = self._xp
        out = {name: None for name, _ in self._params}
        for name, g in grads.items():
            if name not in out:
                raise ConfigError(f"checkpoint: the pending gradient of {name!r} belongs to "
                                  f"no parameter of pipeline stage {self.rank}")
            # (copies: arrays of their own, not views of the checkpoint file's buffer)
            out[name] = (SparseGrad(xp.array(g["indices"]), xp.array(g["values"]),
                                    g["shape"]) if isinstance(g, dict) else xp.array(g))
        self._prev_grads = out

    def _emulated_out(self, vs, m):
        shape, dtype = self._shapes_measured[self.bounds[vs + 1] - 1]
        return (m,) + tuple(shape[1:]), dtype

    def _held_bytes(self, kept, batch):
        """Bytes of activations this rank holds for backward: the chunks' saved contexts
        (each array once), or with recompute the stage inputs kept; the step's input
        batch, held by the caller anyway, is not counted."""
        total = sum(ch.activation_nbytes(exclude=(batch,)) for ch in self.chunk_layers)
        if self.recompute or self.emulate:
            total += sum(int(v[0].nbytes if isinstance(v, tuple) else v.nbytes)
                         for v in kept.values())
        return total

    def _forward(self, chunk, mb, c, inp, kept):
        if self.pass_hook is not None:
            self.pass_hook()
        if not self.recompute:
            with chunk.micro_batch(mb):
                return chunk(inp)
        before = _snapshot(chunk)
        with chunk.micro_batch(mb):
            out = chunk(inp)
            chunk.discard_saved()
        kept[mb, c] = (inp, before)
        return out

    def _backward(self, chunk, mb, c, dy, kept, deferred):
        if self.pass_hook is not None:
            self.pass_hook()
        if self.recompute:  # the forward again, from the input and the buffers it saw
            inp, before = kept.pop((mb, c))
            now = _snapshot(chunk)
            _restore(chunk, before)
            with chunk.micro_batch(mb):
                chunk(inp)
            _restore(chunk, now)
        defer = nullcontext()
        if self.plan.split_backward:  # the weight gradients wait for this W pass
            deferred[mb, c] = []
            defer = _deferring(chunk, deferred[mb, c])
        with defer, chunk.micro_batch(mb):
            return chunk.backprop(dy)

    # -- evaluation
    def forward_eval(self, x):
        """A whole batch through the pipeline (no micro-batches): every chunk in
        virtual-stage order; the last stage returns the output, the others None."""
        P, S = self.degree, self.plan.virtual_stages
        n = len(x)
        out = None
        sends = []
        if self._ties:
            self._share_tied(sends)
        for c, chunk in enumerate(self.chunk_layers):
            vs = c * P + self.rank
            inp = x if vs == 0 else self._recv_act(0, vs, ("eval", n))
            with chunk.micro_batch("eval"):
                out = chunk(inp)
                chunk.discard_saved()
            if vs < S - 1:
                self._send_act(out, 0, vs, ("eval", n), sends)
                out = None
        for s in sends:
            s.wait()
        return out

    def eval_sums(self, inner, model, x, y):
        """The task's sums of one evaluation batch, computed on the last stage and
        broadcast over the pipeline group."""
        out = self.forward_eval(x)
        last = self.plan.place(self.plan.virtual_stages - 1)[0]
        sums = inner(lambda _x: out, x, y) if self.rank == last else None
        with self.group.waiting("in the broadcast of evaluation sums from the last stage"):
            return self.group.mpi.bcast(sums, root=last)

    # -- the whole model
    def gather_state(self, model_state, opt_state):
        """Collective over the pipeline group: every stage's (model state, optimizer
        state) joined on the group's first rank (None elsewhere)."""
        g = self.group
        with g.waiting("in the gather of pipeline stages' states (checkpoint or --save)"):
            pieces = g.mpi.gather((model_state, opt_state), root=0)
        if g.rank != 0:
            return None, None
        model_out, opt_out = {}, None
        for ms, os_ in pieces:
            model_out.update(ms or {})
            if os_ is not None:
                if opt_out is None:
                    opt_out = dict(os_, state={})
                opt_out["state"].update(os_.get("state", {}))
        order = list(self.whole_shapes)
        model_out = {k: model_out[k] for k in order if k in model_out}
        return model_out, opt_out

    # -- reports
    def params_outside_passes(self):
        """Names of this rank's parameters the pipeline reads or swaps outside their
        layers' forward and backward, which must stay float32 arrays between steps (mixed
        precision's 2-byte working copies skip them): all of them under the async
        schedule (2BW stashes the weights and swaps them in), a tied weight's owner side
        (sent to the head at a step's start)."""
        if self.plan.flushless:
            return {name for name, _ in self._params}
        owned = {id(t.param) for t in self._ties if t.side == "owner"}
        return {name for name, p in self._params if id(p) in owned}

    def memory(self, ledger):
        """The head's copies of tied weights (``mem_comm``: received each step, no
        parameter of this stage)."""
        ledger.add("mem_comm", [t.param.data for t in self._ties if t.side == "head"])

    def describe(self):
        P, v = self.degree, self.chunks
        lines = [f"pipeline: {P} stages, schedule {self.kind}"
                 + (f" with {v} chunks per rank" if v > 1 else "")
                 + f", {self.k} micro-batch(es) per step"
                 + (", no flush: weights one step stale (PipeDream-2BW)"
                    if self.plan.flushless else "")
                 + (", recomputing activations" if self.recompute else "")
                 + ((", tied weights: the head's gradient sent to the embedding's stage "
                     + ("once per step" if self.tied_per_step else "per micro-batch"))
                    if self._ties else "")
                 + (", compute emulated by sleeps" if self.emulate else "")]
        return lines

    def start_lines(self):
        """The cut, printed before training: which layers each stage holds, at what
        cost."""
        P = self.degree
        unit = "ms" if self.cost_source == "measured" else ""
        scale = 1e3 if unit else 1.0
        lines = self.describe()
        lines.append(f"pipeline stages balanced by {self.cost_source} cost:")
        for vs in range(self.plan.virtual_stages):
            lo, hi = self.bounds[vs], self.bounds[vs + 1]
            cost = sum(self.costs[lo:hi]) * scale
            rank, chunk = vs % P, vs // P
            where = f"stage {rank}" + (f" chunk {chunk}" if self.chunks > 1 else "")
            layers = f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}"
            lines.append(f"  {where}: {layers}, cost {cost:.3g}{unit and ' ' + unit}")
        return lines

    def metrics(self):
        """The epoch line's figures: stages, the most micro-batches this stage held, and
        its idle share of the steps since the last call (1 - busy / step: the bubble as
        this stage saw it, message waits included)."""
        busy, step = self._totals
        self._totals = [0.0, 0.0]
        out = {"pipeline_stages": self.degree, "pipeline_in_flight": self.peak_in_flight}
        if self.plan.flushless:
            out["pipeline_weight_versions"] = self.weight_versions
        if step > 0:
            out["pipeline_idle"] = 1.0 - busy / step
        return out

"""Pipeline schedules as data: which pass each stage runs, in which order.

A schedule is, for every pipeline rank, an ordered list of actions ``(op, mb, chunk)``:
``op`` is ``"F"`` (forward of micro-batch ``mb`` through the rank's model chunk
``chunk``), ``"B"`` (its backward) or, when the schedule splits backward (zero-bubble),
``"B"`` for the input-gradient pass and ``"W"`` for the weight-gradient pass. Chunk
``c`` of rank ``r`` is *virtual stage* ``c * P + r`` (Megatron's interleaving: the model
is cut into ``P * v`` pieces dealt round-robin over the ranks).

The same ``Plan`` runs the pipeline (``mpidl.runtime.pipeline`` walks its rank's list,
blocking only on the message an action needs) and predicts its timeline
(``Plan.simulate`` with per-stage times and a message latency). A list is deadlock-free
when its simulation finishes: every action then waits only for actions that started
earlier in a global order, whatever the real times are. ``build`` checks it.

Every schedule runs each chunk's backward passes in micro-batch order, and the weight
gradients too: a parameter's gradient is then accumulated in the same order as one
process accumulating over the same micro-batches, so the result is bitwise the same.

* ``gpipe``: all forwards, then all backwards; M micro-batches' activations held.
* ``1f1b`` (PipeDream-Flush): stage ``s`` runs ``P - s - 1`` warm-up forwards, then
  one forward and one backward in turn, then the remaining backwards; at most
  ``min(P - s, M)`` micro-batches held.
* ``interleaved:v`` (Megatron): ``v`` chunks per rank, forwards in groups of ``P``
  micro-batches per chunk; warm-up ``2 (P - r - 1) + (v - 1) P`` (raised, when the
  micro-batches do not fill the last group, to the least that runs: ``build`` finds it).
* ``zb`` (zero-bubble, ZB-H1 style): backward split into the input-gradient pass ``B``,
  which the previous stage waits for, and the weight-gradient pass ``W``, which waits for
  nobody: ``W`` fills the time a stage would idle, at most ``P - 1 - s`` of them pending
  (so activations held stay those of 1F1B). The order is found by a greedy simulation
  with unit times: ``B`` first, then ``F`` (while under 1F1B's limit), then ``W``.
* ``async`` (PipeDream-2BW): 1F1B without the flush. Stage ``s`` runs each of the
  step's forwards followed by the backward ``P - 1 - s`` micro-batches behind it, so the
  last ``P - 1 - s`` backwards of a step run at the start of the next one (negative
  ``mb``: micro-batch ``M + mb`` of the previous step). ``opening`` is the first step
  (nothing carried over) and ``closing`` the backwards left at the end (the drain). A
  step's micro-batches run with the weights of the step's start, stashed for the
  backwards that come after the update: two weight versions at most (one on the last
  stage), and the update is PipeDream-2BW's ``W(t+1) = W(t) - lr grad f(W(t-1))``.
  Needs ``M >= P - 1``, so a micro-batch's backward comes back within the next step.
"""

import math

from mpidl.errors import ConfigError

KINDS = ("gpipe", "1f1b", "interleaved", "zb", "async")


def parse(spec):
    """``"interleaved:2"`` -> ("interleaved", 2); ``"1f1b"`` -> ("1f1b", 1)."""
    text = str(spec).strip().lower()
    kind, _, chunks = text.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--schedule {spec!r}: pipeline schedules are gpipe, 1f1b, "
                          "interleaved[:v] (v model chunks per rank, default 2), zb and async")
    if kind != "interleaved":
        if chunks:
            raise ConfigError(f"--schedule {spec!r}: only interleaved takes a number of "
                              "chunks (interleaved:v)")
        return kind, 1
    try:
        v = int(chunks) if chunks else 2
    except ValueError:
        raise ConfigError(f"--schedule {spec!r}: v in interleaved:v is a whole number of "
                          "model chunks per rank, e.g. interleaved:2") from None
    if v < 2:
        raise ConfigError(f"--schedule {spec!r}: interleaving needs v >= 2 chunks per rank "
                          "(v = 1 is 1f1b)")
    return kind, v


def is_pipeline_schedule(value):
    return str(value).strip().lower().partition(":")[0] in KINDS


class Plan:
    """The actions of every pipeline rank (``actions[r]``) for ``P`` stages, ``M``
    micro-batches and ``v`` chunks per rank."""

    def __init__(self, kind, stages, micro_batches, chunks, actions):
        self.kind, self.P, self.M, self.v = kind, stages, micro_batches, chunks
        self.actions = actions
        self.split_backward = kind == "zb"
        self.flushless = kind == "async"
        self.warmup = None  # interleaved: warm-up forwards per rank
        self.opening = self.closing = None  # async: the first step's lists, the drain's

    @property
    def virtual_stages(self):
        return self.P * self.v

    def vstage(self, rank, chunk):
        return chunk * self.P + rank

    def place(self, vstage):
        """(rank, chunk) of virtual stage ``vstage``."""
        return vstage % self.P, vstage // self.P

    # -- memory
    def peak_in_flight(self, rank):
        """The most forwards (of micro-batch x chunk) whose backward has not run yet,
        walking ``rank``'s list: the activations the stage holds at its peak."""
        held = peak = self.carried(rank)
        for op, _, _ in self.actions[rank]:
            held += op == "F"
            held -= op == "B"
            peak = max(peak, held)
        return peak

    def in_flight_formula(self, rank):
        """The schedule's closed form for ``peak_in_flight`` (see the module doc)."""
        P, M, v = self.P, self.M, self.v
        if self.kind == "gpipe":
            return M
        if self.kind in ("1f1b", "zb"):
            return min(P - rank, M)
        if self.flushless:  # the P - 1 - s carried over, and the step's first forward
            return P - rank
        # Megatron's warm-up 2 (P - r - 1) + (v - 1) P forwards, plus the one in flight
        # as the steady phase starts (``build`` raises the warm-up where M leaves the
        # last group of P short and the lists would otherwise wait on each other)
        return min(self.warmup[rank] + 1, M * v)

    def carried(self, rank):
        """Forwards whose backward runs in the next step (async: P - 1 - rank)."""
        return self.P - 1 - rank if self.flushless else 0

    def weight_versions(self, rank):
        """The most weight versions a stage holds: 2BW's two (the live weights and the
        stash the carried micro-batches' backwards use), one where nothing is carried."""
        return 1 + (self.carried(rank) > 0)

    # -- time
    def simulate(self, forward, backward, weight=0.0, latency=0.0):
        """Run the lists with per-virtual-stage times (seconds, or sequences indexed by
        virtual stage): ``forward``, ``backward`` (the whole backward; with a split
        backward, ``backward`` is the input-gradient pass and ``weight`` the
        weight-gradient pass) and a ``latency`` per message between ranks. Returns a
        ``Timeline``; raises RuntimeError if the lists deadlock."""
        S = self.virtual_stages

        def per_stage(t):
            return [float(t)] * S if not hasattr(t, "__len__") else [float(x) for x in t]

        dur = {"F": per_stage(forward), "B": per_stage(backward), "W": per_stage(weight)}
        return _simulate(self, dur, float(latency))


class Timeline:
    """Spans ``(rank, op, mb, chunk, start, end)`` of a simulated step."""

    def __init__(self, P, spans):
        self.P, self.spans = P, spans

    @property
    def step_time(self):
        return max((s[5] for s in self.spans), default=0.0)

    def busy(self, rank):
        return sum(s[5] - s[4] for s in self.spans if s[0] == rank)

    @property
    def bubble(self):
        """1 - mean busy time / step time."""
        t = self.step_time
        if t <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.P)) / (self.P * t)


def bubble_formula(kind, P, M, v=1):
    """The idle fraction of a step with no message cost and backward = 2 forwards:
    (P - 1) / (M + P - 1) for GPipe and 1F1B (Huang et al.), (P - 1) / (v M + P - 1)
    interleaved (Narayanan et al.: the bubble divided by v). async's steady step (what
    it carries in is not waited for) idles only while the step's first forward travels
    down the stages: (P - 1) / (3 M + P - 1) (the step's loss, broadcast from the last
    stage, lines the stages up at every step)."""
    if kind == "async":
        return (P - 1) / (3 * M + P - 1)
    if kind == "interleaved":
        return (P - 1) / (v * M + P - 1)
    return (P - 1) / (M + P - 1)


def _deps(plan, op, mb, vs):
    """The actions (op, mb, vstage) an action needs first, besides its own rank's order:
    forward needs the previous virtual stage's forward; backward the next one's input
    gradient (the last stage: its own forward); W its own B."""
    S = plan.virtual_stages
    if op == "F":
        return [("F", mb, vs - 1)] if vs > 0 else []
    if op == "B":
        return [("B", mb, vs + 1)] if vs < S - 1 else [("F", mb, vs)]
    return [("B", mb, vs)]


def _simulate(plan, dur, latency, chooser=None):
    """Event simulation of the pipeline. With static lists (no ``chooser``) each rank
    runs its next listed action as soon as its inputs are there. With a ``chooser`` (the
    zero-bubble schedule's greedy rule), ``chooser.candidates(rank)`` offers actions,
    the one that can start first wins (ties: ``chooser.priority``), and
    ``chooser.chose(rank, action)`` records the order."""
    P = plan.P
    finish = {}
    # async: what a step's actions wait for that is not in its lists ran in the step before
    listed = ({(op, mb, plan.vstage(r, c)) for r, acts in enumerate(plan.actions)
               for op, mb, c in acts} if plan.flushless else None)
    spans = []
    free = [0.0] * P
    pos = [0] * P
    lists = plan.actions
    total = chooser.total if chooser is not None else sum(len(a) for a in lists)
    while len(spans) < total:
        best = None
        for r in range(P):
            if chooser is not None:
                cands = chooser.candidates(r)
            else:
                cands = [lists[r][pos[r]]] if pos[r] < len(lists[r]) else []
            for act in cands:
                op, mb, c = act
                vs = plan.vstage(r, c)
                start = free[r]
                for dop, dmb, dvs in _deps(plan, op, mb, vs):
                    t = finish.get((dop, dmb, dvs))
                    if t is None and listed is not None and (dop, dmb, dvs) not in listed:
                        continue
                    if t is None:
                        start = math.inf
                        break
                    if plan.place(dvs)[0] != r:
                        t += latency
                    start = max(start, t)
                if start == math.inf:
                    continue
                key = (start, r, 0 if chooser is None else chooser.priority(act))
                if best is None or key < best[0]:
                    best = (key, r, act, vs)
        if best is None:
            stuck = {r: lists[r][pos[r]] for r in range(P) if pos[r] < len(lists[r])}
            raise RuntimeError(f"pipeline schedule {plan.kind} (P={P}, M={plan.M}, "
                               f"v={plan.v}) deadlocks: ranks wait at {stuck}")
        (start, *_), r, act, vs = best
        op, mb, c = act
        end = start + dur[op][vs]
        finish[(op, mb, vs)] = end
        free[r] = end
        spans.append((r, op, mb, c, start, end))
        if chooser is not None:
            chooser.chose(r, act)
        else:
            pos[r] += 1
    return Timeline(P, spans)


def _one_f_one_b(P, M, s):
    warm = min(P - s - 1, M)
    out = [("F", i, 0) for i in range(warm)]
    for i in range(M - warm):
        out += [("F", warm + i, 0), ("B", i, 0)]
    out += [("B", i, 0) for i in range(M - warm, M)]
    return out


def _interleaved(P, M, v, r, warm):
    order = []
    for g in range(0, M, P):
        group = range(g, min(g + P, M))
        order.append([(mb, c) for c in range(v) for mb in group])
    fwd = [x for grp in order for x in grp]
    bwd = [(mb, v - 1 - c) for grp in order for (mb, c) in
           sorted(grp, key=lambda t: (t[1], t[0]))]
    n = M * v
    warm = min(warm, n)
    out = [("F", mb, c) for mb, c in fwd[:warm]]
    for i in range(n - warm):
        mb, c = fwd[warm + i]
        out.append(("F", mb, c))
        mb, c = bwd[i]
        out.append(("B", mb, c))
    out += [("B", mb, c) for mb, c in bwd[n - warm:]]
    return out


def _flushless(P, M, s):
    lag = P - 1 - s
    return [a for i in range(M) for a in (("F", i, 0), ("B", i - lag, 0))]


class _ZeroBubble:
    """The greedy chooser that orders the zero-bubble schedule (module doc)."""

    def __init__(self, P, M):
        self.P, self.M = P, M
        self.total = 3 * P * M
        self.next = {op: [0] * P for op in "FBW"}
        self.orders = [[] for _ in range(P)]

    @staticmethod
    def priority(act):
        return "BFW".index(act[0])  # among actions ready at the same moment

    def candidates(self, r):
        P, M = self.P, self.M
        f, b, w = (self.next[op][r] for op in "FBW")
        if b - w > P - 1 - r:  # too many weight passes waiting: they go first
            return [("W", w, 0)]
        cands = []
        if b < f:
            cands.append(("B", b, 0))
        if f < M and f - b < min(P - r, M):
            cands.append(("F", f, 0))
        if w < b:
            cands.append(("W", w, 0))
        return cands

    def chose(self, r, act):
        self.next[act[0]][r] += 1
        self.orders[r].append(act)


def _zero_bubble(P, M):
    plan = Plan("zb", P, M, 1, [[] for _ in range(P)])
    chooser = _ZeroBubble(P, M)
    _simulate(plan, {op: [1.0] * P for op in "FBW"}, 0.0, chooser)  # unit times
    plan.actions = chooser.orders
    return plan


def build(kind, stages, micro_batches, chunks=1):
    """The ``Plan`` of schedule ``kind`` ("gpipe", "1f1b", "interleaved", "zb") for
    ``stages`` ranks, ``micro_batches`` per step and ``chunks`` per rank (interleaved)."""
    P, M, v = int(stages), int(micro_batches), int(chunks)
    if M < 1:
        raise ConfigError(f"--micro-batches must be at least 1, got {M}")
    if P < 1:
        raise ConfigError(f"--pipeline-stages must be at least 1, got {P}")
    if kind == "gpipe":
        acts = [[("F", i, 0) for i in range(M)] + [("B", i, 0) for i in range(M)]] * P
        plan = Plan(kind, P, M, 1, [list(a) for a in acts])
    elif kind == "1f1b":
        plan = Plan(kind, P, M, 1, [_one_f_one_b(P, M, s) for s in range(P)])
    elif kind == "zb":
        plan = _zero_bubble(P, M)
    elif kind == "async":
        if M < P - 1:
            raise ConfigError(f"--schedule async with --pipeline-stages {P} needs "
                              f"--micro-batches M >= {P - 1} (P - 1), got {M}: a "
                              "micro-batch's backward must come back within the next step "
                              "(two weight versions)")
        plan = Plan(kind, P, M, 1, [_flushless(P, M, s) for s in range(P)])
        plan.opening = [[a for a in acts if a[1] >= 0] for acts in plan.actions]
        plan.closing = [[("B", mb, 0) for mb in range(-plan.carried(s), 0)]
                        for s in range(P)]
        for acts in (plan.opening, plan.closing):
            Plan(kind, P, M, 1, acts).simulate(1.0, 2.0, 1.0)
    elif kind == "interleaved":
        warm = [2 * (P - r - 1) + (v - 1) * P for r in range(P)]
        while True:
            plan = Plan(kind, P, M, v, [_interleaved(P, M, v, r, warm[r]) for r in range(P)])
            try:
                plan.simulate(1.0, 2.0)
                break
            except RuntimeError:
                # too few micro-batches to fill the last group: one more warm-up forward
                # on the ranks that would wait
                if all(w >= M * v for w in warm):
                    raise
                warm = [min(w + 1, M * v) for w in warm]
        plan.warmup = warm
        return plan
    else:
        raise ConfigError(f"unknown pipeline schedule {kind!r}: expected one of "
                          f"{', '.join(KINDS)}")
    plan.simulate(1.0, 1.0 if plan.split_backward else 2.0, 1.0)  # raises if it deadlocks
    return plan

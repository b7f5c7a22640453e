"""The parameter server's step, replayed: who sends what to whom (``--strategy ps``).

Not a collective: ranks ``0 .. S-1`` serve, the others work, and their traffic differs.
Each step every worker pushes one message to every server (``mpidl.ps.worker``): a
pickled header (its clock, the version its parameters came from, the step's lr and one
entry per tensor) and then each gradient array of that server's shard (a dense gradient
whole; an Embedding's row-sparse one as its indices and its rows, one per token of the
batch, duplicates included), and every server answers each push once (``mpidl.ps.modes``:
whatever the mode, a push gets one answer) with a header and its shard's parameters. The
shards are ``mpidl.ps.sharding``'s, the headers ``mpidl.ps.protocol``'s, their bytes
pickled as the communicator counts them (``message_bytes``): the few bytes of a header's
integers depend on the step and on how many updates the mode makes per step (one in
sync and backup, one per push in async and SSP, one per ``c`` pushes in softsync),
which ``Pushes`` is told. The first step's pull, each epoch's barrier and the end's
goodbyes are not steps and are left out.

The point-to-point calls a rank makes are counted as the communicator counts them: one
call per message sent and per message received; messages and bytes for what it sends.

The time (``exchange_time``): the workers' forward and backward, then the push (each
server takes every worker's part of its shard through its own link, one message after
another, each as long as the calibration measured for its size: ``Links.message``; a
node's link between the nodes carries everything that enters it), the server's update of
its shard (its share of the update) and its copy of the shard for the answers (at the
calibrated copy speed, ``gamma``), and the answers the same way back; each side notices
a message on average half a poll interval late (the waits sleep between probes, up to
``poll_s``: 1 ms, ``ps(poll_max_ms=...)``'s default). Mode, stragglers and staleness do not enter: the figures are those of
a sync step.
"""

from dataclasses import dataclass, field

from mpidl.comm.counters import FIELDS, KINDS
from mpidl.ps.protocol import message_bytes, params_header, push_header
from mpidl.ps.sharding import shard_parameters


@dataclass
class Message:
    src: int
    dest: int
    nbytes: int
    what: str  # "push" or "answer"


@dataclass
class Pushes:
    """What a worker's push holds beside the shapes: ``arrays[name]``, the arrays it sends
    for that parameter (a dense gradient's one, a row-sparse one's indices and rows: any
    arrays of their shapes and dtypes; or ``(encoding, meta, arrays)``: a compressed
    one's, ``compression.pushed``), ``lr`` (a float, or None without one), ``step``
    (the step's index from 0: its clock), ``mode`` and ``wait`` (``--mode``, ``--wait``:
    how many server versions a step makes, ``updates_per_step``)."""

    arrays: dict
    lr: object = None
    step: int = 1
    mode: str = "sync"
    wait: int = 0
    poll_s: float = 1e-3
    by_worker: dict = None  # {worker rank: arrays} where workers push differently sized
                            # arrays (Parallax's coalesced rows): instead of ``arrays``


@dataclass
class ServerStep:
    """One step of ``p`` ranks, the first ``servers`` serving: its point-to-point
    ``messages``, the bytes of each server's shard, the waits' poll interval."""

    p: int
    servers: int
    messages: list = field(default_factory=list)
    shard_bytes: tuple = ()
    poll_s: float = 0.0
    dense_bytes: int = 0
    what: str = ""
    every: int = 1
    calls: tuple = ()  # (no collectives: --json's list of them stays empty)


def updates_per_step(mode, workers, wait=0):
    """The server versions one step makes under ``mode`` (``Pushes``)."""
    if mode in ("async", "ssp"):
        return float(workers)
    if mode == "softsync":
        return workers / (wait or workers)
    return 1.0


def pushed_arrays(grads):
    """``Pushes.arrays`` from gradients as the engine leaves them (``Parameter.grad``:
    arrays, or ``SparseGrad`` for an Embedding's)."""
    from mpidl.backend import to_numpy  # noqa: PLC0415
    from mpidl.engine.module import SparseGrad  # noqa: PLC0415

    out = {}
    for name, g in grads.items():
        if isinstance(g, SparseGrad):
            out[name] = [to_numpy(g.indices), to_numpy(g.values)]
        elif g is not None:
            out[name] = [to_numpy(g)]
    return out


def layout(named_params, p, servers, pushes, workers=None):
    """``(ServerStep, ShardLayout)`` of one step on ``p`` ranks of which the first
    ``servers`` serve (module doc); ``workers``: the ranks that push (default: every
    other rank; worker groups: their leaders)."""
    from mpidl.backend import to_numpy  # noqa: PLC0415

    named_params = list(named_params)
    shards = shard_parameters(named_params, servers)
    params = dict(named_params)
    workers = range(servers, p) if workers is None else list(workers)
    step = int(pushes.step)
    per_step = updates_per_step(pushes.mode, len(workers), pushes.wait)
    known = int(round(step * per_step))  # (the version a worker holds)
    after = int(round((step + 1) * per_step))
    out = ServerStep(p, servers, shard_bytes=shards.nbytes, poll_s=float(pushes.poll_s),
                     what=f"parameter server ({servers} server(s), {p - servers} worker(s))")
    for s, names in enumerate(shards.names):
        pushed = {}
        for w in workers:
            tensors, arrays = [], []
            given = (pushes.by_worker or {}).get(w, pushes.arrays)
            for name in names:
                sent = given.get(name)
                if sent is None:
                    continue  # (no gradient: not pushed)
                if isinstance(sent, tuple):  # (encoding, meta, arrays): compressed
                    enc, meta, sent = sent
                else:
                    enc, meta = "sparse" if len(sent) == 2 else "dense", None
                tensors.append((name, enc, meta, len(sent)))
                arrays += sent
            pushed[w] = message_bytes(push_header(step, known, pushes.lr, tensors), arrays)
        values = [to_numpy(params[n].data) for n in names]
        answer = message_bytes(params_header(after, list(names)), values)
        for w in workers:
            out.messages += [Message(w, s, n, "push") for n in pushed[w]]
        for w in workers:
            out.messages += [Message(s, w, n, "answer") for n in answer]
        out.dense_bytes += sum(pushed[workers[0]][1:]) if len(workers) else 0
    return out, shards


@dataclass
class GroupedStep:
    """A step of worker groups (``--group-size G``): the leaders' pushes and the servers'
    answers (``ps``: a ``ServerStep`` whose workers are the leaders) and each group's
    collectives (``group``: a ``step.StepLayout`` on ``G`` ranks: the gradient buckets'
    all-reduce, then the leader's parameters broadcast in buffers of the buckets'
    layout, the last one element longer: the epoch's "stop")."""

    p: int
    servers: int
    group_size: int
    ps: ServerStep
    group: object
    what: str = ""
    every: int = 1
    calls: list = field(default_factory=list)  # (a group's collectives, for --json)


def grouped_layout(named_params, p, servers, group_size, pushes, algorithm="auto",
                   bucket_mb=4.0, tables=None):
    """``GroupedStep`` of ``p`` ranks, the workers in consecutive groups of
    ``group_size`` (``mpidl.runtime.sync.groups``). ``pushes``: what a leader pushes,
    its group's mean gradient (every parameter dense: the buckets densify row-sparse
    ones)."""
    import numpy as np  # noqa: PLC0415

    from mpidl.comm import auto  # noqa: PLC0415
    from mpidl.runtime.fusion import MiB, plan  # noqa: PLC0415

    from .step import Call, _dtype_name, resolve  # noqa: PLC0415
    from .step import layout as group_layout  # noqa: PLC0415

    named = list(named_params)
    leaders = list(range(servers, p))[::group_size]
    ps, _ = layout(named, p, servers, pushes, workers=leaders)
    group = group_layout(named, group_size, algorithm, bucket_mb, tables=tables)
    group.update_share = 0.0  # (the servers update: their share is in the exchange)
    selector = auto.Selector(group_size, auto.load() if tables is None else tables)
    buffers = plan(named, int(bucket_mb * MiB))
    for i, pairs in enumerate(buffers):
        dtype = np.dtype(pairs[0][1].data.dtype)
        n = sum(q.data.size for _, q in pairs) + (i == len(buffers) - 1)
        alg = resolve(selector, "bcast", "auto", n * dtype.itemsize, dtype)
        group.calls.append(Call("bcast", f"params{i}", alg, n, dtype.itemsize,
                                _dtype_name(dtype), tuple(name for name, _ in pairs),
                                phase="update"))
    return GroupedStep(p, servers, group_size, ps, group,
                       what=f"parameter server ({servers} server(s), {len(leaders)} worker "
                       f"group(s) of {group_size})", calls=group.calls)


def grouped_traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {...}, "total": ..., "groups": {"world": ..., "group": ...}}}``:
    the world group's point-to-point counters (a leader's pushes, a server's answers)
    and a worker's group's collectives."""
    g = step.group_size
    return workers_traffic(step.ps, step.group, g, lambda r: (r - step.servers) % g, "group",
                           per_node, ranks, seg_bytes)


def workers_traffic(ps, group, size, index, label, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {...}, "total": ..., "groups": {"world": ..., label: ...}}}``: the
    world group's point-to-point counters of ``ps`` (a ``ServerStep``) and, on a worker,
    its group's collectives (``group``: a ``step.StepLayout`` on ``size`` ranks, in which
    world rank ``r`` is rank ``index(r)``), summed."""
    from .step import traffic as group_traffic  # noqa: PLC0415

    ranks = list(range(ps.p) if ranks is None else ranks)
    world = traffic(ps, ranks=ranks)
    out = {}
    for r in ranks:
        summary = {k: dict(v) for k, v in world[r].items()}
        groups = {"world": world[r]}
        if r >= ps.servers:
            i = index(r)
            mine = group_traffic(group, max(1, min(per_node, size)), ranks=[i],
                                 seg_bytes=seg_bytes)[i]
            for k, row in mine.items():
                for f, v in row.items():
                    summary[k][f] += v
            groups[label] = mine
        summary["groups"] = groups
        out[r] = summary
    return out


def grouped_step_time(step, compute, batch, accumulate, machine, per_node, overlap,
                      seg_bytes=None):
    """Predicted seconds of one step: a group's passes and all-reduce
    (``step.step_time``), the leader's exchange with the servers, the broadcast."""
    from . import collectives as col  # noqa: PLC0415
    from .step import step_time as group_time  # noqa: PLC0415

    g = step.group_size
    links = col.Links(machine, col.Topology(g, max(1, min(per_node, g))))
    t = group_time(step.group, compute, batch, accumulate, links, overlap, seg_bytes)
    world = col.Links(machine, col.Topology(step.p, max(1, min(per_node, step.p))))
    exchange = exchange_time(step.ps, world, compute.update_s)
    t.update(comm=t["comm"] + exchange, exposed_comm=t["exposed_comm"] + exchange,
             total=t["total"] + exchange)
    return t


def traffic(step, ranks=None):
    """``{rank: {kind: {calls, messages, bytes, native_calls}, "total": ...}}`` of the
    step's messages (``step.traffic``'s form: only ``p2p`` is non-zero; the ranks'
    placement does not change what a message counts)."""
    ranks = range(step.p) if ranks is None else ranks
    want = set(ranks)
    p2p = {r: [0, 0, 0, 0] for r in ranks}
    for m in step.messages:
        if m.src in want:
            row = p2p[m.src]
            row[0] += 1
            row[1] += 1
            row[2] += m.nbytes
        if m.dest in want:
            p2p[m.dest][0] += 1
    out = {}
    for r in ranks:
        summary = {kind: dict(zip(FIELDS, p2p[r] if kind == "p2p" else [0, 0, 0, 0]))
                   for kind in KINDS}
        summary["total"] = dict(summary["p2p"])
        out[r] = summary
    return out


def step_time(step, compute, batch, accumulate, links):
    """Predicted seconds of one step (``step.step_time``'s keys): the workers' passes,
    then the exchange (``exchange_time``), and the slowest worker's lead lost."""
    from .step import slowest_of  # noqa: PLC0415

    compute_s = accumulate * (compute.forward(batch) + compute.backward(batch))
    skew = compute.cv * compute_s * slowest_of(step.p - step.servers)
    comm = exchange_time(step, links, compute.update_s)
    return {"forward": accumulate * compute.forward(batch),
            "backward": accumulate * compute.backward(batch), "comm": comm,
            "exposed_comm": comm, "update": 0.0, "compression": 0.0, "skew": skew,
            "total": compute_s + comm + skew}


def exchange_time(step, links, update_s):
    """Seconds from the last worker's gradient to its new parameters (module doc):
    the pushes into each server, its update (``update_s`` of the whole model, shared by
    the servers in proportion to their bytes), the answers back; the slowest server."""
    topo = links.topo

    def way(what):
        per_server, into_node = {}, {}
        for m in step.messages:
            if m.what != what:
                continue
            a, b = topo.node(m.src), topo.node(m.dest)
            server = m.dest if what == "push" else m.src
            per_server[server] = per_server.get(server, 0.0) + links.message(a != b, m.nbytes)
            if a != b:  # the link of the node the bytes enter
                into_node[b] = into_node.get(b, 0) + m.nbytes
        worst_link = max((n * links.m.beta_inter for n in into_node.values()), default=0.0)
        return per_server, worst_link

    pushes, push_link = way("push")
    answers, answer_link = way("answer")
    total = sum(step.shard_bytes) or 1
    per_server = [pushes.get(s, 0.0) + update_s * step.shard_bytes[s] / total
                  + links.gamma(step.shard_bytes[s]) + answers.get(s, 0.0)
                  for s in range(step.servers)]
    return max(max(per_server, default=0.0), push_link + answer_link) + step.poll_s

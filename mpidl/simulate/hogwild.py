"""Hogwild's step, replayed (``--strategy hogwild``): one-sided operations on the servers'
windows, counted as ``rma.SharedVector`` counts them.

The model's parameters are one vector of ``n`` elements split over the ``S`` servers by
``layout.even_split`` (``mpidl.runtime.hogwild``). A worker's step, lock-free
(``HogwildSync``): it fetches every server's update count (``versions``: a fetch per
server, 8 bytes each), reads the whole vector (``read``: a get per server holding a
non-empty chunk, the chunk's bytes), computes, and adds ``-lr g`` (``add``: an
accumulate per such server, the chunk's bytes, and a fetch-and-add of its count, 8
bytes): three calls. The servers only expose their windows: they count nothing.

The time: the worker's compute, then its one-sided operations one after another on its
link (a get or an accumulate of a chunk: ``Links.message``; a version: a latency), or,
when the servers' links are the narrower, the time a server takes to take every
worker's accumulate and serve every read of its chunk (lock-free workers do not wait
for each other, so that is the only queue). With ``--locks`` the workers' exchanges
queue one after another behind the locks.
"""

from dataclasses import dataclass

from mpidl.comm.counters import FIELDS, KINDS
from mpidl.comm.layout import even_split


@dataclass
class HogwildStep:
    """A step of ``p`` ranks, the first ``servers`` holding ``chunks`` (elements per
    server) of the ``itemsize``-byte vector."""

    p: int
    servers: int
    chunks: list
    itemsize: int
    what: str = ""
    every: int = 1
    calls: tuple = ()


def layout(named_params, p, servers):
    """``HogwildStep`` of ``p`` ranks for the parameters' vector (module doc)."""
    named = list(named_params)
    n = sum(q.data.size for _, q in named)
    return HogwildStep(p, servers, list(even_split(n, servers)[0]),
                       named[0][1].data.itemsize,
                       what=f"hogwild ({servers} server(s) holding {n} weights, "
                       f"{p - servers} lock-free worker(s))")


def worker_counts(step):
    """``[calls, messages, bytes, 0]`` of one worker's step (module doc)."""
    held = [c for c in step.chunks if c]
    data = sum(held) * step.itemsize
    messages = step.servers + 2 * len(held) + len(held)
    nbytes = 8 * step.servers + 2 * data + 8 * len(held)
    return [3, messages, nbytes, 0]


def traffic(step, ranks=None):
    """``{rank: {kind: {...}, "total": ...}}``: only ``rma`` is non-zero, on workers."""
    out = {}
    work = worker_counts(step)
    for r in (range(step.p) if ranks is None else ranks):
        mine = work if r >= step.servers else [0, 0, 0, 0]
        summary = {kind: dict(zip(FIELDS, mine if kind == "rma" else [0, 0, 0, 0]))
                   for kind in KINDS}
        summary["total"] = dict(summary["rma"])
        out[r] = summary
    return out


def step_time(step, compute, batch, accumulate, links, locks=False):
    """Predicted seconds of one step (``step.step_time``'s keys) (module doc). ``locks``
    (``--locks``): each worker holds every server exclusively from its read to its add,
    so the workers' exchanges run one after another."""
    topo = links.topo
    workers = step.p - step.servers
    mine = 0.0
    serve = []
    for s, chunk in enumerate(step.chunks):
        nbytes = chunk * step.itemsize
        version = links.cost(topo.node(s) != topo.node(step.servers), 8)
        mine += 2 * version  # (the count fetched, and bumped)
        if chunk:
            inter = any(topo.node(s) != topo.node(w) for w in range(step.servers, step.p))
            one = links.message(inter, nbytes)
            mine += 2 * one  # (the read, and the accumulate)
            serve.append(2 * workers * one)
    comm = max([mine] + serve)
    if locks:  # (a worker waits its turn: the others' exchanges before its own)
        comm = workers * mine
    compute_s = accumulate * (compute.forward(batch) + compute.backward(batch))
    return {"forward": accumulate * compute.forward(batch),
            "backward": accumulate * compute.backward(batch), "comm": comm,
            "exposed_comm": comm, "update": 0.0, "compression": 0.0, "skew": 0.0,
            "total": compute_s + comm}

"""Parallax's step, replayed (``--sparse-sync ps``): the remote parameters through the
parameter servers, the dense rest all-reduced among the trainers.

Ranks ``0 .. S-1`` serve the remote parameters (by default those with row-sparse
gradients, else ``--ps-params``; ``mpidl.runtime.sync.parallax.Split``), the others
train (``mpidl.runtime.sync.parallax``). A trainer's step is two parts:

- its pushes to the servers and their answers (``server.layout`` over the remote
  parameters only, point to point on the world group): a row-sparse gradient travels as
  its coalesced rows (``rowsparse.as_rows``: each row once, so the sizes depend on the
  tokens of each trainer's batch: ``Pushes.by_worker``), a dense one whole; each server
  answers with its shard of the remote parameters;
- the dense parameters' fused buckets (and the row gathers of row-sparse ones the
  servers do not hold) on the trainers' data-parallel group of ``p - S`` ranks
  (``step.layout``; a group of one still calls).

The time: the trainers' compute; then the push leaves first and the servers' round trip
(``server.exchange_time``, their share of the update being the remote parameters')
runs while the trainers all-reduce (``step.step_time`` on their group): the step ends
with the later of the two. The trainers' group is laid on whole nodes of consecutive
trainers (the servers' ranks come first and are left aside).
"""

from dataclasses import dataclass, field

from . import collectives as col
from . import server as ps_model
from .step import layout as group_layout
from .step import segment_bytes
from .step import step_time as group_time


@dataclass
class ParallaxStep:
    """A step of ``p`` ranks, the first ``servers`` serving: the servers' part
    (``ps``: a ``server.ServerStep`` over the remote parameters) and the trainers'
    data-parallel layout (``dp``)."""

    p: int
    servers: int
    ps: object
    dp: object
    remote: tuple
    remote_share: float = 0.0
    what: str = ""
    every: int = 1
    calls: list = field(default_factory=list)  # (the trainers' buckets, for --json)


def layout(named_params, p, servers, pushes, remote, algorithm="auto", bucket_mb=4.0,
           kept_rows=None, tables=None):
    """``ParallaxStep`` of ``p`` ranks: ``remote`` names the parameters the servers hold;
    ``pushes`` (``server.Pushes``) what each trainer pushes of them; ``kept_rows``:
    ``{name: [rows per trainer]}`` of the row-sparse parameters left on the trainers
    (gathered as rows), none by default."""
    named = list(named_params)
    remote = tuple(n for n, _ in named if n in set(remote))
    ps, _ = ps_model.layout([(n, q) for n, q in named if n in remote], p, servers, pushes)
    kept = kept_rows or {}
    dp = group_layout([(n, q) for n, q in named if n not in remote], p - servers, algorithm,
                      bucket_mb, sorted(kept), kept, tables=tables, alone=True)
    total = sum(q.data.size for _, q in named) or 1
    share = sum(q.data.size for n, q in named if n in remote) / total
    return ParallaxStep(p, servers, ps, dp, remote, share,
                        what=f"Parallax ({servers} server(s) holding {len(remote)} "
                        f"parameter(s), {p - servers} trainer(s) all-reducing the rest)",
                        calls=dp.calls)


def traffic(step, per_node=1, ranks=None, seg_bytes=None):
    """``{rank: {kind: {...}, "total": ..., "groups": {"world": ..., "dp": ...}}}``: the
    world group's point-to-point counters (pushes, answers) and the trainers' group's."""
    return ps_model.workers_traffic(step.ps, step.dp, step.p - step.servers,
                                    lambda r: r - step.servers, "dp", per_node, ranks,
                                    seg_bytes)


def step_time(step, compute, batch, accumulate, machine, per_node, overlap, seg_bytes=None):
    """Predicted seconds of one step (``step.step_time``'s keys) (module doc)."""
    seg_bytes = segment_bytes() if seg_bytes is None else seg_bytes
    trainers = step.p - step.servers
    world = col.Links(machine, col.Topology(step.p, max(1, min(per_node, step.p))))
    dp_links = col.Links(machine, col.Topology(trainers, max(1, min(per_node, trainers))))
    t = group_time(step.dp, compute, batch, accumulate, dp_links, overlap, seg_bytes)
    exchange = ps_model.exchange_time(step.ps, world, compute.update_s * step.remote_share)
    compute_s = accumulate * (compute.forward(batch) + compute.backward(batch))
    total = max(t["total"], compute_s + exchange + t["skew"])
    t["comm"] += exchange
    t["exposed_comm"] += total - t["total"]
    t["total"] = total
    return t

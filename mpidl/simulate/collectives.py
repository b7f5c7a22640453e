"""The message schedule of each collective algorithm, counted per rank, and its time.

Counting (exact): for rank ``r`` of ``p``, the messages and payload bytes that the
algorithm module in ``mpidl/comm/`` sends, as its transport counts them
(``mpidl.comm.counters``: one message per send, isend or sendrecv, a send of zero bytes
included; receives are not counted; MPI's own collectives count no messages). The
functions follow the modules line by line, without running them:

- ``ring``: chunk ``c`` of ``layout.even_split(n, p)`` travels in segments of
  ``max(1, segment_bytes // itemsize)`` elements, one message each; an empty chunk sends
  nothing. The all-reduce's pipeline (``ring._pipeline`` with ``c0 = rank - 1``,
  ``2 (p - 1)`` steps) sends chunks ``rank - 1, rank - 2, ...``: every chunk but
  ``rank`` in the reduce-scatter half, every chunk but ``rank + 1`` in the all-gather
  half. The all-gather (``c0 = rank``, ``p - 1`` steps) sends every chunk but
  ``rank + 1``.
- ``tree``: the binomial reduce to rank 0 (every other rank sends the whole buffer once)
  and the binomial broadcast from 0 (a rank sends the whole buffer to each child); the
  all-gather gathers subtree spans (only non-empty ones are sent) and broadcasts.
- ``recursive_doubling``: ``recursive_doubling.plan`` (the module's own function) gives
  each rank's role and partners: a folded-out rank sends once, an odd rank receives its
  neighbour's data and sends the result back once more, everyone in the power-of-two core
  exchanges once per round (the all-gather's exchanges of empty ranges still count).
- ``hierarchical``: members send their pieces (``hierarchical._pieces``) to the node's
  leader, leaders run the ring all-reduce on each piece among themselves, then send
  every piece to every member; the all-gather gathers blocks on the leaders, passes
  node blocks round the leaders' ring and broadcasts inside the node with the tree.
- broadcasts (from rank 0): the tree's binomial broadcast of the whole buffer; the
  ring's and recursive doubling's binomial scatter of ``even_split``'s chunks (a rank
  sends each child its subtree's span, when not empty) and then their all-gather; the
  hierarchical's tree among the nodes' leaders and a tree inside each node.
- ``mpi``: a call of MPI's own collective: counted as a call, no messages, no bytes.

Time (a prediction): the alpha-beta(-gamma) model of Thakur, Rabenseifner and Gropp
(2005) along each algorithm's rounds: a message of ``m`` bytes costs ``alpha + beta m``
on the link it takes (intra- or inter-node, ``Machine``), or, on a calibrated machine,
what the calibration measured for ``m`` bytes on that link (``Links``); a reduction
``gamma m``. A round whose messages leave a node on several flows at once shares the
node's link (``beta`` times the flows; on the measured curve, the flows' bytes as one
message). The ring's segments are sent one after another on one link, so a ring step
costs ``segments x alpha + bytes x beta`` (or each segment's measured time). MPI's own
all-reduce is taken to be MPICH's (recursive doubling up to 2 KiB, else reduce-scatter
by recursive halving + all-gather by recursive doubling, ``_mpich_allreduce_time``); its
all-gather a ring.
``bench/simgrid.py`` checks these times against SimGrid SMPI on platforms of hundreds of
hosts described from the same machine.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mpidl.comm import hierarchical as _hier
from mpidl.comm import recursive_doubling as _rd
from mpidl.comm.algorithms import Context
from mpidl.comm.layout import displacements, even_split

ALGORITHMS = ("ring", "tree", "recursive_doubling", "hierarchical", "mpi")
#: the collective kinds modelled (an "allgather" is counted and timed as an all-gather of
#: its counts: ``allgather_shards`` runs the algorithms' ``allgatherv``)
KINDS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "bcast")


@dataclass(frozen=True)
class Topology:
    """``p`` ranks placed in blocks of ``per_node`` consecutive ranks per node (the last
    node may hold fewer): what ``MPIDL_RANKS_PER_NODE`` pretends and what a launcher's
    block placement does."""

    p: int
    per_node: int

    def node(self, rank):
        return rank // self.per_node

    @property
    def nodes(self):
        return -(-self.p // self.per_node)

    def node_of(self):
        return [self.node(r) for r in range(self.p)]


def _nseg(count, seg):
    return -(-count // seg) if count > 0 else 0


# ------------------------------------------------------------------ counting, per rank
def ring_allreduce(r, p, n, itemsize, seg):
    """(messages, bytes) rank ``r`` sends in ``ring.allreduce`` of ``n`` elements."""
    if p == 1 or n == 0:
        return 0, 0
    counts, _ = even_split(n, p)
    segs = _ring_segments(counts, seg)
    a, b = r % p, (r + 1) % p
    messages = 2 * segs[-1] - (segs[a + 1] - segs[a]) - (segs[b + 1] - segs[b])
    return messages, (2 * n - counts[a] - counts[b]) * itemsize


@lru_cache(maxsize=256)
def _ring_segments(counts, seg):
    """Prefix sums of the segments per chunk."""
    out = [0]
    for c in counts:
        out.append(out[-1] + _nseg(c, seg))
    return tuple(out)


def ring_allgatherv(r, counts, itemsize, seg):
    """(messages, bytes) of ``ring.allgatherv``: every chunk but ``r + 1``'s."""
    p = len(counts)
    if p == 1 or sum(counts) == 0:
        return 0, 0
    segs = _ring_segments(tuple(counts), seg)
    b = (r + 1) % p
    return segs[-1] - (segs[b + 1] - segs[b]), (sum(counts) - counts[b]) * itemsize


def _tree_children(v, p):
    """Children of relative rank ``v`` in the binomial tree over ``p`` ranks."""
    low = v & -v if v else 1 << max(p - 1, 0).bit_length()
    out, mask = 0, 1
    while mask < low and mask < p:
        if v + mask < p:
            out += 1
        mask <<= 1
    return out


def tree_scatter(v, counts):
    """(messages, elements) relative rank ``v`` sends in ``tree.scatter``: each child its
    subtree's span of blocks, when not empty."""
    p = len(counts)
    low = v & -v if v else 1 << max(p - 1, 0).bit_length()
    messages = elements = 0
    mask = 1
    while mask < low and mask < p:
        child = v + mask
        if child < p:
            span = sum(counts[child:min(child + mask, p)])
            if span:
                messages += 1
                elements += span
        mask <<= 1
    return messages, elements


def bcast_count(algorithm, r, topo, n, itemsize, seg):
    """(messages, bytes) rank ``r`` sends in a broadcast of ``n`` elements from rank 0."""
    p = topo.p
    if p == 1 or n == 0:
        return 0, 0
    if algorithm == "tree":
        kids = _tree_children(r, p)
        return kids, kids * n * itemsize
    if algorithm == "hierarchical":
        by_node, leaders = _hier_groups(topo)
        local = by_node[topo.node(r)]
        kids = _tree_children(local.index(r), len(local))
        if r == local[0] and len(leaders) > 1:
            kids += _tree_children(leaders.index(r), len(leaders))
        return kids, kids * n * itemsize
    counts = tuple(even_split(n, p)[0])
    m, elements = tree_scatter(r, counts)
    gather = ring_allgatherv(r, counts, itemsize, seg) if algorithm == "ring" else \
        rd_allgatherv(r, counts, itemsize)
    return m + gather[0], elements * itemsize + gather[1]


def tree_allreduce(r, p, n, itemsize, seg=None):
    if p == 1 or n == 0:
        return 0, 0
    messages = (1 if r else 0) + _tree_children(r, p)
    return messages, messages * n * itemsize


def tree_allgatherv(r, counts, itemsize, seg=None):
    p = len(counts)
    n = sum(counts)
    if p == 1 or n == 0:
        return 0, 0
    messages = nbytes = 0
    if r:  # the gather: my subtree's span, if it is not empty
        span = sum(counts[r:min(r + (r & -r), p)])
        if span:
            messages, nbytes = 1, span
    kids = _tree_children(r, p)
    return messages + kids, (nbytes + kids * n) * itemsize


def rd_allreduce(r, p, n, itemsize, seg=None):
    if p == 1 or n == 0:
        return 0, 0
    role, _, partners, _, _ = _rd.plan(r, p)
    messages = 1 if role == "out" else len(partners) + (role == "odd")
    return messages, messages * n * itemsize


def rd_allgatherv(r, counts, itemsize, seg=None):
    p = len(counts)
    n = sum(counts)
    if p == 1 or n == 0:
        return 0, 0
    displs = displacements(counts)
    role, v, partners, q, rem = _rd.plan(r, p)
    if role == "out":
        return 1, counts[r] * itemsize

    def start(w):  # as the module's: the first element virtual rank w holds
        return n if w >= q else displs[_rd._vfirst(w, rem)]

    messages = nbytes = 0
    mask = 1
    for _ in partners:
        base = v & ~(mask - 1)
        messages += 1
        nbytes += start(base + mask) - start(base)
        mask <<= 1
    if role == "odd":
        messages += 1
        nbytes += n
    return messages, nbytes * itemsize


def ring_reduce_scatter(r, p, n, itemsize, seg):
    """``ring.reduce_scatter`` over ``even_split(n, p)``: the all-reduce's first half,
    every chunk but ``rank``."""
    if p == 1 or n == 0:
        return 0, 0
    counts, _ = even_split(n, p)
    segs = _ring_segments(counts, seg)
    a = r % p
    return segs[-1] - (segs[a + 1] - segs[a]), (n - counts[a]) * itemsize


def tree_reduce_scatter(r, p, n, itemsize, seg=None):
    """``tree.reduce_scatter``: the reduce to rank 0 (the whole buffer, once, from every
    other rank), then the binomial scatter of the non-empty subtree spans."""
    if p == 1 or n == 0:
        return 0, 0
    messages, elements = tree_scatter(r, tuple(even_split(n, p)[0]))
    if r:  # (the reduce: the whole buffer, once)
        messages, elements = messages + 1, elements + n
    return messages, elements * itemsize


def rd_reduce_scatter(r, p, n, itemsize, seg=None):
    """``recursive_doubling.reduce_scatter`` (recursive halving, the farthest partner
    first): a folded-out rank sends its buffer once; an odd rank sends its neighbour's
    chunk back at the end; each round sends the half given away (empty ones counted)."""
    if p == 1 or n == 0:
        return 0, 0
    counts, displs = even_split(n, p)
    role, v, partners, q, rem = _rd.plan(r, p)
    if role == "out":
        return 1, n * itemsize

    def start(w):  # as the module's
        return n if w >= q else displs[_rd._vfirst(w, rem)]

    messages = nbytes = 0
    lo, hi, mask = 0, q, q // 2
    for _ in partners:
        mid = lo + mask
        keep, give = ((lo, mid), (mid, hi)) if v < mid else ((mid, hi), (lo, mid))
        messages += 1
        nbytes += start(give[1]) - start(give[0])
        lo, hi = keep
        mask >>= 1
    if role == "odd":
        messages += 1
        nbytes += counts[r - 1]
    return messages, nbytes * itemsize


def _hier_groups(topo):
    return _hier.groups(topo.node_of())


def hier_pieces(n, itemsize, seg_bytes):
    """The pieces ``hierarchical.allreduce`` pipelines (its own function)."""
    return _hier._pieces(n, Context(seg_bytes), itemsize)


def hier_allreduce(r, topo, n, itemsize, seg_bytes):
    p = topo.p
    if p == 1 or n == 0:
        return 0, 0
    by_node, leaders = _hier_groups(topo)
    local = by_node[topo.node(r)]
    pieces = hier_pieces(n, itemsize, seg_bytes)
    if r != local[0]:
        return len(pieces), n * itemsize
    members = len(local) - 1
    messages, nbytes = members * len(pieces), members * n * itemsize
    if len(leaders) > 1:
        i = leaders.index(r)
        seg = max(1, seg_bytes // itemsize)
        for lo, hi in pieces:
            m, b = ring_allreduce(i, len(leaders), hi - lo, itemsize, seg)
            messages += m
            nbytes += b
    return messages, nbytes


def hier_allgatherv(r, topo, counts, itemsize, seg_bytes=None):
    p = topo.p
    total = sum(counts)
    if p == 1 or total == 0:
        return 0, 0
    by_node, leaders = _hier_groups(topo)
    local = by_node[topo.node(r)]
    messages = nbytes = 0
    if r != local[0]:
        if counts[r]:
            messages, nbytes = 1, counts[r]
    else:
        k = len(leaders)
        if k > 1:
            i = leaders.index(r)
            for step in range(k - 1):
                for rank in by_node[(i - step) % k]:
                    if counts[rank]:
                        messages += 1
                        nbytes += counts[rank]
    if len(local) > 1:  # tree.bcast inside the node, from its leader
        kids = _tree_children(local.index(r), len(local))
        messages += kids
        nbytes += kids * total
    return messages, nbytes * itemsize


def count(kind, algorithm, r, topo, n_or_counts, itemsize, seg_bytes):
    """(messages, bytes) rank ``r`` sends in one call of ``kind`` run by ``algorithm``:
    ``n_or_counts`` is the all-reduce's or reduce-scatter's element count (chunks of
    ``even_split``), or the all-gather's counts per rank."""
    if kind not in KINDS:
        raise ValueError(f"collective {kind!r} is not modelled (modelled: "
                         f"{', '.join(KINDS)})")
    if algorithm == "mpi":
        return 0, 0
    seg = max(1, seg_bytes // itemsize)
    if kind == "bcast":
        return bcast_count(algorithm, r, topo, n_or_counts, itemsize, seg)
    if kind == "allreduce" or (kind == "reduce_scatter" and algorithm == "hierarchical"):
        # (the hierarchical reduce-scatter is its all-reduce, each rank keeping its chunk)
        if algorithm == "hierarchical":
            return hier_allreduce(r, topo, n_or_counts, itemsize, seg_bytes)
        fn = {"ring": ring_allreduce, "tree": tree_allreduce,
              "recursive_doubling": rd_allreduce}[algorithm]
        return fn(r, topo.p, n_or_counts, itemsize, seg)
    if kind == "reduce_scatter":
        fn = {"ring": ring_reduce_scatter, "tree": tree_reduce_scatter,
              "recursive_doubling": rd_reduce_scatter}[algorithm]
        return fn(r, topo.p, n_or_counts, itemsize, seg)
    if algorithm == "hierarchical":
        return hier_allgatherv(r, topo, tuple(n_or_counts), itemsize, seg_bytes)
    fn = {"ring": ring_allgatherv, "tree": tree_allgatherv,
          "recursive_doubling": rd_allgatherv}[algorithm]
    return fn(r, tuple(n_or_counts), itemsize, seg)


# ------------------------------------------------------------------ time
class Links:
    """What messages cost on a machine and topology: which link a message takes, and its
    seconds there: the calibration's measured curve where it measured that link (the
    fitted ``alpha + beta * bytes`` line is least exact where bandwidth rules: a fit on
    relative error follows the many small sizes, and a rate-limited link lets short
    bursts through faster than its rate), the machine's line elsewhere."""

    def __init__(self, machine, topo):
        self.m, self.topo = machine, topo
        self.multi = topo.nodes > 1
        points = (machine.info.get("points") or {}) if machine.info else {}
        self.curves = {where: (np.asarray(c["bytes"], dtype=float),
                               np.asarray(c["seconds"], dtype=float))
                       for where, c in points.items() if c and len(c["bytes"]) >= 2}

    def cost(self, inter, nbytes, messages=1, flows=1):
        """Seconds of ``messages`` messages carrying ``nbytes`` in all, one after the
        other; ``flows`` ranks of a node send as many at once over the node's link."""
        m = self.m
        inter = inter and self.multi
        curve = self.curves.get("inter" if inter else "intra")
        if curve is not None and messages >= 1:
            share = max(1, flows) if inter else 1
            return messages * _on_curve(curve, nbytes * share / messages)
        if inter:
            return messages * m.alpha_inter + nbytes * m.beta_inter * max(1, flows)
        return messages * m.alpha_intra + nbytes * m.beta_intra

    def crosses(self, distance):
        """Whether a round whose messages go ``distance`` ranks apart leaves the nodes:
        at a distance of a node or more, or one that does not divide a node's block."""
        r = self.topo.per_node
        return self.multi and (distance >= r or r % (2 * distance) != 0)

    def gamma(self, nbytes):
        return self.m.gamma * nbytes

    def message(self, inter, nbytes):
        """Seconds of one point-to-point message of ``nbytes``."""
        return self.cost(inter, nbytes)


def _on_curve(curve, nbytes):
    """Seconds of one message of ``nbytes`` on a measured curve: linear between its
    sizes, the smallest size's time below them, the last segment's slope (the link's
    rate at the largest sizes) beyond them."""
    sizes, seconds = curve
    if nbytes <= sizes[-1]:
        return float(np.interp(nbytes, sizes, seconds))
    slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
    return float(seconds[-1] + (nbytes - sizes[-1]) * max(slope, 0.0))


def _log2ceil(p):
    return max(p - 1, 0).bit_length()


def ring_time(links, p, chunks_bytes, segs, nred, nsteps):
    """``nsteps`` ring steps over chunks of at most ``chunks_bytes`` bytes in ``segs``
    segments; the first ``nred`` reduce. The ring crosses a node boundary as soon as there
    are several nodes: every step waits for its slowest link."""
    if p == 1 or nsteps <= 0 or chunks_bytes == 0:
        return 0.0
    inter = links.multi
    step = links.cost(inter, chunks_bytes, segs)
    return nsteps * step + min(nred, nsteps) * links.gamma(chunks_bytes)


def time_allreduce(algorithm, links, n, itemsize, seg_bytes):
    """Predicted seconds of one all-reduce of ``n`` elements (the slowest rank)."""
    p = links.topo.p
    if p == 1 or n == 0:
        return 0.0
    nbytes = n * itemsize
    seg = max(1, seg_bytes // itemsize)
    if algorithm == "ring":
        chunk = -(-n // p)
        return ring_time(links, p, chunk * itemsize, _nseg(chunk, seg), p - 1, 2 * (p - 1))
    if algorithm == "tree":
        t = 0.0
        for k in range(_log2ceil(p)):
            inter = links.crosses(1 << k)
            t += 2 * links.cost(inter, nbytes) + links.gamma(nbytes)
        return t
    if algorithm == "recursive_doubling":
        q = 1 << (p.bit_length() - 1)
        R = links.topo.per_node
        t = 0.0
        if p > q:  # fold and unfold
            t += 2 * links.cost(links.crosses(1), nbytes) + links.gamma(nbytes)
        mask = 1
        while mask < q:
            inter = links.crosses(mask)
            t += links.cost(inter, nbytes, flows=R if inter else 1) + links.gamma(nbytes)
            mask <<= 1
        return t
    if algorithm == "hierarchical":
        return _hier_time(links, n, itemsize, seg_bytes)
    if algorithm == "mpi":
        return _mpich_allreduce_time(links, n, itemsize)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _hier_time(links, n, itemsize, seg_bytes):
    """Pieces through three pipelined stages: members -> leader (the leader receives
    ``members`` pieces at once, which share its link, and sums them), the leaders' ring,
    leader -> members (sent at once, sharing the link again)."""
    topo, m = links.topo, links.m
    members = min(topo.per_node, topo.p) - 1
    nodes = topo.nodes
    pieces = hier_pieces(n, itemsize, seg_bytes)
    width = max(hi - lo for lo, hi in pieces) * itemsize
    gather = m.alpha_intra + members * width * m.beta_intra + members * links.gamma(width)
    out = m.alpha_intra + members * width * m.beta_intra
    if nodes > 1:
        wide = Links(m, Topology(nodes, 1))
        wide.multi = True
        ring = time_allreduce("ring", wide, width // itemsize, itemsize, seg_bytes)
    else:
        ring = 0.0
    stages = (gather, ring, out)
    return sum(stages) + (len(pieces) - 1) * max(stages)


def _mpich_allreduce_time(links, n, itemsize):
    """MPICH's all-reduce: recursive doubling up to 2 KiB (``time_allreduce``'s), else
    Rabenseifner's: after the fold of a non-power of two, a reduce-scatter by recursive
    halving whose round k exchanges half of what is left with the rank 2^k away (the
    largest halves travel the shortest distances, inside a node), then an all-gather by
    recursive doubling through the same rounds backwards. A round leaves the nodes or
    not as the recursive doubling's rounds do (``Links.crosses``), all of a node's ranks
    sharing its link when it does. Checked against SimGrid SMPI's own MPICH algorithm
    (``bench/simgrid.py``)."""
    p = links.topo.p
    nbytes = n * itemsize
    if nbytes <= 2048 or n < p:
        return time_allreduce("recursive_doubling", links, n, itemsize, 1 << 20)
    q = 1 << (p.bit_length() - 1)
    t = 0.0
    if p > q:  # fold and unfold
        t += 2 * links.cost(links.crosses(1), nbytes) + links.gamma(nbytes)
    R = links.topo.per_node
    part, mask = nbytes, 1
    while mask < q:
        part /= 2
        inter = links.crosses(mask)
        t += 2 * links.cost(inter, part, flows=R if inter else 1) + links.gamma(part)
        mask <<= 1
    return t


def time_reduce_scatter(algorithm, links, n, itemsize, seg_bytes):
    """Predicted seconds of one reduce-scatter of ``n`` elements: the ring's first
    ``p - 1`` steps; the tree's reduce, then a scatter of halving spans; recursive
    halving (the farthest partner first, halves shrinking); the hierarchical all-reduce;
    MPI's own taken to be recursive halving too (MPICH's for commutative operations)."""
    p = links.topo.p
    if p == 1 or n == 0:
        return 0.0
    nbytes = n * itemsize
    seg = max(1, seg_bytes // itemsize)
    if algorithm == "ring":
        chunk = -(-n // p)
        return ring_time(links, p, chunk * itemsize, _nseg(chunk, seg), p - 1, p - 1)
    if algorithm == "tree":
        t = 0.0
        for k in range(_log2ceil(p)):
            inter = links.crosses(1 << k)
            t += links.cost(inter, nbytes) + links.gamma(nbytes)
            t += links.cost(inter, nbytes / (2 << k))
        return t
    if algorithm in ("recursive_doubling", "mpi"):
        q = 1 << (p.bit_length() - 1)
        R = links.topo.per_node
        t = 0.0
        if p > q:  # the fold, and the odd ranks' chunks sent back
            t += links.cost(links.crosses(1), nbytes) + links.gamma(nbytes)
            t += links.cost(links.crosses(1), nbytes / p)
        part, mask = float(nbytes), q // 2
        while mask >= 1:
            part /= 2
            inter = links.crosses(mask)
            t += links.cost(inter, part, flows=R if inter else 1) + links.gamma(part)
            mask >>= 1
        return t
    if algorithm == "hierarchical":
        return _hier_time(links, n, itemsize, seg_bytes)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def time_bcast(algorithm, links, n, itemsize, seg_bytes):
    """Predicted seconds of one broadcast of ``n`` elements from rank 0: the tree's
    rounds of the whole buffer; the ring's and recursive doubling's scatter (halving
    spans) and all-gather; the hierarchical's tree among the leaders, then inside the
    nodes; MPI's own taken to be MPICH's (binomial below 12 KiB, else scatter and ring
    all-gather)."""
    p = links.topo.p
    if p == 1 or n == 0:
        return 0.0
    nbytes = n * itemsize
    if algorithm == "mpi":
        algorithm = "tree" if nbytes < 12 * 1024 else "ring"
    if algorithm == "tree":
        return sum(links.cost(links.crosses(1 << k), nbytes) for k in range(_log2ceil(p)))
    if algorithm == "hierarchical":
        topo, m = links.topo, links.m
        members = min(topo.per_node, p)
        t = _log2ceil(members) * (m.alpha_intra + nbytes * m.beta_intra)
        return t + _log2ceil(topo.nodes) * links.cost(True, nbytes)
    counts = list(even_split(n, p)[0])
    scatter = sum(links.cost(links.crosses(1 << k), nbytes / (2 << k))
                  for k in range(_log2ceil(p)))
    gather = time_allgatherv(algorithm, links, counts, itemsize, seg_bytes)
    return scatter + gather


def time_allgatherv(algorithm, links, counts, itemsize, seg_bytes):
    """Predicted seconds of one all-gather of ``counts`` elements per rank."""
    p = len(counts)
    total = sum(counts)
    if p == 1 or total == 0:
        return 0.0
    nbytes = total * itemsize
    big = max(counts) * itemsize
    seg = max(1, seg_bytes // itemsize)
    if algorithm in ("ring", "mpi"):
        return ring_time(links, p, big, _nseg(max(counts), seg), 0, p - 1)
    if algorithm == "tree":
        t = 0.0
        for k in range(_log2ceil(p)):  # gather (growing spans), then the broadcast
            inter = links.crosses(1 << k)
            t += links.cost(inter, min(nbytes, big << k)) + links.cost(inter, nbytes)
        return t
    if algorithm == "recursive_doubling":
        q = 1 << (p.bit_length() - 1)
        R = links.topo.per_node
        t = 2 * links.cost(links.crosses(1), nbytes) if p > q else 0.0
        mask = 1
        while mask < q:
            inter = links.crosses(mask)
            t += links.cost(inter, big * mask, flows=R if inter else 1)
            mask <<= 1
        return t
    if algorithm == "hierarchical":
        topo, m = links.topo, links.m
        members = min(topo.per_node, p) - 1
        t = members * (m.alpha_intra + big * m.beta_intra)
        if topo.nodes > 1:
            node_bytes = big * topo.per_node
            t += (topo.nodes - 1) * links.cost(True, node_bytes, topo.per_node)
        if members:
            t += _log2ceil(members + 1) * (m.alpha_intra + nbytes * m.beta_intra)
        return t
    raise ValueError(f"unknown algorithm {algorithm!r}")

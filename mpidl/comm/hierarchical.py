"""Node-aware all-reduce: inside each node over shared memory, across nodes among leaders.

On a cluster the link between nodes is the scarce resource; ranks of one node share
memory. A flat ring over all p ranks sends 2 (p - 1)/p of the buffer per rank, and on a
ring laid over nodes of r ranks every node boundary carries that too. The hierarchical
all-reduce moves only one buffer per node across the network:

1. each node reduces to its leader (its lowest rank) with a binomial tree
   (``tree.reduce``), over shared memory;
2. the leaders all-reduce among themselves with the ring (``ring.allreduce``: the
   bandwidth-optimal algorithm for the one link that matters);
3. each leader broadcasts the result inside its node (``tree.bcast``).

Every rank ends with its leader's bytes, so the result is the same bits everywhere, and
the summation order depends only on the node layout (never on timing).

The other collectives follow the same shape: ``bcast`` goes root -> its leader -> the
leaders -> each node; ``allgatherv`` gathers each node's blocks on its leader, passes them
round a ring of leaders and broadcasts inside each node; ``reduce`` and
``reduce_scatter`` are the all-reduce, kept at the root or cut into chunks (simple, and
the same bits as the all-reduce; a dedicated node-aware reduce-scatter would send less).

Which ranks share a node comes from the communicator (``Context.nodes``: MPI's
shared-memory split, or ``MPIDL_RANKS_PER_NODE`` to pretend, for tests, that blocks of
that many consecutive ranks are nodes). With one node, or one rank per node, the
algorithm is the tree's reduce + bcast or the ring, respectively.
"""

from mpi4py import MPI

from mpidl import env

from . import ring, tree


class _View:
    """Transport ``t`` restricted to ``ranks`` (rank i of the view is ``ranks[i]`` of
    ``t``): what the tree and the ring need, peers translated; messages are still sent
    and counted by ``t``."""

    def __init__(self, t, ranks):
        self._t, self._ranks = t, ranks
        self.rank, self.size = ranks.index(t.rank), len(ranks)
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size

    def send(self, buf, dest, *tag):
        self._t.send(buf, self._ranks[dest], *tag)

    def recv(self, buf, source, *rest):
        self._t.recv(buf, self._ranks[source], *rest)

    def isend(self, buf, dest, *tag):
        return self._t.isend(buf, self._ranks[dest], *tag)

    def irecv(self, buf, source, *tag):
        return self._t.irecv(buf, self._ranks[source], *tag)

    def sendrecv(self, sbuf, dest, rbuf, source, *rest):
        self._t.sendrecv(sbuf, self._ranks[dest], rbuf, self._ranks[source], *rest)

    def __getattr__(self, name):  # wait, waitall, combine, copy, ready, scratch, ...
        return getattr(self._t, name)


def groups(nodes):
    """(the ranks of each node in node order, the leaders) for ``nodes[rank]`` = node."""
    members = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    by_node = sorted(members.values())  # nodes ordered by their lowest rank
    return by_node, [ranks[0] for ranks in by_node]


def node_layout(comm):
    """The node number of every rank of the mpi4py communicator ``comm`` (collective):
    ranks that share memory share a node; nodes numbered in the order of their lowest
    rank. ``MPIDL_RANKS_PER_NODE=k`` pretends instead that each k consecutive ranks of the
    world are a node (tests on one machine; a group of every other world rank spans the
    nodes those ranks are on, as it would on a real cluster)."""
    size = comm.Get_size()
    per = env.number("MPIDL_RANKS_PER_NODE", int)
    if per:
        group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(size)), world)
        finally:
            group.Free()
            world.Free()
        nodes = [r // per for r in ranks]
        number = {node: i for i, node in enumerate(sorted(set(nodes)))}
        return [number[node] for node in nodes]
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = local.bcast(comm.Get_rank(), root=0)
    local.Free()
    leaders = comm.allgather(leader)
    number = {first: i for i, first in enumerate(sorted(set(leaders)))}
    return [number[first] for first in leaders]


def _layout(t, ctx):
    """(this rank's node's ranks, the leaders, every node's ranks)."""
    if ctx.node_of is None:  # (the first call is collective like every other)
        ctx.node_of = node_layout(t.comm)
    by_node, leaders = groups(ctx.nodes(t.size))
    local = next(ranks for ranks in by_node if t.rank in ranks)
    return local, leaders, by_node


MAX_PIECES = 16  # the all-reduce's pieces: enough to overlap, few enough to stay cheap


def _pieces(n, ctx, itemsize):
    """Element bounds of the pieces the all-reduce pipelines: a ring segment each, at
    most ``MAX_PIECES`` of them."""
    size = max(ctx.segment(itemsize), -(-n // MAX_PIECES))
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def allreduce(t, src, dst, op, ctx):
    """Piece by piece, so the three phases overlap: while the leader all-reduces piece k
    with the other leaders (waiting on the network), its node's later pieces are already
    on their way to it and piece k - 1's result on its way back. The leader sums its
    node's pieces in rank order, so the result depends on the layout only."""
    local, leaders, _ = _layout(t, ctx)
    pieces = _pieces(src.size, ctx, src.itemsize)
    if t.rank != local[0]:  # a member: my pieces to the leader, the results back
        leader = local[0]
        sends = [t.isend(src[lo:hi], leader) for lo, hi in pieces]
        recvs = []
        for req, (lo, hi) in zip(sends, pieces):
            t.wait(req)  # (src may be dst: the piece has left before its result lands)
            recvs.append(t.irecv(dst[lo:hi], leader))
        t.waitall(recvs)
        return
    members = local[1:]
    width = max(hi - lo for lo, hi in pieces)
    slots = t.scratch.get("hierarchical pieces", 2 * len(members) * width, src.dtype) \
        if members else None

    def post(k):  # receive piece k of every member into slot k % 2
        lo, hi = pieces[k]
        base = (k % 2) * len(members) * width
        return [t.irecv(slots[base + j * width:base + j * width + hi - lo], m)
                for j, m in enumerate(members)]

    among = _View(t, leaders) if len(leaders) > 1 else None
    results = []
    pending = post(0) if members else []
    for k, (lo, hi) in enumerate(pieces):
        current, pending = pending, (post(k + 1) if members and k + 1 < len(pieces) else [])
        out, acc = dst[lo:hi], src[lo:hi]
        base = (k % 2) * len(members) * width
        for j, req in enumerate(current):
            t.wait(req)
            t.combine(op.fn, acc, slots[base + j * width:base + j * width + hi - lo], out)
            acc = out
        if not members and src is not dst:
            t.copy(out, acc)
        if among is not None:
            ring.allreduce(among, out, out, op, ctx)
        results += [t.isend(out, m) for m in members]
    t.waitall(results)


def reduce(t, src, dst, root, op, ctx):
    """The all-reduce, kept at ``root`` (a root that is not its node's leader costs one
    more intra-node message than a reduce would; the result is the all-reduce's bits)."""
    work = t.scratch.get("hierarchical", src.size, src.dtype)
    allreduce(t, src, work, op, ctx)
    if dst is not None:
        t.copy(dst, work)


def reduce_scatter(t, src, out, op, counts, displs, ctx):
    """The all-reduce, of which each rank keeps its chunk."""
    work = t.scratch.get("hierarchical", src.size, src.dtype)
    allreduce(t, src, work, op, ctx)
    lo = displs[t.rank]
    t.copy(out, work[lo:lo + counts[t.rank]])


def bcast(t, buf, root, ctx):
    """``root`` -> its node's leader, a tree among the leaders, a tree inside each node:
    the buffer crosses the network once per node."""
    local, leaders, by_node = _layout(t, ctx)
    home = next(ranks for ranks in by_node if root in ranks)
    if root != home[0]:
        if t.rank == root:
            t.send(buf, home[0])
        elif t.rank == home[0]:
            t.recv(buf, root)
    if t.rank == local[0] and len(leaders) > 1:
        tree.bcast(_View(t, leaders), buf, leaders.index(home[0]))
    if len(local) > 1:
        tree.bcast(_View(t, local), buf, 0)


def allgatherv(t, buf, counts, displs, ctx):
    """Each node's blocks gathered on its leader, the leaders pass node blocks round a
    ring (each node's blocks cross the network to every other node once), then each
    leader broadcasts the whole buffer inside its node."""
    local, leaders, by_node = _layout(t, ctx)

    def block(rank):
        return buf[displs[rank]:displs[rank] + counts[rank]]

    me = t.rank
    if me != local[0]:
        if counts[me]:
            t.send(block(me), local[0])
    else:
        for rank in local[1:]:
            if counts[rank]:
                t.recv(block(rank), rank)
        n = len(leaders)
        if n > 1:
            i = leaders.index(me)
            right, left = leaders[(i + 1) % n], leaders[(i - 1) % n]
            for step in range(n - 1):
                sends = [t.isend(block(r), right) for r in by_node[(i - step) % n]
                         if counts[r]]
                for r in by_node[(i - step - 1) % n]:
                    if counts[r]:
                        t.recv(block(r), left)
                t.waitall(sends)
    if len(local) > 1 and buf.size:
        tree.bcast(_View(t, local), buf, 0)

"""Binomial-tree algorithms: log2(p) rounds, whole buffers, for latency rather than bandwidth.

Ranks are numbered relative to the root (``v = (rank - root) % p``). In a binomial tree
rank v's parent is v with its lowest set bit cleared, and the subtree under v is the
contiguous range ``[v, v + lowbit(v))``, so gathers and scatters move one contiguous
block per message when blocks are laid out in relative-rank order.

- ``reduce``: each round, ranks with bit ``mask`` set send their partial result to
  ``v - mask`` and drop out; the others combine what they receive.
- ``bcast``: the same tree walked from the root down.
- ``allreduce`` = ``reduce`` to rank 0 + ``bcast`` from rank 0, so every rank ends with
  the root's bytes (bitwise identical results everywhere).
- ``allgatherv`` = binomial gather to rank 0 + ``bcast``; ``reduce_scatter`` = ``reduce``
  + binomial scatter.
"""


def _real(v, root, p):
    return (v + root) % p


def reduce(t, src, dst, root, op, ctx=None):
    """Reduction of ``src`` over all ranks into ``dst`` at ``root`` (``dst`` is None, or
    clobbered, elsewhere)."""
    p, rank = t.size, t.rank
    fn = op.fn
    if dst is None:
        dst = t.scratch.get("work", src.size, src.dtype)
    v = (rank - root) % p
    acc = src
    tmp = None
    mask = 1
    t.ready()
    while mask < p:
        if v & mask:
            t.send(acc, _real(v - mask, root, p))
            return
        child = v + mask
        if child < p:
            if tmp is None:
                tmp = t.scratch.get("tree", src.size, src.dtype)
            t.recv(tmp, _real(child, root, p))
            t.combine(fn, acc, tmp, dst)
            acc = dst
        mask <<= 1
    if acc is not dst:
        t.copy(dst, acc)


def bcast(t, buf, root, ctx=None):
    """Broadcast ``buf`` from ``root`` (in place)."""
    p, rank = t.size, t.rank
    v = (rank - root) % p
    mask = 1
    t.ready()
    while mask < p:
        if v & mask:
            t.recv(buf, _real(v - mask, root, p))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            t.send(buf, _real(v + mask, root, p))
        mask >>= 1


def allreduce(t, src, dst, op, ctx=None):
    reduce(t, src, dst, 0, op)
    bcast(t, dst, 0)


def _span(counts, displs, a, b):
    """Element range covering blocks ``[a, b)``."""
    return displs[a], displs[b - 1] + counts[b - 1]


def gather(t, buf, counts, displs, root=0):
    """Binomial gather of blocks (relative-rank order) into ``buf`` at ``root``."""
    p, rank = t.size, t.rank
    v = (rank - root) % p
    mask = 1
    t.ready()
    while mask < p:
        if v & mask:
            lo, hi = _span(counts, displs, v, min(v + mask, p))
            if hi > lo:
                t.send(buf[lo:hi], _real(v - mask, root, p))
            return
        child = v + mask
        if child < p:
            lo, hi = _span(counts, displs, child, min(child + mask, p))
            if hi > lo:
                t.recv(buf[lo:hi], _real(child, root, p))
        mask <<= 1


def scatter(t, buf, counts, displs, root=0):
    """Binomial scatter from ``root``: afterwards rank v holds block v (relative order)."""
    p, rank = t.size, t.rank
    v = (rank - root) % p
    mask = 1
    t.ready()
    while mask < p:
        if v & mask:
            lo, hi = _span(counts, displs, v, min(v + mask, p))
            if hi > lo:
                t.recv(buf[lo:hi], _real(v - mask, root, p))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        child = v + mask
        if child < p:
            lo, hi = _span(counts, displs, child, min(child + mask, p))
            if hi > lo:
                t.send(buf[lo:hi], _real(child, root, p))
        mask >>= 1


def allgatherv(t, buf, counts, displs, ctx=None):
    gather(t, buf, counts, displs, 0)
    bcast(t, buf, 0)


def reduce_scatter(t, src, out, op, counts, displs, ctx=None):
    """Reduce everything to rank 0, then scatter the chunks; chunk ``rank`` lands in ``out``."""
    work = t.scratch.get("work", src.size, src.dtype)
    reduce(t, src, work, 0, op)
    scatter(t, work, counts, displs, 0)
    lo = displs[t.rank]
    t.copy(out, work[lo:lo + counts[t.rank]])

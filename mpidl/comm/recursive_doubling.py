"""Recursive doubling (and halving): log2(p) rounds of pairwise exchange, for small messages.

In round k a rank exchanges with the rank whose number differs in bit k, so after
log2(p) rounds every rank has combined every contribution. All-reduce exchanges the
whole buffer each round (latency-optimal); all-gather doubles the block range it holds;
reduce-scatter halves the range it is responsible for (recursive halving).

Non-powers of two fold first (as MPICH does): with ``q`` the largest power of two <= p
and ``rem = p - q``, among the first ``2 * rem`` ranks each even rank hands its data to
the odd rank above it and sits out; the remaining q ranks run the power-of-two algorithm
as "virtual" ranks 0..q-1; at the end each odd rank hands the result back to its even
partner. Virtual rank v stands for real ranks ``{2v, 2v+1}`` (v < rem) or ``{v + rem}``,
so the blocks it holds stay contiguous in rank order.

Results of ``allreduce`` are bitwise identical on all ranks: partners compute ``a + b``
and ``b + a``, which IEEE arithmetic makes equal.
"""

from functools import lru_cache

from . import tree
from .layout import even_split


@lru_cache(maxsize=64)
def plan(me, p):
    """(role, virtual rank, [partner real ranks per round], q, rem) for index ``me`` of p.

    role: "out" (even rank folded into its neighbour), "odd" (absorbs its even
    neighbour), "plain". Indices are relative (callers map them to real ranks).
    """
    q = 1
    while q * 2 <= p:
        q *= 2
    rem = p - q
    if me < 2 * rem:
        role, v = ("out", -1) if me % 2 == 0 else ("odd", me // 2)
    else:
        role, v = "plain", me - rem
    partners = []
    if v >= 0:
        mask = 1
        while mask < q:
            w = v ^ mask
            partners.append(2 * w + 1 if w < rem else w + rem)
            mask <<= 1
    return role, v, tuple(partners), q, rem


def _vfirst(v, rem):
    """First real index that virtual rank v stands for."""
    return 2 * v if v < rem else v + rem


def allreduce(t, src, dst, op, ctx=None):
    """``dst`` = reduction of ``src`` over all ranks; ``src`` may be ``dst``."""
    rank = t.rank
    role, _, partners, _, _ = plan(rank, t.size)
    if t.device:
        t.ready()
    if role == "out":
        t.send(src, rank + 1)
        t.recv(dst, rank + 1)
        return
    fn = op.fn
    acc = src
    tmp = t.scratch.get("rd", src.size, src.dtype)
    if role == "odd":
        t.recv(tmp, rank - 1)
        t.combine(fn, acc, tmp, dst)
        acc = dst
    sendrecv, combine = t.sendrecv, t.combine
    for partner in partners:
        sendrecv(acc, partner, tmp, partner)
        combine(fn, acc, tmp, dst)
        acc = dst
    if role == "odd":
        t.send(dst, rank - 1)
    if acc is not dst:
        t.copy(dst, acc)


def allgatherv(t, buf, counts, displs, ctx=None, root=0):
    """Fill ``buf`` with every block; block ``me`` is in place. Blocks are numbered from
    ``root`` (block i belongs to rank ``(i + root) % p``), which a broadcast uses."""
    p = t.size
    me = (t.rank - root) % p
    real = (lambda i: (i + root) % p) if root else (lambda i: i)
    role, v, partners, q, rem = plan(me, p)
    n = displs[-1] + counts[-1]
    t.ready()
    if role == "out":
        lo = displs[me]
        t.send(buf[lo:lo + counts[me]], real(me + 1))
        t.recv(buf[:n], real(me + 1))
        return
    if role == "odd":
        lo = displs[me - 1]
        t.recv(buf[lo:lo + counts[me - 1]], real(me - 1))

    def start(w):  # first element held by virtual rank w (w == q: the end)
        return n if w >= q else displs[_vfirst(w, rem)]

    mask = 1
    for partner in partners:
        base = v & ~(mask - 1)
        pbase = base ^ mask
        slo, shi = start(base), start(base + mask)
        rlo, rhi = start(pbase), start(pbase + mask)
        t.sendrecv(buf[slo:shi], real(partner), buf[rlo:rhi], real(partner))
        mask <<= 1
    if role == "odd":
        t.send(buf[:n], real(me - 1))


def reduce_scatter(t, src, out, op, counts, displs, ctx=None):
    """Recursive halving: chunk ``rank`` of the reduction into ``out``."""
    p, rank = t.size, t.rank
    fn = op.fn
    work = t.scratch.get("work", src.size, src.dtype)
    role, v, partners, q, rem = plan(rank, p)
    n = displs[-1] + counts[-1]
    t.ready()
    if role == "out":
        t.send(src, rank + 1)
        t.recv(out, rank + 1)
        return
    acc = src
    if role == "odd":
        tmp = t.scratch.get("rd", n, src.dtype)
        t.recv(tmp, rank - 1)
        t.combine(fn, src, tmp, work)
        acc = work

    def start(w):
        return n if w >= q else displs[_vfirst(w, rem)]

    vlo, vhi = 0, q
    mask = q // 2
    # Partners in halving order: the farthest first.
    for partner in reversed(partners):
        mid = vlo + mask
        if v < mid:
            keep, give = (vlo, mid), (mid, vhi)
        else:
            keep, give = (mid, vhi), (vlo, mid)
        klo, khi = start(keep[0]), start(keep[1])
        glo, ghi = start(give[0]), start(give[1])
        tmp = t.scratch.get("rd", khi - klo, src.dtype)
        t.sendrecv(acc[glo:ghi], partner, tmp, partner)
        t.combine(fn, acc[klo:khi], tmp, work[klo:khi])
        acc = work
        vlo, vhi = keep
        mask >>= 1
    if role == "odd":
        lo = displs[rank - 1]
        t.send(acc[lo:lo + counts[rank - 1]], rank - 1)
    lo = displs[rank]
    t.copy(out, acc[lo:lo + counts[rank]])


def reduce(t, src, dst, root, op, ctx=None):
    """Recursive-doubling all-reduce whose result every rank has; ``dst`` matters at root
    (elsewhere it is None and a scratch work buffer takes the result)."""
    if dst is None:
        dst = t.scratch.get("work", src.size, src.dtype)
    allreduce(t, src, dst, op)


def bcast(t, buf, root, ctx=None):
    """Binomial scatter of the chunks from ``root`` + recursive-doubling all-gather."""
    counts, displs = even_split(buf.size, t.size)
    tree.scatter(t, buf, counts, displs, root)
    allgatherv(t, buf, counts, displs, root=root)

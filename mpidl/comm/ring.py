"""Ring algorithms: bandwidth-optimal reduce-scatter and all-gather around a ring of ranks.

All-reduce is reduce-scatter followed by all-gather: 2(p-1) steps, in each of which every
rank sends one chunk (n/p elements) to its right neighbour and receives one from its left,
so every rank moves 2(p-1)/p * n elements whatever p is.

One pipeline runs all steps. At step i a rank sends chunk ``c0 - i`` and receives chunk
``c0 - 1 - i`` (mod p); in the reduce-scatter steps the received chunk is combined with
the local one, in the all-gather steps it lands in place. Each chunk travels in segments
of ``segment`` elements: as soon as segment k of step i has arrived (and been reduced) it
is sent on as segment k of step i+1 and the receive for step i+1 is posted into the
scratch slot it freed. So sends, receives and reductions of different segments overlap,
a reduction works on a segment that is still in cache, and the receive scratch is one
chunk long whatever the number of steps.

Chunk c of a buffer is ``[displs[c], displs[c] + counts[c])``; the algorithms never assume
equal counts, so the same code serves ``allgatherv`` and rotated layouts (a broadcast
numbers chunks from its root).
"""

from . import tree
from .layout import even_split


def _pipeline(t, src, dst, counts, displs, fn, c0, nred, nsteps, seg, final=None):
    """Run ``nsteps`` ring steps; the first ``nred`` reduce with ``fn`` (see module doc).

    ``src`` is read by the reduce steps (and sent at step 0); results go to ``dst``,
    except that the last step's chunk goes to ``final`` when it is given (the chunk a
    reduce-scatter returns). ``src`` may be ``dst``.
    """
    if nsteps <= 0:
        return
    p = t.size
    right, left = t.right, t.left
    isend, irecv, wait = t.isend, t.irecv, t.wait
    scratch = t.scratch.get("ring", max(counts) if nred else 0, dst.dtype)

    def bounds(c):
        lo, n = displs[c], counts[c]
        return [(lo + k, lo + min(k + seg, n)) for k in range(0, n, seg)]

    def target(i, k, lo, hi):
        return scratch[k * seg:k * seg + (hi - lo)] if i < nred else dst[lo:hi]

    t.ready()
    # Send requests by the start of the region they read. Before a receive may write a
    # region of dst, the sends that read it must be complete (MPI's rule for send
    # buffers). In a ring they always are in practice, because what arrives depends on
    # what was sent, but the wait makes it so by the standard too.
    sent = {}
    sends = []

    def send(buf, lo):
        req = isend(buf, right)
        sends.append(req)
        sent[lo] = req

    def post_recv(i, k, lo, hi):
        if i >= nred:
            req = sent.pop(lo, None)
            if req is not None:
                wait(req)
        return irecv(target(i, k, lo, hi), left)

    for lo, hi in bounds(c0 % p):
        send((src if nred else dst)[lo:hi], lo)
    cur = bounds((c0 - 1) % p)
    recvs = [post_recv(0, k, lo, hi) for k, (lo, hi) in enumerate(cur)]
    last = nsteps - 1
    for i in range(nsteps):
        nxt = bounds((c0 - 2 - i) % p) if i < last else []
        new = []
        for k, (lo, hi) in enumerate(cur):
            wait(recvs[k])
            if i < nred:
                if final is not None and i == last:
                    out = final[lo - cur[0][0]:hi - cur[0][0]]
                else:
                    out = dst[lo:hi]
                t.combine(fn, src[lo:hi], scratch[k * seg:k * seg + (hi - lo)], out)
            else:
                out = dst[lo:hi]
            if i < last:
                # slot k is free again: post the receive of the next step's segment k,
                # then pass this segment on (it is the next step's send).
                if k < len(nxt):
                    new.append(post_recv(i + 1, k, *nxt[k]))
                send(out, lo)
        for k in range(len(cur), len(nxt)):
            new.append(post_recv(i + 1, k, *nxt[k]))
        recvs, cur = new, nxt
    t.waitall(sends)


def allreduce(t, src, dst, op, ctx):
    """``dst = op-reduction of src over all ranks``; ``src`` may be ``dst`` (in place)."""
    p = t.size
    if p == 1:
        if dst is not src:
            t.copy(dst, src)
        return
    counts, displs = even_split(src.size, p)
    _pipeline(t, src, dst, counts, displs, op.fn, t.rank - 1, p - 1, 2 * (p - 1),
              ctx.segment(src.itemsize))


def reduce_scatter(t, src, out, op, counts, displs, ctx):
    """Chunk ``rank`` of the reduction into ``out`` (work memory from ``t.scratch``)."""
    if t.size == 1:
        t.copy(out, src)
        return
    p = t.size
    work = t.scratch.get("work", src.size, src.dtype)
    _pipeline(t, src, work, counts, displs, op.fn, t.rank - 1, p - 1, p - 1,
              ctx.segment(src.itemsize), final=out)


def allgatherv(t, buf, counts, displs, ctx):
    """Fill ``buf`` with every chunk; chunk ``rank`` is already in place."""
    _allgatherv(t, buf, counts, displs, ctx.segment(buf.itemsize))


def _allgatherv(t, buf, counts, displs, seg, me=None):
    """The ring all-gather; chunk ``me`` (default: rank) is already in place."""
    me = t.rank if me is None else me
    _pipeline(t, buf, buf, counts, displs, None, me, 0, t.size - 1, seg)


def reduce(t, src, dst, root, op, ctx):
    """Ring reduce-scatter, then every rank sends its reduced chunk to ``root``.

    The reduction lands in ``dst`` at root; elsewhere a scratch work buffer is used.
    """
    p, rank = t.size, t.rank
    if p == 1:
        if dst is not src:
            t.copy(dst, src)
        return
    n = src.size
    if rank != root:
        dst = t.scratch.get("work", n, src.dtype)
    counts, displs = even_split(n, p)
    _pipeline(t, src, dst, counts, displs, op.fn, rank - 1, p - 1, p - 1,
              ctx.segment(src.itemsize))
    if rank == root:
        reqs = [t.irecv(dst[displs[c]:displs[c] + counts[c]], c)
                for c in range(p) if c != root and counts[c]]
        t.waitall(reqs)
    elif counts[rank]:
        t.send(dst[displs[rank]:displs[rank] + counts[rank]], root)


def bcast(t, buf, root, ctx):
    """Binomial scatter of the chunks from ``root``, then a ring all-gather (chunks in
    root-relative order, so the ring is the ordinary one)."""
    p = t.size
    counts, displs = even_split(buf.size, p)
    tree.scatter(t, buf, counts, displs, root)
    _allgatherv(t, buf, counts, displs, ctx.segment(buf.itemsize), me=(t.rank - root) % p)

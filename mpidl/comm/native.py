"""MPI's own collectives ("mpi" algorithm), on the same buffers as the home-made ones.

Reductions pass the real MPI datatype; pure data movement passes bytes. float16 and
bfloat16 words never reach the reductions here: the communicator sends them to the ring
instead (``ops.own_reduction``), because MPIX_C_FLOAT16 is an extension some MPI
libraries lack (Open MPI 4.1) and no MPI has a bfloat16 type. With GPU arrays and an MPI that is not CUDA-aware the whole buffer is staged
through pinned host memory and MPI reduces it on the host: that is the one case where a
reduction does not run on the device, because MPI itself performs it.

What MPI sends inside these calls cannot be observed from outside MPI, so the
communicator's counters count their calls (``native_calls``) but no messages or bytes.
"""

from mpi4py import MPI

from .ops import mpi_datatype

IN_PLACE = MPI.IN_PLACE
BYTE = MPI.BYTE


class _Staged:
    """Host copies of device arrays for one native call (staged transport only)."""

    def __init__(self, t):
        self.t = t
        self.back = []

    def host(self, dev, copy_in=True, copy_out=False):
        h = self.t.to_host(dev) if copy_in else self.t.staging.take(dev.size, dev.dtype)
        if copy_out:
            self.back.append((h, dev))
        return h


def _stage(t):
    return _Staged(t) if t.staged else None


def allreduce(t, src, dst, op, ctx=None):
    mop = op.mpi
    dt = mpi_datatype(dst.dtype)
    st = _stage(t)
    t.ready()
    if st is not None:
        h = st.host(src, copy_in=True, copy_out=False)
        if src is dst:
            st.back.append((h, dst))
            t.comm.Allreduce(IN_PLACE, [h, dt], mop)
        else:
            hd = st.host(dst, copy_in=False, copy_out=True)
            t.comm.Allreduce([h, dt], [hd, dt], mop)
        _finish(t, st)
        return
    if src is dst:
        t.comm.Allreduce(IN_PLACE, [dst, dt], mop)
    else:
        t.comm.Allreduce([src, dt], [dst, dt], mop)


def reduce(t, src, dst, root, op, ctx=None):
    """Result in ``dst`` at root; ``dst`` is None elsewhere."""
    mop = op.mpi
    dt = mpi_datatype(src.dtype)
    st = _stage(t)
    t.ready()
    is_root = t.rank == root
    if st is not None:
        src = st.host(src)
        if is_root:
            dst = st.host(dst, copy_in=False, copy_out=True)
    if is_root:
        if src is dst:
            t.comm.Reduce(IN_PLACE, [dst, dt], mop, root)
        else:
            t.comm.Reduce([src, dt], [dst, dt], mop, root)
    else:
        t.comm.Reduce([src, dt], None, mop, root)
    _finish(t, st)


def reduce_scatter(t, src, out, op, counts, displs=None, ctx=None):
    mop = op.mpi
    dt = mpi_datatype(src.dtype)
    st = _stage(t)
    t.ready()
    if st is not None:
        src = st.host(src)
        out = st.host(out, copy_in=False, copy_out=True)
    if out.size == 0:  # MPI rejects aliased buffers even when one of them is empty
        out = t.scratch.get("empty", 1, src.dtype)[:0]
    t.comm.Reduce_scatter([src, dt], [out, dt], list(counts), mop)
    _finish(t, st)


def bcast(t, buf, root, ctx=None):
    st = _stage(t)
    t.ready()
    if st is not None:
        buf = st.host(buf, copy_in=t.rank == root, copy_out=t.rank != root)
    t.comm.Bcast([buf, BYTE], root)
    _finish(t, st)


def allgatherv(t, buf, counts, displs, ctx=None):
    """In place: block ``rank`` of ``buf`` is this rank's contribution."""
    st = _stage(t)
    t.ready()
    if st is not None:
        buf = st.host(buf, copy_in=True, copy_out=True)
    size = buf.dtype.itemsize
    bcounts = [c * size for c in counts]
    bdispls = [d * size for d in displs]
    t.comm.Allgatherv(IN_PLACE, [buf, (bcounts, bdispls), BYTE])
    _finish(t, st)


def _finish(t, st):
    """Copy staged results back to the device and hand the staging regions back."""
    if st is None:
        return
    for h, dev in st.back:
        t.to_device(h, dev)
    t.staging.reset()

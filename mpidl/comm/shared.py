"""Collectives through memory the ranks of one node share: no messages, only loads and stores.

When every rank of a communicator sits on one node, each can read the others' buffers
directly: host arrays through an MPI shared-memory window (``MPI_Win_allocate_shared``),
device arrays through CUDA IPC (each rank's device buffer mapped into the others'
address space with ``cudaIpcOpenMemHandle``). For GPU arrays under an MPI that is not
CUDA-aware this replaces the trip device -> pinned host -> MPI -> host -> device by
device-to-device reads: the bytes never leave the GPU.

Every rank owns one slot (two, alternating between calls) of the size of the buffer. An
all-reduce is three steps with two synchronizations (``NodeMemory.fence``: the device's
stream finished, then a barrier):

1. each rank copies its ``src`` into its slot; fence;
2. rank r reduces chunk r (``layout.even_split``) of every rank's slot, in rank order
   (``((s0 + s1) + s2) + ...``), into its ``dst`` and into its own slot; fence;
3. each rank copies the other chunks from their owners' slots into its ``dst``.

So every element is reduced once, by one rank, in an order fixed by the rank numbers
alone: the result is the same bits on every rank and from run to run. No fence ends
step 3: the next call writes the other slot, and the call after it writes this one
only after its own first fence, which every rank reaches after finishing its reads.

``reduce_scatter`` is steps 1-2 (the chunk into ``out``), ``reduce`` steps 1-2 plus the
root reading every chunk, ``allgatherv`` each rank's block into its slot and everyone
reading the others', ``bcast`` the root's buffer into its slot and everyone reading it.

Counting: nothing is sent, so the transport counts no messages; its byte counter gets
the bytes the other ranks read from this rank's slot (what it would have sent).

Where it cannot run: a communicator over several nodes (a clear error: ``hierarchical``
is the algorithm for that), and device arrays where CUDA IPC is unavailable (ranks that
see different GPUs through ``CUDA_VISIBLE_DEVICES``, or a platform without IPC): then
all ranks agree on it at set-up, say why once, and take MPI's own collectives.
"""

import logging

import numpy as np
from mpi4py import MPI

from . import native, ring
from .layout import even_split
from .ops import own_reduction

log = logging.getLogger("mpidl.comm")

_MIN_SLOT = 1 << 20  # bytes; slots grow to the next power of two above what a call needs


class NodeMemory:
    """Each rank's two slots, readable by every rank of the (one-node) communicator.

    ``views(nbytes, dtype, n)`` hands out the slots of the current call, one array per
    rank; ``fence()`` orders everyone's stores before everyone's loads. Growing (a call
    larger than the slots) and ``close()`` are collective, as every call of a collective
    is.
    """

    def __init__(self, t):
        self.t = t
        self.comm = t.comm
        self.device = t.xp is not np
        self.capacity = 0  # bytes per slot
        self.parity = 0
        self.failed = None  # why device memory could not be shared (then: MPI's own calls)
        self.said = False   # the fallback has been logged
        self._views = {}
        self._mem = None    # host: the window; device: this rank's cupy Memory
        self._peers = []    # device: every rank's base pointer (own included)
        self._opened = []   # device: the pointers opened from other ranks' handles
        self._bases = []    # host: every rank's slots as a uint8 array
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=t.rank)
        on_node = node.Get_size()
        node.Free()
        if on_node != t.size:
            raise ValueError(
                f"algorithm 'shared' needs every rank of the communicator on one node; "
                f"rank {t.rank} shares memory with {on_node} of its {t.size} ranks: use "
                "'hierarchical' (shared memory inside nodes, messages between them) or "
                "'auto'")

    @property
    def nbytes(self):
        return 2 * self.capacity

    # -- set-up -----------------------------------------------------------------------
    def _grow(self, nbytes):
        need = _MIN_SLOT
        while need < nbytes:
            need *= 2
        self._release()
        self.capacity = need
        if self.device:
            self._map_device(2 * need)
        else:
            self._mem = MPI.Win.Allocate_shared(2 * need, 1, comm=self.comm)
            self._mem.Lock_all(MPI.MODE_NOCHECK)
            self._bases = [np.frombuffer(self._mem.Shared_query(r)[0], dtype=np.uint8)
                           for r in range(self.t.size)]

    def _map_device(self, nbytes):
        """Allocate this rank's device slots and map every other rank's (all ranks agree
        whether it worked; if not, ``failed`` says why and nothing stays allocated)."""
        cp = self.t.xp
        runtime = cp.cuda.runtime
        error = None
        handle = None
        try:
            self._mem = cp.cuda.Memory(nbytes)
            handle = runtime.ipcGetMemHandle(self._mem.ptr)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"rank {self.t.rank}: cudaIpcGetMemHandle: {e}"
        handles = self.comm.allgather((handle, error))
        if error is None:
            errors = [e for _, e in handles if e]
            if not errors:
                try:
                    for r, (h, _) in enumerate(handles):
                        if r == self.t.rank:
                            self._peers.append(self._mem.ptr)
                        else:
                            ptr = runtime.ipcOpenMemHandle(h)  # peer access enabled lazily
                            self._opened.append(ptr)
                            self._peers.append(ptr)
                except Exception as e:  # noqa: BLE001
                    error = f"rank {self.t.rank}: cudaIpcOpenMemHandle of rank {r}: {e}"
        errors = [e for e in self.comm.allgather(error) if e]
        errors += [e for _, e in handles if e and e not in errors]
        if errors:  # the same list on every rank: all of them give up here, together
            self.failed = errors[0]
            for ptr in self._opened:
                runtime.ipcCloseMemHandle(ptr)
            self.comm.Barrier()  # nobody holds a mapping of the memory freed below
            self._mem = None
            self._opened, self._peers = [], []
            self.capacity = 0

    def _release(self):
        """Give the slots back (collective: no rank may still read them)."""
        if self._mem is None:
            return
        if self.device:
            self.t.xp.cuda.get_current_stream().synchronize()
            self.comm.Barrier()
            for ptr in self._opened:
                self.t.xp.cuda.runtime.ipcCloseMemHandle(ptr)
        else:
            self._bases = []
            self.comm.Barrier()
            self._mem.Unlock_all()
            self._mem.Free()
        self._mem = None
        self._opened, self._peers = [], []
        self._views.clear()
        self.capacity = 0

    def close(self):
        self._release()

    # -- per call ---------------------------------------------------------------------
    def views(self, nbytes, dtype, n):
        """The slots of this call (one array of ``n`` items of ``dtype`` per rank);
        alternates between each rank's two slots."""
        if nbytes > self.capacity:
            self._grow(nbytes)
            if self.failed:
                return None
        self.parity ^= 1
        key = (self.parity, dtype, n)
        views = self._views.get(key)
        if views is None:
            offset = self.parity * self.capacity
            if self.device:
                views = [self._device_array(ptr + offset, dtype, n) for ptr in self._peers]
            else:
                views = [base[offset:offset + nbytes].view(dtype) for base in self._bases]
            if len(self._views) > 64:
                self._views.clear()
            self._views[key] = views
        return views

    def _device_array(self, ptr, dtype, n):
        cp = self.t.xp
        mem = cp.cuda.UnownedMemory(ptr, n * np.dtype(dtype).itemsize, self,
                                    device_id=cp.cuda.Device().id)
        return cp.ndarray((n,), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def fence(self):
        """Every rank's stores so far are visible to every rank's loads after it."""
        if self.device:
            self.t.xp.cuda.get_current_stream().synchronize()
            self.comm.Barrier()
        else:
            self._mem.Sync()
            self.comm.Barrier()
            self._mem.Sync()


def _memory(t):
    mem = t.node_memory
    if mem is None:
        mem = t.node_memory = NodeMemory(t)
    return mem


def _slots(t, nbytes, dtype, n):
    """(this call's slots, or None when device memory cannot be shared: then the caller
    runs MPI's own collective; the reason is logged once, on rank 0)."""
    mem = _memory(t)
    views = mem.views(nbytes, dtype, n) if not mem.failed else None
    if views is None and not mem.said:
        mem.said = True
        if t.rank == 0:
            log.warning("algorithm 'shared': device memory cannot be shared between the "
                        "ranks (%s); using MPI's own collectives instead", mem.failed)
    return mem, views


def _fallback(kind, dtype=None):
    """MPI's own collective, or the ring for words MPI cannot reduce (float16, bfloat16:
    ``ops.own_reduction``)."""
    if dtype is not None and own_reduction(dtype):
        return getattr(ring, kind)
    return getattr(native, kind)


def _reduce_chunk(slots, lo, hi, out, op):
    """``out`` = slots[0][lo:hi] op slots[1][lo:hi] op ... in rank order."""
    fn = op.fn
    fn(slots[0][lo:hi], slots[1][lo:hi], out=out)
    for s in slots[2:]:
        fn(out, s[lo:hi], out=out)


def _reduce_and_publish(t, mem, slots, src, op, dst):
    """Steps 1-2 of the module doc: ``src`` into this rank's slot, this rank's chunk of
    the reduction into ``dst`` (scratch when ``dst`` is None) and back into its slot for
    the others to read. Returns the chunks' (counts, displs)."""
    me = t.rank
    counts, displs = even_split(src.size, t.size)
    mine = slots[me]
    mine[...] = src
    mem.fence()
    lo, hi = displs[me], displs[me] + counts[me]
    if hi > lo:
        out = dst[lo:hi] if dst is not None else t.scratch.get("shared", hi - lo, src.dtype)
        _reduce_chunk(slots, lo, hi, out, op)
        mine[lo:hi] = out
    mem.fence()
    return counts, displs


def _read_others(t, slots, buf, counts, displs):
    """Every other rank's block of ``buf`` from its slot."""
    for r in range(t.size):
        if r != t.rank and counts[r]:
            buf[displs[r]:displs[r] + counts[r]] = slots[r][displs[r]:displs[r] + counts[r]]


def _count(t, nbytes):
    t.count[2] += nbytes


def allreduce(t, src, dst, op, ctx=None):
    mem, slots = _slots(t, src.nbytes, src.dtype, src.size)
    if slots is None:
        return _fallback("allreduce", src.dtype)(t, src, dst, op, ctx)
    counts, displs = _reduce_and_publish(t, mem, slots, src, op, dst)
    _read_others(t, slots, dst, counts, displs)
    mine = counts[t.rank]
    _count(t, (src.size - mine + (t.size - 1) * mine) * src.itemsize)
    _done(t, mem)


def reduce_scatter(t, src, out, op, counts, displs, ctx=None):
    mem, slots = _slots(t, src.nbytes, src.dtype, src.size)
    if slots is None:
        return _fallback("reduce_scatter", src.dtype)(t, src, out, op, counts, displs, ctx)
    me = t.rank
    slots[me][...] = src
    mem.fence()
    if counts[me]:
        _reduce_chunk(slots, displs[me], displs[me] + counts[me], out, op)
    _count(t, (src.size - counts[me]) * src.itemsize)
    _done(t, mem)


def reduce(t, src, dst, root, op, ctx=None):
    mem, slots = _slots(t, src.nbytes, src.dtype, src.size)
    if slots is None:
        return _fallback("reduce", src.dtype)(t, src, dst, root, op, ctx)
    counts, displs = _reduce_and_publish(t, mem, slots, src, op,
                                         dst if t.rank == root else None)
    if t.rank == root:
        _read_others(t, slots, dst, counts, displs)
    else:
        _count(t, src.size * src.itemsize)  # its part of src, then its reduced chunk
    _done(t, mem)


def allgatherv(t, buf, counts, displs, ctx=None):
    mem, slots = _slots(t, buf.nbytes, buf.dtype, buf.size)
    if slots is None:
        return _fallback("allgatherv")(t, buf, counts, displs, ctx)
    me = t.rank
    lo, hi = displs[me], displs[me] + counts[me]
    slots[me][lo:hi] = buf[lo:hi]
    mem.fence()
    _read_others(t, slots, buf, counts, displs)
    _count(t, (t.size - 1) * counts[me] * buf.itemsize)
    _done(t, mem)


def bcast(t, buf, root, ctx=None):
    flat = buf.view(np.uint8)
    mem, slots = _slots(t, flat.nbytes, flat.dtype, flat.size)
    if slots is None:
        return _fallback("bcast")(t, buf, root, ctx)
    if t.rank == root:
        slots[root][...] = flat
        _count(t, (t.size - 1) * flat.nbytes)
    mem.fence()
    if t.rank != root:
        flat[...] = slots[root]
    _done(t, mem)


def _done(t, mem):
    """The device's work on ``dst`` is finished before the caller (or MPI) reads it."""
    if mem.device:
        t.ready()

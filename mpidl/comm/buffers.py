"""Persistent buffers: scratch arrays reused across calls, pinned host staging for GPU data.

MPI's own Allreduce allocates a fresh temporary every call; above ~24 MiB the page faults
cost it 3x (../shared/reference/baselines.md). The collectives here take their temporaries
from a ``Scratch`` that only grows, so after the first call of a size nothing is
allocated or faulted in. ``free()`` gives the memory back.

``Staging`` holds host memory for GPU arrays when MPI cannot read device memory: pinned
(page-locked) memory from CuPy, so copies to and from the device run at full PCIe speed.
It hands out regions with a bump pointer and starts over when no transfer is in flight.
"""

import numpy as np

_ALIGN = 4096  # elements; sizes round up so that nearby sizes share one buffer


class Scratch:
    """Grow-only temporaries of one array module, one per (slot, dtype)."""

    def __init__(self, xp):
        self.xp = xp
        self._bufs = {}
        self._views = {}  # (slot, n, dtype) -> view: repeated sizes skip the slicing

    def get(self, slot, n, dtype):
        """A 1-D array of ``n`` elements of ``dtype`` (contents undefined), reused across calls."""
        view = self._views.get((slot, n, dtype))
        if view is not None:
            return view
        key = (slot, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.size < n:
            size = -(-max(n, 1) // _ALIGN) * _ALIGN
            buf = self.xp.empty(size, dtype=dtype)
            self._bufs[key] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != slot or k[2] != dtype}
        view = buf[:n]
        if len(self._views) > 64:
            self._views.clear()
        self._views[(slot, n, dtype)] = view
        return view

    def nbytes(self):
        return sum(b.nbytes for b in self._bufs.values())

    def free(self):
        self._bufs.clear()
        self._views.clear()


def _pinned_empty(nbytes):
    """``nbytes`` of page-locked host memory as a NumPy uint8 array (CuPy allocates it)."""
    import cupy  # noqa: PLC0415 - only reached with GPU arrays

    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


class Staging:
    """Host regions for staged transfers: a bump allocator over grow-only arenas.

    ``take(n, dtype)`` returns a region that stays valid until ``release()`` has been
    called as often as ``take``; then the next ``take`` starts again at the front. A
    request that does not fit gets a new, larger arena (the old one lives on while views of
    it are in flight).
    """

    def __init__(self, pinned=True):
        self._alloc = _pinned_empty if pinned else (lambda n: np.empty(n, dtype=np.uint8))
        self._arena = None
        self._top = 0
        self._live = 0

    def take(self, n, dtype):
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if self._live == 0:
            self._top = 0
        start = -(-self._top // 64) * 64  # keep regions 64-byte aligned
        if self._arena is None or start + nbytes > self._arena.size:
            size = max(nbytes, 2 * (self._arena.size if self._arena is not None else 0), 1 << 20)
            self._arena = self._alloc(size)
            start = 0
        self._top = start + nbytes
        self._live += 1
        return self._arena[start:start + nbytes].view(dtype)

    def release(self):
        self._live -= 1

    def reset(self):
        """Every region handed out is done with."""
        self._live = self._top = 0

    def free(self):
        self._arena = None
        self._top = self._live = 0

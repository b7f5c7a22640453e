"""Large freed blocks kept in the process's heap (glibc), so that an array allocated anew
every step lands in pages that are already mapped.

glibc serves a request above its mmap threshold (adjusted as it goes, at most 32 MiB on
64-bit machines) with a fresh ``mmap`` and returns it with ``munmap`` when it is freed.
A training step that allocates the same large array every time (the gradient of a
large weight, a matmul's output, a ZeRO stage-3 bucket gathered for forward) then maps
it anew and takes a page fault for every page it writes, every step. Raising the mmap
and trim thresholds makes such blocks come from the heap and stay there once freed, as
caching allocators do (jemalloc and tcmalloc, which CPU training guides recommend for
the same reason; PyTorch's caching allocator on GPUs). The price: memory freed after
the step's peak stays with the process, whose resident size keeps that peak; a training
process reaches it again every step.

``Runtime.setup`` calls ``keep_freed_blocks`` (every ``mpidl train`` and Python-API run);
``MPIDL_MALLOC_KEEP=0`` leaves glibc's defaults. Elsewhere (not glibc) it does nothing.
"""

import ctypes
import ctypes.util

from mpidl import env

#: mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: blocks up to this size come from the heap, and this much freed memory at the heap's
#: top is kept rather than returned to the system
KEEP_BYTES = 1 << 30

_applied = None  # None: not tried yet; else whether the thresholds were set


def keep_freed_blocks():
    """Set glibc's mmap and trim thresholds to ``KEEP_BYTES`` once per process (module
    doc); whether they are set. ``MPIDL_MALLOC_KEEP=0`` turns it off."""
    global _applied
    if _applied is None:
        _applied = False
        if env.flag("MPIDL_MALLOC_KEEP"):
            _applied = _mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) and \
                _mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    return _applied


def _mallopt(param, value):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: mallopt's numbers are glibc's
    except (OSError, AttributeError):
        return False
    return libc.mallopt(param, value) == 1

"""mpidl.allocator: with glibc, a large block freed by one step is in the heap for the
next (the process's resident size keeps it); MPIDL_MALLOC_KEEP=0 leaves glibc as it is.
Each case runs in a process of its own: the setting is the whole process's."""

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import numpy as np
from mpidl.allocator import keep_freed_blocks

def resident_kib():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS"))

applied = keep_freed_blocks()
before = resident_kib()
block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, above glibc's own mmap threshold
del block
print(json.dumps({"applied": applied, "kept_kib": resident_kib() - before}))
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux")
                           or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                           reason="glibc's malloc only")


def probe(keep):
    env = dict(os.environ, MPIDL_MALLOC_KEEP=keep)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_freed_large_block_stays_in_the_heap():
    kept = probe("1")
    assert kept["applied"] is True
    assert kept["kept_kib"] >= 60 << 10, kept  # the 64 MiB block's pages stay mapped


@glibc
def test_malloc_keep_0_leaves_glibc_as_it_is():
    plain = probe("0")
    assert plain["applied"] is False
    assert plain["kept_kib"] < 8 << 10, plain  # glibc unmapped the block

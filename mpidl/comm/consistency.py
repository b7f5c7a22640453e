"""The consistency check: do all ranks agree on what they are about to reduce?

Before the first call of each tensor name (every call in ``check="always"`` mode, or
with ``MPIDL_DEBUG=1``), ranks all-gather a fixed-size description of the call:
collective, tensor name, shape, dtype, op, algorithm (after ``auto`` is resolved) and
root. The description is a fixed number of bytes, so the exchange itself always matches
even when the calls do not. Every rank then sees the same table, so a disagreement raises
``CollectiveMismatchError`` on all ranks at once, naming the tensor and which ranks
passed what, instead of a hang or silent garbage.

Calls without a name are keyed by their description, so a rank seeing a new
(collective, shape, dtype, op, algorithm) checks it. Ranks that disagree on *whether* to
check (one has seen a signature before, the other has not) cannot be caught without
checking every call: name your tensors, or use ``check="always"`` while debugging. A rank
that waits in a check for longer than ``MPIDL_STALL_WARNING`` seconds (default 60) prints
which tensor it waits for, so a stall is visible rather than silent.
"""

import hashlib
import sys
import time

import numpy as np

from .. import env

DESC_BYTES = 256
_HASH = 16


class CollectiveMismatchError(RuntimeError):
    """Ranks passed different shapes, dtypes, ops or algorithms to the same collective."""


def describe(kind, name, shape, dtype, op=None, algorithm=None, root=None):
    """The text every rank must agree on (shape None: not compared, as in allgatherv)."""
    parts = [kind, f"tensor={name!r}" if name is not None else "tensor=<unnamed>"]
    if shape is not None:
        parts.append(f"shape={tuple(shape)}")
    parts.append(f"dtype={np.dtype(dtype).name}")
    if op is not None:
        parts.append(f"op={op}")
    if algorithm is not None:
        parts.append(f"algorithm={algorithm}")
    if root is not None:
        parts.append(f"root={root}")
    return " ".join(parts)


def encode(desc):
    raw = desc.encode("utf-8")
    digest = hashlib.blake2b(raw, digest_size=_HASH).digest()
    body = raw[:DESC_BYTES - _HASH - 2]
    buf = np.zeros(DESC_BYTES, dtype=np.uint8)
    buf[0] = len(body) & 0xFF
    buf[1] = len(body) >> 8
    buf[2:2 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    buf[DESC_BYTES - _HASH:] = np.frombuffer(digest, dtype=np.uint8)
    return buf


def _decode(row):
    n = int(row[0]) | (int(row[1]) << 8)
    return bytes(row[2:2 + n]).decode("utf-8", errors="replace")


def _ranks(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def check(comm, kind, name, desc, stall_warning=None):
    """All-gather ``desc`` over ``comm``; raise CollectiveMismatchError on every rank if
    the ranks differ."""
    p = comm.Get_size()
    if p == 1:
        return
    mine = encode(desc)
    table = np.empty((p, DESC_BYTES), dtype=np.uint8)
    req = comm.Iallgather(mine, table)
    if not req.Test():
        _wait(req, comm.Get_rank(), kind, name, stall_warning)
    if not (table == table[0]).all():
        raise_mismatch(table, kind, name)


def raise_mismatch(table, kind, name):
    """Raise CollectiveMismatchError describing which ranks passed what (rows of ``table``
    are the ranks' encoded descriptions)."""
    groups = {}
    for r in range(table.shape[0]):
        groups.setdefault(table[r].tobytes(), []).append(r)
    lines = [f"  {_ranks(rs)}: {_decode(table[rs[0]])}" for rs in groups.values()]
    odd = min(groups.values(), key=len)
    label = repr(name) if name is not None else "<unnamed>"
    raise CollectiveMismatchError(
        f"ranks disagree on {kind} of tensor {label} ({_ranks(odd)} "
        f"{'differs' if len(odd) == 1 else 'differ'} from the rest); "
        "every rank must pass the same name, shape, dtype, op and algorithm:\n"
        + "\n".join(lines))


def _wait(req, rank, kind, name, stall_warning):
    """Wait for the check's exchange without burning a core, warning once on a stall."""
    if stall_warning is None:
        stall_warning = env.number("MPIDL_STALL_WARNING")
    start = time.perf_counter()
    delay = 1e-6
    warned = False
    while not req.Test():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
        if not warned and time.perf_counter() - start > stall_warning:
            warned = True
            print(f"mpidl: rank {rank} has waited {stall_warning:.0f} s in the consistency "
                  f"check of {kind} tensor {name!r}: other ranks are in a different "
                  "collective or stopped", file=sys.stderr, flush=True)

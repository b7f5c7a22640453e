"""The consistency check: do all ranks agree on the collectives they call?

Two mechanisms, both raising ``CollectiveMismatchError`` on every rank at once, naming
the call, the tensor and which ranks passed what, instead of a hang or silent garbage:

- The full check (``check``): ranks all-gather a fixed-size description of the call
  (collective, tensor name, shape, dtype, op, algorithm after ``auto`` is resolved,
  root) before it runs. The description is a fixed number of bytes, so the exchange
  itself always matches even when the calls do not. It runs on the first call of each
  tensor name (``check="first"`` and ``"digest"``; unnamed calls on each new signature),
  or on every call (``check="always"``, ``MPIDL_DEBUG=1``), which costs one more
  latency-bound collective per call.
- The digest comparison (``compare_windows``, ``check="digest"``, the default): every
  call's signature key (a tuple) is looked up once in a dictionary of digests and the
  digest (an int) remembered; after windows of 64, 128, ... calls, up to
  ``check_period`` (4096 by default), and at ``close()`` ranks all-gather 16 bytes: the
  number of calls and a digest of their digests. So a later call with another dtype, op,
  size or name, or a rank that skipped a call, is caught by the end of its window, at
  the cost of one small all-gather per window (all-reduce keys hold the element count,
  not the shape: cheaper, and what the data depends on). A call whose shapes differ may fail before
  that (MPI's "message truncated", reported as a mismatch of that call) or hang; a hang
  is named by the stall inspector (stall.py), which compares the signatures of the calls
  the ranks are stuck in.
"""

import hashlib
import time

import numpy as np
from mpi4py import MPI


DESC_BYTES = 256
_DTYPES = {np.dtype(c).num: np.dtype(c) for c in np.typecodes["All"]}
SPIN_S = 5e-5  # a polled exchange spins this long before it sleeps (a sleep is 50+ us;
#                spinning longer starves the other ranks when they outnumber the cores)
_HASH = 16


class CollectiveMismatchError(RuntimeError):
    """Ranks passed different shapes, dtypes, ops or algorithms to the same collective."""


def describe(kind, name, shape, dtype, op=None, algorithm=None, root=None):
    """The text every rank must agree on (shape None: not compared, as in allgatherv; an
    int: the element count, as the digests of all-reduce calls record it)."""
    if kind == "barrier":
        return "barrier"
    parts = [kind, f"tensor={name!r}" if name is not None else "tensor=<unnamed>"]
    if isinstance(shape, (int, np.integer)):
        parts.append(f"size={int(shape)}")
    elif shape is not None:
        parts.append(f"shape={tuple(shape)}")
    if dtype is not None:
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


def check(comm, kind, name, desc, blocking=False):
    """All-gather ``desc`` over ``comm``; raise CollectiveMismatchError on every rank if
    the ranks differ. ``blocking``: wait inside MPI (the caller's thread), else poll."""
    p = comm.Get_size()
    if p == 1:
        return
    table = np.empty((p, DESC_BYTES), dtype=np.uint8)
    _allgather(comm, encode(desc), table, blocking)
    if not (table == table[0]).all():
        raise_mismatch(table, kind, name)


def _allgather(comm, mine, table, blocking=False):
    """All-gather; unless ``blocking``, waiting with Test and short sleeps, not inside
    MPI: a check that other ranks never join (an orphaned non-blocking call at exit) must
    not hold a progress thread in MPI while the process finalizes. (A stall here is named
    by the stall inspector.)"""
    if blocking:
        comm.Allgather(mine, table)
        return
    req = comm.Iallgather(mine, table)
    spin_until = time.perf_counter() + SPIN_S
    while not req.Test():
        if time.perf_counter() > spin_until:
            break
    delay = 1e-5
    while not req.Test():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


def raise_mismatch(table, kind, name, where=None):
    """Raise CollectiveMismatchError describing which ranks passed what (rows of ``table``
    are the ranks' encoded descriptions). ``where``: what disagrees, when it is not one
    tensor's call (the digest comparison names a call number)."""
    groups = {}
    for r in range(table.shape[0]):
        groups.setdefault(table[r].tobytes(), []).append(r)
    lines = [f"  {_ranks(rs)}: {_decode(table[rs[0]])}" for rs in groups.values()]
    sizes = sorted(len(rs) for rs in groups.values())
    blame = ""
    if len(sizes) > 1 and sizes[0] < sizes[1]:  # a unique smallest group is the odd one
        odd = min(groups.values(), key=len)
        blame = f" ({_ranks(odd)} {'differs' if len(odd) == 1 else 'differ'} from the rest)"
    label = repr(name) if name is not None else "<unnamed>"
    subject = f"{kind} of tensor {label}" if where is None else where
    raise CollectiveMismatchError(
        f"ranks disagree on {subject}{blame}; every rank must make the same collective "
        "calls in the same order, with the same name, shape, dtype, op and algorithm:\n"
        + "\n".join(lines))


def full_key(key):
    """A signature key as ``describe``'s arguments: (kind, name, shape, dtype, op,
    algorithm, root). The all-reduce fast path records a sum's key in the short form
    (name, element count, dtype number, algorithm), which costs less to build and to hash
    (a dtype's hash is slow, a shape is a new tuple every call). All-reduce keys record
    the element count instead of the shape on every path, so the two paths agree; the
    first call of each name compares the full shapes."""
    if len(key) == 4:
        return ("allreduce", key[0], key[1], _DTYPES[key[2]], "sum", key[3], None)
    return key


def digest(key, cache):
    """A stable 64-bit digest of a call's signature key (the same on every rank, unlike
    Python's ``hash`` of strings, and the same for a key's short and full forms),
    computed once per distinct key. ``cache`` maps keys to digests and digests back to
    their description (to name a call that differs)."""
    d = cache.get(key)
    if d is None:
        text = describe(*full_key(key))
        # 60 bits: an int of two 30-bit digits whose hash is itself (compare_windows)
        d = cache[key] = int.from_bytes(
            hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 4
        cache[("text", d)] = text
    return d


def compare_windows(comm, window, cache, first, group, blocking=True):
    """Do all ranks' last calls have the same signatures? ``window``: the digests of this
    rank's calls since the last comparison (``digest``), the first being call number
    ``first``. ``blocking=False``: wait by polling (for a progress thread, which must
    not be inside MPI when the process finalizes).

    One all-gather of 16 bytes per rank (the number of calls and a digest of their
    signatures) when all agree; when they do not, two more find the first call that
    differs and every rank raises CollectiveMismatchError naming it, the ranks, and what
    each passed.

    The window's digest is Python's hash of the tuple of its digests: for ints and tuples
    of ints it is the same in every process (string hashing is what PYTHONHASHSEED
    randomizes), order-sensitive, and about five times cheaper than packing the window
    into bytes for a cryptographic hash; with the calls' digests below 2**61 - 1 (60 bits,
    ``digest``) no two of them hash alike."""
    p = comm.Get_size()
    if p == 1:
        return
    mine = (len(window).to_bytes(8, "little")
            + hash(tuple(window)).to_bytes(8, "little", signed=True))
    gathered = bytearray(p * len(mine))
    _allgather(comm, [mine, MPI.BYTE], [gathered, MPI.BYTE], blocking)
    if gathered == mine * p:
        return
    # Somebody differs: find the first call that does (windows may differ in length).
    table = np.frombuffer(gathered, dtype=np.uint64).reshape(p, 2)
    longest = int(table[:, 0].max())
    padded = np.zeros(longest, dtype=np.uint64)
    padded[:len(window)] = window
    every = np.empty((p, longest), dtype=np.uint64)
    _allgather(comm, padded, every, blocking)
    lengths = table[:, 0].astype(np.int64)
    for i in range(longest):
        column = [int(every[r, i]) if i < lengths[r] else None for r in range(p)]
        if len(set(column)) > 1:
            break
    else:  # equal digests, different digest of digests: cannot happen; say so plainly
        i = longest - 1
    if i >= len(window):
        desc = "no call (this rank made fewer calls)"
    else:  # a slot left 0: the call raised on this rank before it was recorded
        desc = cache.get(("text", window[i]), "a call that raised on this rank")
    descs = np.empty((p, DESC_BYTES), dtype=np.uint8)
    _allgather(comm, encode(desc), descs, blocking)
    raise_mismatch(descs, "call", None, where=f"call {first + i} on group {group}")

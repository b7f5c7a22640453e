"""One rank's payload arrays as one uint8 buffer, so a single allgatherv carries them all.

Layout (little-endian)::

    0   2   magic b"PF"
    2   1   version (1)
    3   1   number of arrays a (0..255)
    4   4   reserved, zero
    8   16a per array: dtype code (1 byte), 7 zero bytes, size in bytes (uint64)
    ... the arrays' bytes in order, each padded with zeros to a multiple of 8

A frame's length is a multiple of 8, so every rank's frame starts 8-byte aligned in the
gathered buffer and its arrays can be viewed in place. ``unpack`` checks every field
before it slices: a malformed frame raises PayloadError, never reads out of range.
"""

import numpy as np

from mpidl.backend import array_module
from mpidl.kernels import PayloadError

MAGIC = b"PF"
VERSION = 1
HEAD = 8
ENTRY = 16
DTYPES = [np.dtype(t) for t in ("uint8", "int8", "uint16", "int16", "uint32", "int32",
                                "uint64", "int64", "float16", "float32", "float64")]
CODES = {dt: i for i, dt in enumerate(DTYPES)}


def _pad8(n):
    return (n + 7) & ~7


def header(payload):
    """The frame's header (host uint8) and its total length."""
    if len(payload) > 255:
        raise ValueError(f"a frame holds at most 255 arrays, got {len(payload)}")
    head = np.zeros(HEAD + ENTRY * len(payload), np.uint8)
    head[0:2] = np.frombuffer(MAGIC, np.uint8)
    head[2], head[3] = VERSION, len(payload)
    total = head.size
    for i, a in enumerate(payload):
        code = CODES.get(np.dtype(a.dtype))
        if code is None:
            raise TypeError(f"payload array {i} has dtype {a.dtype}, which frames do not "
                            f"carry ({', '.join(d.name for d in DTYPES)})")
        off = HEAD + ENTRY * i
        head[off] = code
        head[off + 8:off + 16] = np.array([a.nbytes], "<u8").view(np.uint8)
        total += _pad8(a.nbytes)
    return head, total


def pack(payload, like=None):
    """The payload arrays (NumPy or CuPy, contiguous) as one uint8 frame on their backend."""
    mod = array_module(payload[0] if payload else like)
    head, total = header(payload)
    out = mod.zeros(total, dtype=mod.uint8)
    out[:head.size] = mod.asarray(head)
    pos = head.size
    for a in payload:
        if a.nbytes:
            out[pos:pos + a.nbytes] = mod.ascontiguousarray(a).reshape(-1).view(mod.uint8)
        pos += _pad8(a.nbytes)
    return out


def unpack(frame, what="frame"):
    """The arrays of one frame (views into it), after checking its layout."""
    mod = array_module(frame)
    size = int(frame.size)
    if size < HEAD:
        raise PayloadError(f"{what}: {size} bytes, too short for a payload frame")
    head = np.asarray(frame[:HEAD].get() if mod is not np else frame[:HEAD])
    if bytes(head[0:2]) != MAGIC or head[2] != VERSION or head[4:8].any():
        raise PayloadError(f"{what}: not a payload frame (bad magic, version or reserved "
                           f"bytes)")
    count = int(head[3])
    start = HEAD + ENTRY * count
    if size < start:
        raise PayloadError(f"{what}: truncated in its table of {count} arrays")
    table = np.asarray(frame[HEAD:start].get() if mod is not np else frame[HEAD:start])
    entries = table.reshape(count, ENTRY)
    pos, out = start, []
    for i in range(count):
        code = int(entries[i, 0])
        if code >= len(DTYPES) or entries[i, 1:8].any():
            raise PayloadError(f"{what}: array {i} has an unknown dtype code {code}")
        nbytes = int(np.ascontiguousarray(entries[i, 8:16]).view("<u8")[0])
        dt = DTYPES[code]
        if nbytes % dt.itemsize or nbytes > size - pos:
            raise PayloadError(f"{what}: array {i} claims {nbytes} bytes of {dt.name}, "
                               f"{size - pos} remain")
        out.append(frame[pos:pos + nbytes].view(dt))
        pos += _pad8(nbytes)
    if pos != size:
        raise PayloadError(f"{what}: {size} bytes, its arrays account for {pos}")
    return out

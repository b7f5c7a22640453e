"""The byte layout of a sparse payload, shared by every backend, and its header checks.

A sparse payload is one ``uint8`` array that describes itself, so a receiver can check it
before touching memory::

    offset  size  field
    0       2     magic b"SP"
    2       1     version (1)
    3       1     index encoding: 0 = varint (LEB128), 1 = fixed bit width
    4       1     bit width of the fixed encoding (0..64; 0 for varint)
    5       1     value kind: 0 = float32, 1 = float16, 2 = signs (float32 scale + 1 bit each)
    6       2     reserved, zero
    8       8     n, the dense length (uint64, little-endian)
    16      8     k, the number of entries (uint64)
    24      8     L, the length of the index stream in bytes (uint64)
    32      L     index stream, then zero padding up to a multiple of 4
    ...           values: k float32 | k float16 | float32 scale + ceil(k/8) sign bytes

The index stream holds the gaps between sorted, distinct indices: ``d[0] = idx[0]`` and
``d[i] = idx[i] - idx[i-1] - 1`` (never negative). Whichever is smaller is used: LEB128
varints (7 bits per byte) or every gap in ``w`` bits, ``w`` the bit length of the largest
gap (8 gaps fill exactly ``w`` bytes, so groups can be written in parallel). The whole
array must have exactly the length these fields imply.
"""

import numpy as np

MAGIC = b"SP"
VERSION = 1
HEADER_BYTES = 32
VARINT, FIXED = 0, 1
VALUES_F32, VALUES_F16, VALUES_SIGNS = 0, 1, 2
VALUE_KINDS = {"float32": VALUES_F32, "float16": VALUES_F16, "signs": VALUES_SIGNS}

# Status codes of the index-stream decoders (0 = fine), turned into messages here.
DECODE_ERRORS = {
    1: "index stream ends in the middle of an index (truncated)",
    2: "a varint index gap is longer than 64 bits",
    3: "an index is out of range for the dense length",
    4: "index stream is longer than its entries need (trailing bytes)",
    5: "index gaps overflow (corrupt gap)",
}


class PayloadError(ValueError):
    """A payload that is malformed: truncated, of the wrong length, or out of range."""


def pad4(nbytes):
    return (nbytes + 3) & ~3


def value_bytes(kind, k):
    if kind == VALUES_F32:
        return 4 * k
    if kind == VALUES_F16:
        return 2 * k
    return 4 + (k + 7) // 8  # VALUES_SIGNS


def fixed_stream_bytes(k, width):
    return (k * width + 7) // 8


def make_header(n, k, encoding, width, value_kind, stream_bytes):
    h = np.zeros(HEADER_BYTES, dtype=np.uint8)
    h[0:2] = np.frombuffer(MAGIC, dtype=np.uint8)
    h[2], h[3], h[4], h[5] = VERSION, encoding, width, value_kind
    h[8:32] = np.array([n, k, stream_bytes], dtype="<u8").view(np.uint8)
    return h


def parse_header(blob, n=None):
    """Check a payload's header and length; returns (n, k, encoding, width, kind, L).

    ``blob`` is a host ``uint8`` array. ``n``, when given, is the dense length the receiver
    expects. Raises PayloadError naming the first thing that is wrong.
    """
    if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1:
        raise PayloadError("sparse payload must be a 1-D uint8 array, got "
                           f"{type(blob).__name__} {getattr(blob, 'dtype', '')}")
    if blob.size < HEADER_BYTES:
        raise PayloadError(f"sparse payload truncated: {blob.size} bytes, "
                           f"the header alone needs {HEADER_BYTES}")
    if bytes(blob[0:2]) != MAGIC or blob[2] != VERSION:
        raise PayloadError("not a sparse payload (bad magic or version byte)")
    encoding, width, kind = int(blob[3]), int(blob[4]), int(blob[5])
    if blob[6] or blob[7]:
        raise PayloadError("sparse payload header: reserved bytes are not zero")
    if kind not in (VALUES_F32, VALUES_F16, VALUES_SIGNS):
        raise PayloadError(f"sparse payload header: unknown value kind {kind}")
    dense_n, k, stream = (int(v) for v in np.ascontiguousarray(blob[8:32]).view("<u8"))
    if n is not None and dense_n != n:
        raise PayloadError(f"sparse payload is for a tensor of {dense_n} elements, "
                           f"expected {n}")
    if k > dense_n:
        raise PayloadError(f"sparse payload claims {k} entries in a tensor of {dense_n}")
    if encoding == FIXED:
        if width > 64:
            raise PayloadError(f"sparse payload header: bit width {width} > 64")
        if stream != fixed_stream_bytes(k, width):
            raise PayloadError(f"sparse payload: fixed-width stream of {stream} bytes, "
                               f"{k} gaps of {width} bits need {fixed_stream_bytes(k, width)}")
    elif encoding == VARINT:
        if width != 0:
            raise PayloadError("sparse payload header: varint encoding with a bit width")
        if stream < k or stream > 10 * k:
            raise PayloadError(f"sparse payload: varint stream of {stream} bytes cannot "
                               f"hold {k} gaps")
    else:
        raise PayloadError(f"sparse payload header: unknown index encoding {encoding}")
    expect = HEADER_BYTES + pad4(stream) + value_bytes(kind, k)
    if blob.size != expect:
        raise PayloadError(f"sparse payload has {blob.size} bytes, its header implies "
                           f"{expect} (truncated or padded)")
    return dense_n, k, encoding, width, kind, stream


def split_values(blob, kind, k, stream):
    """The value section of a checked payload: (values array, scale or None)."""
    start = HEADER_BYTES + pad4(stream)
    raw = blob[start:]
    if kind == VALUES_F32:
        return raw.view(np.float32) if raw.size else np.zeros(0, np.float32), None
    if kind == VALUES_F16:
        return raw.view(np.float16) if raw.size else np.zeros(0, np.float16), None
    scale = raw[:4].view(np.float32)[0]
    return raw[4:], scale

"""Reader for the IDX format of MNIST and Fashion-MNIST (``.gz`` or raw).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian int32 per dimension, then the values, big-endian, row-major.
Everything is checked against the header (magic, type, dimensions, exact byte count), so
a corrupt or truncated file fails with a message naming the file and what was expected,
never with a reshape error somewhere later.
"""

import gzip
import os
import struct
import zlib

import numpy as np

from mpidl.errors import DataError

# type code -> big-endian dtype
IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.newbyteorder("="): code for code, dt in IDX_TYPES.items()}


def _read_bytes(path):
    """The file's bytes, decompressed when it is gzip (detected by content, not name)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read IDX file {path}: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"IDX file {path} is a damaged gzip file ({e}); "
                            "download it again") from None
    if path.endswith(".gz"):
        raise DataError(f"IDX file {path} ends in .gz but is not gzip data "
                        f"(first bytes {raw[:4].hex()}); download it again")
    return raw


def parse_idx(data, path="<bytes>", ndim=None):
    """Parse IDX ``data`` (bytes) into a native-endian NumPy array.

    ``ndim`` (if given) is the number of dimensions the caller expects (3 for images,
    1 for labels); ``path`` only names the source in error messages.
    """
    if len(data) < 4:
        raise DataError(f"IDX file {path} is truncated: {len(data)} bytes, "
                        "expected at least a 4-byte header")
    zero, code, nd = data[:2], data[2], data[3]
    if zero != b"\x00\x00" or code not in IDX_TYPES or nd == 0:
        raise DataError(f"{path} is not an IDX file: magic number {data[:4].hex()} "
                        "(expected 0000TTNN with type TT in 08,09,0b,0c,0d,0e and NN>0 "
                        "dimensions, e.g. 00000803 for images, 00000801 for labels)")
    if ndim is not None and nd != ndim:
        raise DataError(f"IDX file {path} has {nd} dimension(s), expected {ndim} "
                        f"({'images N x rows x cols' if ndim == 3 else 'labels N'})")
    header = 4 + 4 * nd
    if len(data) < header:
        raise DataError(f"IDX file {path} is truncated inside its header "
                        f"({len(data)} of {header} bytes)")
    dims = struct.unpack(f">{nd}I", data[4:header])
    dtype = IDX_TYPES[code]
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise DataError(f"IDX file {path} is {what}: {len(data)} bytes, expected {expected} "
                        f"for dimensions {'x'.join(map(str, dims))} of {dtype.name}")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path, ndim=None):
    """Read one IDX file (``.gz`` or raw) into a NumPy array; see ``parse_idx``."""
    return parse_idx(_read_bytes(path), path=path, ndim=ndim)


def read_idx_head(path, rows, ndim=None):
    """The first ``rows`` entries of an IDX file (``.gz`` or raw) and the number the
    header declares, decompressing only those: for a file read whole before (mpidl's
    data cache records that), so the bytes after them are not checked here."""
    try:
        opener = gzip.open if _is_gzip(path) else open
        with opener(path, "rb") as f:
            head = f.read(4)
            nd = head[3] if len(head) == 4 else 0
            data = head + f.read(4 * nd)
            if len(data) == 4 + 4 * nd and nd:
                dims = struct.unpack(f">{nd}I", data[4:])
                rows = min(rows, dims[0])
                per_row = int(np.prod(dims[1:], dtype=np.int64))
                itemsize = IDX_TYPES.get(data[2], np.dtype("u1")).itemsize
                data += f.read(rows * per_row * itemsize)
    except OSError as e:  # unreadable, or a damaged gzip stream (BadGzipFile is one)
        raise DataError(f"cannot read IDX file {path}: {e.strerror or e}") from None
    except (EOFError, zlib.error) as e:
        raise DataError(f"IDX file {path} is a damaged gzip file ({e}); "
                        "download it again") from None
    if len(data) < 8:
        return parse_idx(data, path=path, ndim=ndim), 0  # raises the header's error
    total = struct.unpack(">I", data[4:8])[0]
    head = bytearray(data)
    head[4:8] = struct.pack(">I", rows)  # parse the rows read as a file of that many
    return parse_idx(bytes(head), path=path, ndim=ndim), total


def _is_gzip(path):
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def write_idx(path, array):
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``).

    Used by the tests to make tiny datasets; the inverse of ``read_idx``.
    """
    array = np.asarray(array)
    native = array.dtype.newbyteorder("=")
    if native not in _CODES:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    code = _CODES[native]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(IDX_TYPES[code]).tobytes()
    if path.endswith(".gz"):
        payload = gzip.compress(payload)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(payload)

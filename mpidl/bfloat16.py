"""bfloat16 without a bfloat16 dtype: rounding to its grid, its 2-byte words, their sum.

NumPy has no bfloat16 (CuPy 13 neither; later CuPy versions add one, experimentally, when
the optional ml_dtypes package is installed), so it is emulated here with integer
operations on the float32 bit pattern, on NumPy or CuPy arrays alike. bfloat16 is the upper half of a float32: the same sign and 8-bit exponent
(so the same range, subnormals included), 8 bits of significand precision counting the
implicit bit (7 stored). Rounding a float32 to it is round-to-nearest, ties to even, on
those 16 bits: add ``0x7FFF`` plus the lowest kept bit, then clear the low 16 bits. The
carry this may produce moves into the exponent by itself, which is exactly the right
result (a subnormal becomes the smallest normal, the largest finite values overflow to
infinity). NaN is kept a NaN (its quiet bit is set so that truncation cannot turn it
into an infinity); infinities stay infinities.

Two storage forms:

* "on the grid": a float32 array whose values are all bfloat16 numbers (``round_``):
  4 bytes per element, but every float32 kernel (BLAS included) computes on it directly;
* words: a uint16 array of the upper halves (``to_words``/``from_words``): 2 bytes per
  element, the form gradients travel in.

``BFLOAT16`` is the dtype collectives see for words: a one-field structured dtype of
uint16, so a communicator can tell bfloat16 words from integers and reduce them with
``add`` (each addition in float32, rounded once to bfloat16) instead of an integer sum,
and never hands them to MPI as a datatype.
"""

import numpy as np

#: dtype of bfloat16 words as collectives see them (the bytes of a uint16 array)
BFLOAT16 = np.dtype([("bfloat16", "<u2")])

_ROUND = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_HIGH = np.uint32(0xFFFF0000)
_QUIET = np.uint32(0x00400000)
_SHIFT = np.uint32(16)

#: elements converted (or added) at a time when the result goes into a given array: the
#: temporaries stay about a MiB each, however large the tensor (a 4096 x 4096 weight
#: would otherwise take 5 bytes an element beside it, a ring's addition of its halves
#: about 9)
CHUNK = 1 << 18


def pieces(*arrays):
    """Tuples of the same piece of each of ``arrays`` (equal sizes): flat views of
    ``CHUNK`` elements, from the front, or the whole arrays at once when they are small
    or one is not contiguous (a flat view would be a copy)."""
    if arrays[0].size <= CHUNK or not all(a.flags.c_contiguous for a in arrays):
        yield arrays
        return
    flat = [a.reshape(-1) for a in arrays]
    for lo in range(0, flat[0].size, CHUNK):
        yield tuple(f[lo:lo + CHUNK] for f in flat)


def _xp(x):
    from mpidl.backend import array_module  # noqa: PLC0415

    return array_module(x)


def round_bits(x):
    """The float32 bit patterns (uint32) of ``x`` (float32) rounded to bfloat16, a new
    array; round-to-nearest-even, NaN kept a NaN."""
    xp = _xp(x)
    if x.dtype != np.float32:
        raise TypeError(f"bfloat16 rounding takes float32 arrays, got {x.dtype}")
    u = xp.ascontiguousarray(x).view(xp.uint32)
    r = (u >> _SHIFT) & _ONE
    r += _ROUND
    r += u
    nan = x != x
    if nan.any():  # u + 0x7FFF may carry a NaN's payload into the sign: keep it a NaN
        r = xp.where(nan, u | _QUIET, r)
    r &= _HIGH
    return r


def round_(x, out=None):
    """``x`` (float32) rounded to the bfloat16 grid, as float32 (``out=x``: in place)."""
    if out is None:
        return round_bits(x).view(np.float32).reshape(x.shape)
    for xs, os in pieces(x, out):
        os[...] = round_bits(xs).view(np.float32).reshape(xs.shape)
    return out


def to_words(x, out=None):
    """``x`` (float32) rounded to bfloat16, as uint16 words (into ``out`` if given)."""
    xp = _xp(x)
    if out is None:
        return (round_bits(x) >> _SHIFT).astype(xp.uint16).reshape(x.shape)
    for xs, os in pieces(x, out.view(xp.uint16)):
        os[...] = (round_bits(xs) >> _SHIFT).astype(xp.uint16).reshape(xs.shape)
    return out


def from_words(w, out=None):
    """bfloat16 words (uint16 or ``BFLOAT16``) as float32 values (exact)."""
    xp = _xp(w)
    if out is None:
        u = w.view(xp.uint16).astype(xp.uint32)
        u <<= _SHIFT
        return u.view(xp.float32)
    for ws, os in pieces(w.view(xp.uint16), out):
        if xp is np:  # in place, no temporary (NumPy copies first where they overlap)
            ov = os.view(np.uint32)
            np.copyto(ov, ws.reshape(ov.shape))
            ov <<= _SHIFT
            continue
        u = ws.astype(xp.uint32)
        u <<= _SHIFT
        os[...] = u.view(xp.float32).reshape(os.shape)
    return out


def add(a, b, out):
    """``out = a + b`` on bfloat16 words: the sum of the two float32 values (exact or
    rounded to float32's 24 bits), rounded once to bfloat16. Rounding to 24 bits first
    cannot change the final result (24 >= 2*8 + 2: double rounding is innocuous), so each
    call is a correctly rounded bfloat16 addition. ``out`` may be ``a`` or ``b``."""
    xp = _xp(a)
    for a16, b16, o16 in pieces(*(v.view(xp.uint16) for v in (a, b, out))):
        s = from_words(a16)
        s += from_words(b16)
        to_words(s, out=o16)
    return out

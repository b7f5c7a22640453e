"""Numba CPU kernels: the same results as ``reference``, at memory speed.

Every function is compiled on first use and cached on disk (``cache=True``); arguments
are normalised by the dispatcher (1-D contiguous arrays, int64 scalars) so each compiles
once. Streaming kernels use ``prange`` (NUMBA_NUM_THREADS threads). Floating-point
"fast math" is limited to the reductions (``reassoc`` lets the sums vectorise): kernels
whose outputs are tested bit for bit keep IEEE semantics (no FMA contraction, no
no-NaN assumptions), so NaN and Inf follow the documented rules.
"""

import numpy as np
from numba import njit, prange

from . import wire

FM_SUM = {"reassoc", "nsz", "arcp"}  # sums may be reordered (tolerance-tested)
BLOCK = 1 << 16  # elements per parallel work unit in the streaming kernels

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)


# ---------------------------------------------------------------- random numbers
@njit(cache=True, inline="always")
def _hash64(seed, i):
    z = seed + (np.uint64(i) + _ONE) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def _uniform(seed, i):
    return np.float32(_hash64(seed, i) >> np.uint64(40)) * np.float32(2.0 ** -24)


@njit(cache=True)
def sample_indices(n, count, seed):
    out = np.empty(count, np.int64)
    if n == 0:
        return out[:0]
    un = np.uint64(n)
    for i in range(count):
        out[i] = np.int64(_hash64(seed, i) % un)
    return out


@njit(cache=True)
def randomk_indices(n, k, seed):
    out = np.empty(k, np.int64)
    for j in range(k):
        lo = j * n // k
        width = (j + 1) * n // k - lo
        out[j] = lo + np.int64(_hash64(seed, j) % np.uint64(width))
    return out


@njit(cache=True)
def hash_uniform(seed, count):
    out = np.empty(count, np.float32)
    for i in range(count):
        out[i] = _uniform(seed, i)
    return out


# ---------------------------------------------------------------- reductions
@njit(cache=True, parallel=True, fastmath=FM_SUM)
def l2norm(x):
    s = 0.0
    for i in prange(x.size):
        v = np.float64(x[i])
        s += v * v
    return np.float32(np.sqrt(s))


@njit(cache=True, parallel=True)
def maxabs(x):
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    part = np.zeros(nb, np.float32)
    for b in prange(nb):
        m = np.float32(0)
        for i in range(b * BLOCK, min(n, (b + 1) * BLOCK)):
            a = abs(x[i])
            if not a <= m:  # also true for NaN, which then sticks
                m = a
        part[b] = m
    m = np.float32(0)
    for b in range(nb):
        if not part[b] <= m:
            m = part[b]
    return m


# ---------------------------------------------------------------- 1-bit signs
@njit(cache=True, parallel=True, fastmath=FM_SUM)
def _chunk_abs_sums(x, r, use_r, size, nc):
    """Sum of |x + r| (float64) over each chunk of ``size``; chunks split into BLOCKs."""
    n = x.size
    per = (size + BLOCK - 1) // BLOCK  # work units per chunk
    part = np.zeros(nc * per, np.float64)
    for u in prange(nc * per):
        c = u // per
        lo = c * size + (u - c * per) * BLOCK
        hi = min(min(n, (c + 1) * size), lo + BLOCK)
        s = 0.0
        if use_r:
            for i in range(lo, hi):
                s += abs(x[i] + r[i])
        else:
            for i in range(lo, hi):
                s += abs(x[i])
        part[u] = s
    sums = np.zeros(nc, np.float64)
    for u in range(nc * per):
        sums[u // per] += part[u]
    return sums


@njit(cache=True, parallel=True)
def _pack_signs(x, r, use_r, scales, size, bits):
    """Second pass: 8 signs per byte (branch-free), and r <- v - (+-scale) in the same pass."""
    n = x.size
    full = n // 8
    nblk = (full + BLOCK // 8 - 1) // (BLOCK // 8)
    for blk in prange(nblk):
        b0 = blk * (BLOCK // 8)
        b1 = min(full, b0 + BLOCK // 8)
        for b in range(b0, b1):
            sc = scales[(b * 8) // size]
            acc = np.uint32(0)
            for j in range(8):
                i = b * 8 + j
                v = x[i] + r[i] if use_r else x[i]
                neg = v < 0
                acc |= np.uint32(neg) << np.uint32(j)
                if use_r:
                    r[i] = v - (-sc if neg else sc)
            bits[b] = np.uint8(acc)
    if full * 8 < n:  # the last, partial byte
        acc = np.uint32(0)
        for i in range(full * 8, n):
            sc = scales[i // size]
            v = x[i] + r[i] if use_r else x[i]
            neg = v < 0
            acc |= np.uint32(neg) << np.uint32(i - full * 8)
            if use_r:
                r[i] = v - (-sc if neg else sc)
        bits[full] = np.uint8(acc)


def pack_signs(x, residual, chunk):
    n = x.size
    size = max(n, 1) if chunk == 0 else chunk
    nc = 1 if chunk == 0 else -(-n // chunk)
    use_r = residual is not None
    r = residual if use_r else x
    sums = _chunk_abs_sums(x, r, use_r, size, nc)
    counts = np.minimum(size, n - size * np.arange(nc, dtype=np.int64))
    scales = (sums / np.maximum(counts, 1)).astype(np.float32)
    bits = np.empty((n + 7) // 8, np.uint8)
    _pack_signs(x, r, use_r, scales, size, bits)
    return bits, scales


@njit(cache=True, parallel=True)
def _unpack_signs(bits, scales, size, out):
    n = out.size
    nblk = (n + BLOCK - 1) // BLOCK
    for blk in prange(nblk):
        for i in range(blk * BLOCK, min(n, (blk + 1) * BLOCK)):
            sc = scales[i // size]
            neg = (bits[i >> 3] >> np.uint8(i & 7)) & np.uint8(1)
            out[i] = -sc if neg else sc


def unpack_signs(bits, scales, n, chunk):
    out = np.empty(n, np.float32)
    _unpack_signs(bits, scales, max(n, 1) if chunk == 0 else chunk, out)
    return out


# ---------------------------------------------------------------- selection
@njit(cache=True, inline="always")
def _key(a):
    m = abs(a)
    return np.float32(np.inf) if m != m else m


@njit(cache=True)
def threshold_select(x, tau, r, use_r):
    """One pass: v = x (+ r); |v| > tau is sent as sign * tau; r keeps v minus what was sent.

    Indices and sign bits go into buffers sized for n entries: np.empty / np.zeros leave
    their pages untouched, so only the pages that receive entries are ever written.
    """
    n = x.size
    idx = np.empty(n, np.int64)
    signs = np.zeros((n + 7) // 8, np.uint8)
    k = 0
    for i in range(n):
        v = x[i] + r[i] if use_r else x[i]
        if _key(v) > tau:
            neg = v < 0
            idx[k] = i
            signs[k >> 3] |= np.uint8(neg) << np.uint8(k & 7)
            k += 1
            if use_r:
                r[i] = v - (-tau if neg else tau)
        elif use_r:
            r[i] = v
    return idx[:k].copy(), signs[:(k + 7) // 8].copy()


@njit(cache=True)
def magnitude(x):
    key = np.empty(x.size, np.float32)
    for i in range(x.size):
        key[i] = _key(x[i])
    return key


@njit(cache=True)
def topk_keys(key, k):
    """Positions of the k largest keys, sorted, ties to the lower position (one pass after a select)."""
    n = key.size
    if k >= n:
        return np.arange(n)
    if k <= 0:
        return np.zeros(0, np.int64)
    t = np.partition(key, n - k)[n - k]
    gt = np.empty(k, np.int64)
    eq = np.empty(k, np.int64)
    ngt = 0
    neq = 0
    for i in range(n):
        a = key[i]
        if a > t:
            gt[ngt] = i
            ngt += 1
        elif a == t and neq < k:
            eq[neq] = i
            neq += 1
    need = k - ngt
    out = np.empty(k, np.int64)
    a = 0
    b = 0
    for o in range(k):  # merge the two sorted lists, taking `need` from eq
        if b < need and (a >= ngt or eq[b] < gt[a]):
            out[o] = eq[b]
            b += 1
        else:
            out[o] = gt[a]
            a += 1
    return out


@njit(cache=True)
def topk_exact(x, k):
    return topk_keys(magnitude(x), k)


@njit(cache=True)
def _select_at_least(x, t, cap):
    """Indices whose key is >= t and > 0, in order; count -1 once more than ``cap`` pass.

    A block of 32 is scanned only when its largest key reaches t; the block maximum is a
    branch-free loop that vectorises, so the pass runs near memory speed when few pass.
    """
    n = x.size
    out = np.empty(cap, np.int64)
    k = 0
    nb = n // 32
    for b in range(nb + 1):
        lo = b * 32
        hi = min(n, lo + 32)
        m = np.float32(0)
        for i in range(lo, hi):
            a = _key(x[i])
            m = a if a > m else m
        if m >= t and m > 0:
            for i in range(lo, hi):
                a = _key(x[i])
                if a >= t and a > 0:
                    if k == cap:
                        return out, -1
                    out[k] = i
                    k += 1
    return out, k


@njit(cache=True)
def topk_sampled(x, k, sample, m_rank):
    n = x.size
    m = sample.size
    if k <= 0 or n == 0:
        return np.zeros(0, np.int64)
    if m == 0:
        return topk_exact(x, k)
    sk = np.empty(m, np.float32)
    for i in range(m):
        sk[i] = _key(x[sample[i]])
    j = m_rank
    t = np.partition(sk, m - j)[m - j] if j <= m else sk.min()
    cap = min(n, 2 * k + 1024)
    cand, c = _select_at_least(x, t, cap)
    if c < 0:  # the sample underestimated badly: the k largest of all (the same set)
        return topk_exact(x, k)
    cand = cand[:c]
    if c > k:
        keys = np.empty(c, np.float32)
        for i in range(c):
            keys[i] = _key(x[cand[i]])
        cand = cand[topk_keys(keys, k)]
    return cand.copy()


# ---------------------------------------------------------------- quantization
@njit(cache=True, inline="always")
def _level(a, mult, s, u):
    lv = abs(a) * mult
    if not lv > 0:  # 0 and NaN
        return 0
    fl = np.floor(lv)
    q = fl + (np.float32(1) if u < lv - fl else np.float32(0))
    return np.int32(min(q, s))


@njit(cache=True, parallel=True)
def quantize(x, mult, levels, seed, width):
    """Codes levels +- level, 8 codes to ``width`` bytes (one 64-bit word), groups in parallel."""
    n = x.size
    s = np.float32(levels)
    out = np.empty((n * width + 7) // 8, np.uint8)
    ngroups = (n + 7) // 8
    for g in prange(ngroups):
        word = np.uint64(0)
        for j in range(8):
            i = g * 8 + j
            if i < n:
                a = x[i]
                lev = _level(a, mult, s, _uniform(seed, i))
                code = levels - lev if a < 0 else levels + lev
                word |= np.uint64(code) << np.uint64(j * width)
        base = g * width
        for b in range(width):
            if base + b < out.size:
                out[base + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(0xFF))
    return out


@njit(cache=True, parallel=True)
def _dequantize(packed, step, levels, width, n, out):
    """Values (code - levels) * step; returns the number of codes above 2 * levels."""
    ngroups = (n + 7) // 8
    mask = np.uint64((1 << width) - 1)
    bad = 0
    for g in prange(ngroups):
        word = np.uint64(0)
        base = g * width
        for b in range(width):
            if base + b < packed.size:
                word |= np.uint64(packed[base + b]) << np.uint64(8 * b)
        for j in range(8):
            i = g * 8 + j
            if i < n:
                code = np.int64((word >> np.uint64(j * width)) & mask)
                if code > 2 * levels:
                    bad += 1
                out[i] = np.float32(code - levels) * step
    return bad


@njit(cache=True, parallel=True)
def pack_bits(codes, width):
    n = codes.size
    out = np.empty((n * width + 7) // 8, np.uint8)
    for g in prange((n + 7) // 8):
        word = np.uint64(0)
        for j in range(8):
            i = g * 8 + j
            if i < n:
                word |= np.uint64(codes[i]) << np.uint64(j * width)
        for b in range(width):
            if g * width + b < out.size:
                out[g * width + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(0xFF))
    return out


@njit(cache=True, parallel=True)
def unpack_bits(packed, width, n):
    out = np.empty(n, np.uint8)
    mask = np.uint64((1 << width) - 1)
    for g in prange((n + 7) // 8):
        word = np.uint64(0)
        for b in range(width):
            if g * width + b < packed.size:
                word |= np.uint64(packed[g * width + b]) << np.uint64(8 * b)
        for j in range(8):
            i = g * 8 + j
            if i < n:
                out[i] = np.uint8((word >> np.uint64(j * width)) & mask)
    return out


# ---------------------------------------------------------------- fp16
@njit(cache=True, inline="always")
def _f32_to_f16_bits(f):
    """IEEE float32 bits -> float16 bits, round to nearest even (NumPy's npy_floatbits_to_halfbits)."""
    sign = np.uint16((f >> np.uint32(16)) & np.uint32(0x8000))
    fe = f & np.uint32(0x7F800000)
    fm = f & np.uint32(0x007FFFFF)
    if fe >= np.uint32(0x47800000):  # overflow to inf, or inf / NaN
        if fe == np.uint32(0x7F800000) and fm != 0:
            m = np.uint16(fm >> np.uint32(13))
            return sign | np.uint16(0x7E00) | m  # a quiet NaN, as the F16C instruction gives
        return sign | np.uint16(0x7C00)
    if fe <= np.uint32(0x38000000):  # subnormal half or zero
        if fe < np.uint32(0x33000000):
            return sign
        e = fe >> np.uint32(23)
        fm = fm + np.uint32(0x00800000)
        sh = np.uint32(113) - e  # 1..11 bits more than a normal number loses
        hm = fm >> (sh + np.uint32(13))
        rem = fm & ((np.uint32(1) << (sh + np.uint32(13))) - np.uint32(1))
        half = np.uint32(1) << (sh + np.uint32(12))
        if rem > half or (rem == half and (hm & np.uint32(1)) != 0):
            hm += np.uint32(1)
        return sign | np.uint16(hm)
    he = np.uint32((fe - np.uint32(0x38000000)) >> np.uint32(13))
    hm = fm >> np.uint32(13)
    rem = fm & np.uint32(0x1FFF)
    h = (he | hm)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (hm & np.uint32(1)) != 0):
        h += np.uint32(1)  # may carry into the exponent, up to inf: correct
    return sign | np.uint16(h)


@njit(cache=True, parallel=True)
def _to_fp16_bits(x_bits):
    out = np.empty(x_bits.size, np.uint16)
    for i in prange(x_bits.size):
        out[i] = _f32_to_f16_bits(x_bits[i])
    return out


@njit(cache=True, inline="always")
def _f16_bits_to_f32_bits(h):
    sign = np.uint32(h & np.uint16(0x8000)) << np.uint32(16)
    he = np.uint32(h & np.uint16(0x7C00))
    hm = np.uint32(h & np.uint16(0x03FF))
    if he == 0:
        if hm == 0:
            return sign
        e = np.uint32(113)  # normalise the subnormal
        while (hm & np.uint32(0x0400)) == 0:
            hm <<= np.uint32(1)
            e -= np.uint32(1)
        return sign | (e << np.uint32(23)) | ((hm & np.uint32(0x03FF)) << np.uint32(13))
    if he == np.uint32(0x7C00):
        return sign | np.uint32(0x7F800000) | (hm << np.uint32(13))
    return sign | ((he + np.uint32(0x1C000)) << np.uint32(13)) | (hm << np.uint32(13))


@njit(cache=True, parallel=True)
def _from_fp16_bits(h_bits):
    out = np.empty(h_bits.size, np.uint32)
    for i in prange(h_bits.size):
        out[i] = _f16_bits_to_f32_bits(h_bits[i])
    return out


# ---------------------------------------------------------------- sparse payloads
@njit(cache=True)
def _encode_index_stream(indices, n):
    """Gaps of sorted distinct indices, packed fixed-width or varint (whichever is smaller).

    Returns (stream, encoding, width, status): status 3 if an index is out of range or
    the indices are not strictly increasing (the caller raises).
    """
    k = indices.size
    gaps = np.empty(k, np.uint64)
    last = -1
    vbytes = 0
    gmax = np.uint64(0)
    for i in range(k):
        ix = indices[i]
        if ix <= last or ix >= n:
            return np.zeros(0, np.uint8), 0, 0, 3
        g = np.uint64(ix - last - 1)
        gaps[i] = g
        gmax = g if g > gmax else gmax
        nb = 1
        while g >= np.uint64(128):
            g >>= np.uint64(7)
            nb += 1
        vbytes += nb
        last = ix
    width = 0
    while width < 64 and (gmax >> np.uint64(width)) != 0:
        width += 1
    fbytes = (k * width + 7) // 8
    if fbytes <= vbytes:
        out = np.zeros(fbytes, np.uint8)
        for gi in range((k + 7) // 8):  # 8 gaps fill exactly `width` bytes
            base = gi * width * 8  # bit position
            for j in range(8):
                i = gi * 8 + j
                if i >= k:
                    break
                g = gaps[i]
                pos = base + j * width
                for b in range(width):
                    if (g >> np.uint64(b)) & np.uint64(1):
                        p = pos + b
                        out[p >> 3] |= np.uint8(1 << (p & 7))
        return out, 1, width, 0
    out = np.empty(vbytes, np.uint8)
    p = 0
    for i in range(k):
        g = gaps[i]
        while g >= np.uint64(128):
            out[p] = np.uint8((g & np.uint64(0x7F)) | np.uint64(0x80))
            g >>= np.uint64(7)
            p += 1
        out[p] = np.uint8(g)
        p += 1
    return out, 0, 0, 0


@njit(cache=True)
def _decode_index_stream(stream, k, encoding, width, n):
    """Indices from a gap stream; every read is bounds-checked. Returns (indices, status)."""
    out = np.empty(k, np.int64)
    last = -1
    nbytes = stream.size
    if encoding == 1:
        if (k * width + 7) // 8 != nbytes:
            return out, 1
        for i in range(k):
            g = np.uint64(0)
            pos = i * width
            for b in range(width):
                p = pos + b
                if (stream[p >> 3] >> np.uint8(p & 7)) & np.uint8(1):
                    g |= np.uint64(1) << np.uint64(b)
            if g >= np.uint64(n - 1 - last):  # idx = last + 1 + g must stay below n
                return out, 3
            last = last + 1 + np.int64(g)
            out[i] = last
        return out, 0
    p = 0
    for i in range(k):
        g = np.uint64(0)
        shift = 0
        while True:
            if p >= nbytes:
                return out, 1
            byte = stream[p]
            p += 1
            low = np.uint64(byte & np.uint8(0x7F))
            if shift == 63 and low > np.uint64(1):
                return out, 2
            if shift > 63:
                return out, 2
            g |= low << np.uint64(shift)
            shift += 7
            if byte < 128:
                break
        if g >= np.uint64(n - 1 - last):
            return out, 3
        last = last + 1 + np.int64(g)
        out[i] = last
    if p != nbytes:
        return out, 4
    return out, 0


@njit(cache=True)
def _scatter_add(out, indices, values):
    n = out.size
    for j in range(indices.size):
        i = indices[j]
        if i < 0 or i >= n:
            return j
        out[i] += values[j]
    return -1


# ---------------------------------------------------------------- wrappers
def dequantize(packed, step, levels, width, n):
    out = np.empty(n, np.float32)
    return out, _dequantize(packed, step, levels, width, n, out)


def to_fp16(x):
    return _to_fp16_bits(x.view(np.uint32)).view(np.float16)


def from_fp16(h):
    return _from_fp16_bits(h.view(np.uint16)).view(np.float32)


def encode_sparse(indices, values, n, kind, scale):
    stream, encoding, width, status = _encode_index_stream(indices, n)
    if status:
        raise ValueError(f"encode_sparse: indices must be strictly increasing and in "
                         f"[0, {n}) (sorted, distinct)")
    vk = wire.VALUE_KINDS[kind]
    if vk == wire.VALUES_F32:
        vals = values.view(np.uint8)
    elif vk == wire.VALUES_F16:
        vals = to_fp16(values).view(np.uint8)
    else:
        vals = None
    k = indices.size
    head = wire.HEADER_BYTES
    start = head + wire.pad4(stream.size)
    out = np.zeros(start + wire.value_bytes(vk, k), np.uint8)
    out[:head] = wire.make_header(n, k, encoding, width, vk, stream.size)
    out[head:head + stream.size] = stream
    if vals is None:
        out[start:start + 4] = np.array([scale], np.float32).view(np.uint8)
        out[start + 4:] = values
    else:
        out[start:] = vals
    return out


def decode_sparse(blob, n=None):
    dense_n, k, encoding, width, kind, nbytes = wire.parse_header(blob, n)
    stream = blob[wire.HEADER_BYTES:wire.HEADER_BYTES + nbytes]
    indices, status = _decode_index_stream(stream, k, encoding, width, dense_n)
    if status:
        raise wire.PayloadError("sparse payload: " + wire.DECODE_ERRORS[status])
    vals, scale = wire.split_values(blob, kind, k, nbytes)
    if kind == wire.VALUES_SIGNS:
        values = unpack_signs(np.ascontiguousarray(vals), np.array([scale], np.float32),
                              k, 0)
    elif kind == wire.VALUES_F16:
        values = from_fp16(np.array(vals))
    else:
        values = np.array(vals)  # an aligned copy
    return indices, values, dense_n


def scatter_add(out, indices, values):
    bad = _scatter_add(out, indices, values)
    if bad >= 0:
        raise wire.PayloadError(f"scatter_add: index {int(indices[bad])} is outside "
                                f"[0, {out.size})")
    return out

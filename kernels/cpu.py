"""Numba CPU kernels: the same results as ``reference``, at memory speed.

Every function is compiled on first use and cached on disk (``cache=True``); arguments
are normalised by the dispatcher (1-D contiguous arrays, int64 scalars) so each compiles
once. Streaming kernels use ``prange`` (NUMBA_NUM_THREADS threads). Floating-point
"fast math" is limited to the reductions (``reassoc`` lets the sums vectorise): kernels
whose outputs are tested bit for bit keep IEEE semantics (no FMA contraction, no
no-NaN assumptions), so NaN and Inf follow the documented rules.
"""

import numba
import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

from . import wire

FM_SUM = {"reassoc", "nsz", "arcp"}  # sums may be reordered (tolerance-tested)
BLOCK = 1 << 16  # elements per parallel work unit in the streaming kernels
SERIAL_MAX = 4 * BLOCK  # smaller inputs run on the calling thread alone (see below)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)


def _serial_if_small(kernel, size_arg):
    """Run a ``parallel=True`` kernel on one thread when its input (argument
    ``size_arg``: an array, or a count) is small.

    A parallel region wakes the worker threads and waits for them at its end: about
    10 us on an idle machine, but 38 ms per call was measured here on a loaded 2-core
    machine (OpenMP threads waiting to be scheduled), while the same call on one thread
    took 12 us. Gradients of biases and small layers stay on the calling thread.
    """
    def run(*args):
        a = args[size_arg]
        n = a.size if hasattr(a, "size") else int(a)
        threads = numba.get_num_threads()
        if n > SERIAL_MAX or threads == 1:
            return kernel(*args)
        numba.set_num_threads(1)
        try:
            return kernel(*args)
        finally:
            numba.set_num_threads(threads)

    run.__name__ = kernel.__name__[:-len("_par")]
    run.__doc__ = kernel.__doc__
    run.kernel = kernel
    return run


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


# ---------------------------------------------------------------- 1-bit signs
# Hot loops index with unsigned integers: Numba then drops its negative-index wraparound
# check, and LLVM vectorises the loop (a signed range(lo, hi) loop ran 4-5x slower).
_U = np.uint64
_PACK8 = np.uint64(0x0102040810204080)  # 8 flag bytes (0/1) -> 1 byte, flag j at bit j


@njit(cache=True, inline="always")
def _unit(u, per, size, n):
    """Work unit u of the 1-bit kernels: (chunk, lo, hi), a BLOCK-long piece of one chunk."""
    c = u // per
    lo = c * size + (u - c * per) * BLOCK
    hi = min(min(n, (c + 1) * size), lo + BLOCK)
    return c, lo, hi


@njit(cache=True, fastmath=FM_SUM)
def _abs_sum_r(x, r, lo, hi):
    s = 0.0
    for i in range(_U(lo), _U(hi)):
        s += abs(x[i] + r[i])
    return s


@njit(cache=True, fastmath=FM_SUM)
def _abs_sum(x, lo, hi):
    s = 0.0
    for i in range(_U(lo), _U(hi)):
        s += abs(x[i])
    return s


@njit(cache=True, fastmath=FM_SUM)
def _sq_sum(x, lo, hi):
    s = 0.0
    for i in range(_U(lo), _U(hi)):
        v = np.float64(x[i])
        s += v * v
    return s


@njit(cache=True, inline="always")
def _max_bits(xb, lo, hi):
    """Largest |x| bit pattern in [lo, hi) as uint32: for non-negative floats the integer
    order is the float order, and every NaN lies above +inf (so one NaN wins, and the
    selection kernels scan a block holding one)."""
    m = np.uint32(0)
    for i in range(_U(lo), _U(hi)):
        a = xb[i] & np.uint32(0x7FFFFFFF)
        m = a if a > m else m
    return m


# reduction modes of _chunk_reduce
ABS_SUM, ABS_SUM_R, SQ_SUM, MAX_BITS = 0, 1, 2, 3


@njit(cache=True, parallel=True)
def _chunk_reduce_par(x, r, mode, size, nc):
    """Per chunk of ``size``: sum |x| / sum |x + r| / sum x^2 (float64), or the max |x|
    bit pattern (mode MAX_BITS), over BLOCK-long work units in parallel."""
    n = x.size
    per = (size + BLOCK - 1) // BLOCK
    part = np.zeros(nc * per, np.float64)
    xb = x.view(np.uint32)
    for u in prange(nc * per):
        c, lo, hi = _unit(u, per, size, n)
        if mode == ABS_SUM_R:
            part[u] = _abs_sum_r(x, r, lo, hi)
        elif mode == ABS_SUM:
            part[u] = _abs_sum(x, lo, hi)
        elif mode == SQ_SUM:
            part[u] = _sq_sum(x, lo, hi)
        else:
            part[u] = np.float64(_max_bits(xb, lo, hi))  # exact: < 2**32
    out = np.zeros(nc, np.float64)
    for u in range(nc * per):
        c = u // per
        if mode == MAX_BITS:
            out[c] = max(out[c], part[u])
        else:
            out[c] += part[u]
    return out


def chunk_norms(x, chunk, kind):
    n = x.size
    size = max(n, 1) if chunk == 0 else chunk
    nc = 1 if chunk == 0 else -(-n // chunk)
    if kind == "l2":
        return np.sqrt(_chunk_reduce(x, x, SQ_SUM, size, nc)).astype(np.float32)
    bits = _chunk_reduce(x, x, MAX_BITS, size, nc).astype(np.uint32)
    out = bits.view(np.float32).copy()
    out[bits > 0x7F800000] = np.nan
    return out


@njit(cache=True)
def _flags_to_bits(flags, m, bits, b0):
    """Pack flags[0:m] (bytes 0/1) into bits[b0:], 8 per byte, flag j at bit j."""
    words = flags.view(np.uint64)
    full = m // 8
    for q in range(_U(0), _U(full)):
        bits[_U(b0) + q] = np.uint8((words[q] * _PACK8) >> _U(56))
    if full * 8 < m:
        acc = np.uint32(0)
        for j in range(full * 8, m):
            acc |= np.uint32(flags[j]) << np.uint32(j - full * 8)
        bits[b0 + full] = np.uint8(acc)


@njit(cache=True)
def _signs_ef(x, r, pos, neg, lo, hi, flags):
    nneg = -neg
    for j in range(_U(0), _U(hi - lo)):
        i = _U(lo) + j
        v = x[i] + r[i]
        isneg = v < 0
        flags[j] = np.uint8(isneg)
        r[i] = v - (nneg if isneg else pos)


@njit(cache=True)
def _signs(x, lo, hi, flags):
    for j in range(_U(0), _U(hi - lo)):
        flags[j] = np.uint8(x[_U(lo) + j] < 0)


@njit(cache=True, parallel=True)
def _pack_signs_par(x, r, use_r, pos, neg, size, bits):
    """Second pass: signs to flag bytes (and r <- v - decoded) in a vectorised loop, then
    8 flags per byte with one multiply; the flags stay in cache."""
    n = x.size
    nc = pos.size
    per = (size + BLOCK - 1) // BLOCK
    for u in prange(nc * per):
        c, lo, hi = _unit(u, per, size, n)
        flags = np.empty(BLOCK, np.uint8)
        if use_r:
            _signs_ef(x, r, pos[c], neg[c], lo, hi, flags)
        else:
            _signs(x, lo, hi, flags)
        _flags_to_bits(flags, hi - lo, bits, lo // 8)


@njit(cache=True, fastmath=FM_SUM)
def _split_sums_r(x, r, lo, hi):
    """(sum of v over v >= 0 or NaN, their count, sum of |v|) for v = x + r, in float64;
    the negative class's sum is the difference (a form that vectorises)."""
    sp = 0.0
    sa = 0.0
    cp = 0
    for i in range(_U(lo), _U(hi)):
        v = np.float64(x[i] + r[i])
        nonneg = not v < 0
        sp += v if nonneg else 0.0
        sa += abs(v)
        cp += nonneg
    return sp, cp, sa


@njit(cache=True, fastmath=FM_SUM)
def _split_sums(x, lo, hi):
    sp = 0.0
    sa = 0.0
    cp = 0
    for i in range(_U(lo), _U(hi)):
        v = np.float64(x[i])
        nonneg = not v < 0
        sp += v if nonneg else 0.0
        sa += abs(v)
        cp += nonneg
    return sp, cp, sa


@njit(cache=True, parallel=True)
def _chunk_split_sums_par(x, r, use_r, size, nc):
    n = x.size
    per = (size + BLOCK - 1) // BLOCK
    sp = np.zeros(nc * per, np.float64)
    sn = np.zeros(nc * per, np.float64)
    cp = np.zeros(nc * per, np.int64)
    for u in prange(nc * per):
        c, lo, hi = _unit(u, per, size, n)
        if use_r:
            sp[u], cp[u], sn[u] = _split_sums_r(x, r, lo, hi)
        else:
            sp[u], cp[u], sn[u] = _split_sums(x, lo, hi)
    out_sp = np.zeros(nc, np.float64)
    out_sn = np.zeros(nc, np.float64)
    out_cp = np.zeros(nc, np.int64)
    for u in range(nc * per):
        c = u // per
        out_sp[c] += sp[u]
        out_sn[c] += sn[u]
        out_cp[c] += cp[u]
    return out_sp, out_cp, out_sn


def pack_signs(x, residual, chunk, two_scales):
    n = x.size
    size = max(n, 1) if chunk == 0 else chunk
    nc = 1 if chunk == 0 else -(-n // chunk)
    use_r = residual is not None
    r = residual if use_r else x
    counts = np.minimum(size, n - size * np.arange(nc, dtype=np.int64))
    if two_scales:
        sp, cp, sa = _chunk_split_sums(x, r, use_r, size, nc)
        with np.errstate(invalid="ignore"):
            sn = sa - sp  # as the reference: inf - inf gives NaN
            pos = np.where(cp > 0, sp / np.maximum(cp, 1), 0.0).astype(np.float32)
            neg = np.where(counts - cp > 0, sn / np.maximum(counts - cp, 1),
                           0.0).astype(np.float32)
    else:
        sums = _chunk_reduce(x, r, ABS_SUM_R if use_r else ABS_SUM, size, nc)
        pos = neg = (sums / np.maximum(counts, 1)).astype(np.float32)
    bits = np.empty((n + 7) // 8, np.uint8)
    _pack_signs(x, r, use_r, pos, neg, size, bits)
    return bits, (np.stack([pos, neg], axis=1).reshape(-1) if two_scales else pos)


@njit(cache=True, parallel=True)
def _unpack_signs_par(bits, pos, neg, size, out):
    n = out.size
    nc = pos.size
    per = (size + BLOCK - 1) // BLOCK
    for u in prange(nc * per):
        c, lo, hi = _unit(u, per, size, n)
        p = pos[c]
        ng = -neg[c]
        for i in range(_U(lo), _U(hi)):
            isneg = (bits[i >> _U(3)] >> (i & _U(7))) & _U(1)
            out[i] = ng if isneg else p


def unpack_signs(bits, scales, n, chunk, two_scales):
    out = np.empty(n, np.float32)
    pos, neg = (scales[0::2].copy(), scales[1::2].copy()) if two_scales else (scales, scales)
    _unpack_signs(bits, pos, neg, max(n, 1) if chunk == 0 else chunk, out)
    return out


# ---------------------------------------------------------------- selection
@njit(cache=True, inline="always")
def _key(a):
    m = abs(a)
    return np.float32(np.inf) if m != m else m


@njit(cache=True)
def _add_into(x, r, lo, hi):
    for i in range(_U(lo), _U(hi)):
        r[i] = x[i] + r[i]


@njit(cache=True)
def threshold_select(x, tau, r, use_r):
    """v = x (+ r); |v| > tau is sent as sign * tau; r keeps v minus what was sent.

    Per BLOCK: v = x + r is written to r in one vectorised loop, then blocks of 32 whose
    largest |v| (a branch-free integer max) passes tau are scanned, all while the BLOCK
    is in cache. Indices and sign bits go into buffers sized for n entries: np.empty /
    np.zeros leave untouched pages unwritten.
    """
    n = x.size
    idx = np.empty(n, np.int64)
    signs = np.zeros((n + 7) // 8, np.uint8)
    vb = r.view(np.uint32) if use_r else x.view(np.uint32)
    tau_bits = np.array([tau], np.float32).view(np.uint32)[0]
    k = 0
    for u0 in range(0, n, BLOCK):
        u1 = min(n, u0 + BLOCK)
        if use_r:
            _add_into(x, r, u0, u1)
        for lo in range(u0, u1, 32):
            hi = min(u1, lo + 32)
            if _max_bits(vb, lo, hi) > tau_bits:
                for i in range(lo, hi):
                    v = r[i] if use_r else x[i]
                    if _key(v) > tau:
                        neg = v < 0
                        idx[k] = i
                        signs[k >> 3] |= np.uint8(neg) << np.uint8(k & 7)
                        k += 1
                        if use_r:
                            r[i] = v - (-tau if neg else tau)
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


_FILTER_SEED = np.uint64(0x5EED0F7A9C)


@njit(cache=True)
def topk_exact(x, k):
    """The k largest keys, exactly. For a large x and a small k, a sampled threshold first
    filters candidates expected to number about 2k: when at least k pass, the k-th largest
    key is among them with every tie, so the k largest of the candidates are exactly the
    k largest of x (with the same tie rule); otherwise the full selection runs."""
    n = x.size
    if n >= 1 << 16 and 0 < k and 16 * k <= n:
        m = min(n, max(1024, (256 * n + k - 1) // k))
        sample = sample_indices(n, m, _FILTER_SEED)
        sk = np.empty(m, np.float32)
        for i in range(m):
            sk[i] = _key(x[sample[i]])
        j = max(1, (2 * k * m + n // 2) // n)
        t = np.partition(sk, m - j)[m - j]
        cand, c = _select_at_least(x, t, 4 * k + 1024)
        if c >= k:
            cand = cand[:c]
            keys = np.empty(c, np.float32)
            for i in range(c):
                keys[i] = _key(x[cand[i]])
            return cand[topk_keys(keys, k)]
    return topk_keys(magnitude(x), k)


@njit(cache=True)
def _select_at_least(x, t, cap):
    """Indices whose key is >= t and > 0, in order; count -1 once more than ``cap`` pass.

    A block of 32 is scanned only when its largest |x| bit pattern reaches t's (a
    vectorised integer max), so the pass runs near memory speed when few entries pass.
    """
    n = x.size
    xb = x.view(np.uint32)
    t_bits = np.array([t], np.float32).view(np.uint32)[0]
    if t_bits == 0:
        t_bits = np.uint32(1)  # key > 0 as well
    out = np.empty(cap, np.int64)
    k = 0
    for lo in range(0, n, 32):
        hi = min(n, lo + 32)
        if _max_bits(xb, lo, hi) >= t_bits:
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
    fl = np.floor(lv)
    q = min(fl + (np.float32(1) if u < lv - fl else np.float32(0)), s)
    return np.int32(q) if lv > 0 else np.int32(0)  # 0 and NaN give level 0


@njit(cache=True)
def _codes(x, mult, levels, seed, lo, hi, codes):
    s = np.float32(levels)
    for j in range(_U(0), _U(hi - lo)):
        i = _U(lo) + j
        a = x[i]
        lev = _level(a, mult, s, _uniform(seed, i))
        codes[j] = np.uint8(levels - lev if a < 0 else levels + lev)


@njit(cache=True)
def _pack_groups(codes, m, width, out, g0):
    """codes[0:m] -> ``width`` bits each; 8 codes make exactly ``width`` bytes (group g0 on)."""
    for g in range((m + 7) // 8):
        word = np.uint64(0)
        for j in range(min(8, m - 8 * g)):
            word |= np.uint64(codes[8 * g + j]) << np.uint64(j * width)
        base = (g0 + g) * width
        for b in range(min(width, out.size - base)):
            out[base + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(0xFF))


@njit(cache=True)
def _unpack_groups(packed, width, g0, codes, m):
    """The inverse of _pack_groups for codes [8 * g0, 8 * g0 + m)."""
    mask = np.uint64((1 << width) - 1)
    for g in range((m + 7) // 8):
        word = np.uint64(0)
        base = (g0 + g) * width
        for b in range(min(width, packed.size - base)):
            word |= np.uint64(packed[base + b]) << np.uint64(8 * b)
        for j in range(min(8, m - 8 * g)):
            codes[8 * g + j] = np.uint8((word >> np.uint64(j * width)) & mask)


@njit(cache=True, parallel=True)
def quantize_par(x, mults, levels, seed, width, size):
    """Codes levels +- level per element (vectorised, dither from the hash), then packed;
    one multiplier (levels / scale) per chunk of ``size``."""
    n = x.size
    out = np.empty((n * width + 7) // 8, np.uint8)
    per = (size + BLOCK - 1) // BLOCK
    for u in prange(mults.size * per):
        c, lo, hi = _unit(u, per, size, n)
        codes = np.empty(BLOCK, np.uint8)
        _codes(x, mults[c], levels, seed, lo, hi, codes)
        _pack_groups(codes, hi - lo, width, out, lo // 8)
    return out


@njit(cache=True, parallel=True)
def _dequantize_par(packed, steps, levels, width, size, out):
    """Values (code - levels) * step; returns how many codes exceed 2 * levels."""
    n = out.size
    per = (size + BLOCK - 1) // BLOCK
    bad = np.zeros(steps.size * per, np.int64)
    for u in prange(steps.size * per):
        c, lo, hi = _unit(u, per, size, n)
        step = steps[c]
        codes = np.empty(BLOCK, np.uint8)
        _unpack_groups(packed, width, lo // 8, codes, hi - lo)
        cnt = 0
        for j in range(_U(0), _U(hi - lo)):
            code = np.int32(codes[j])
            cnt += code > 2 * levels
            out[_U(lo) + j] = np.float32(code - levels) * step
        bad[u] = cnt
    return bad.sum()


@njit(cache=True, parallel=True)
def pack_bits_par(codes, width):
    n = codes.size
    out = np.empty((n * width + 7) // 8, np.uint8)
    for u in prange((n + BLOCK - 1) // BLOCK):
        lo = u * BLOCK
        _pack_groups(codes[lo:min(n, lo + BLOCK)], min(n, lo + BLOCK) - lo, width, out,
                     lo // 8)
    return out


@njit(cache=True, parallel=True)
def unpack_bits_par(packed, width, n):
    out = np.empty(n, np.uint8)
    for u in prange((n + BLOCK - 1) // BLOCK):
        lo = u * BLOCK
        hi = min(n, lo + BLOCK)
        _unpack_groups(packed, width, lo // 8, out[lo:hi], hi - lo)
    return out


# ---------------------------------------------------------------- fp16
# Branch-free conversions (every case computed, one selected) so the loops vectorise.
_u32 = np.uint32


@intrinsic
def _f32_as_u32(typingctx, x):
    """The bits of a float32 as uint32 (LLVM bitcast; Numba has no scalar view)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def _u32_as_f32(typingctx, x):
    """The float32 whose bits are the uint32 x (LLVM bitcast)."""
    if x != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer (RNE)


@njit(cache=True, inline="always")
def _f32_to_f16_bits(f):
    """float32 bits -> float16 bits, round to nearest even; overflow -> inf, NaN -> quiet NaN
    (as the F16C instruction and NumPy give)."""
    sign = (f >> _u32(16)) & _u32(0x8000)
    a = f & _u32(0x7FFFFFFF)
    # normal halves: drop 13 mantissa bits with round-half-even, rebias 127 -> 15
    normal = ((a + _u32(0x0FFF) + ((a >> _u32(13)) & _u32(1))) >> _u32(13)) - _u32(0x1C000)
    # subnormal halves (|x| < 2**-14): the integer round(|x| * 2**24), half to even, read
    # from the low mantissa bits of |x| * 2**24 + 1.5 * 2**23 (the product is exact)
    sub = _f32_as_u32(_u32_as_f32(_u32(a)) * np.float32(2.0 ** 24) + _MAGIC) - _u32(0x4B400000)
    nan = _u32(0x7E00) | ((a >> _u32(13)) & _u32(0x03FF))
    h = normal if a >= _u32(0x38800000) else sub
    h = _u32(0x7C00) if a >= _u32(0x47800000) else h
    h = nan if a > _u32(0x7F800000) else h
    return np.uint16(sign | h)


@njit(cache=True, parallel=True)
def _to_fp16_bits_par(x_bits):
    n = x_bits.size
    out = np.empty(n, np.uint16)
    for u in prange((n + BLOCK - 1) // BLOCK):
        for i in range(_U(u * BLOCK), _U(min(n, (u + 1) * BLOCK))):
            out[i] = _f32_to_f16_bits(x_bits[i])
    return out


@njit(cache=True, inline="always")
def _f16_bits_to_f32_bits(h):
    hw = _u32(h)
    sign = (hw & _u32(0x8000)) << _u32(16)
    em = hw & _u32(0x7FFF)
    normal = (em << _u32(13)) + _u32(0x38000000)  # rebias 15 -> 127
    special = (em << _u32(13)) | _u32(0x7F800000)  # inf / NaN keep their payload
    sub = _f32_as_u32(np.float32(em) * np.float32(2.0 ** -24))  # m * 2**-24, exact
    out = sub if em < _u32(0x0400) else normal
    out = special if em >= _u32(0x7C00) else out
    return sign | out


@njit(cache=True, parallel=True)
def _from_fp16_bits_par(h_bits):
    n = h_bits.size
    out = np.empty(n, np.uint32)
    for u in prange((n + BLOCK - 1) // BLOCK):
        for i in range(_U(u * BLOCK), _U(min(n, (u + 1) * BLOCK))):
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
def dequantize(packed, steps, levels, width, n, size):
    out = np.empty(n, np.float32)
    return out, _dequantize(packed, steps, levels, width, size, out)


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
                              k, 0, False)
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


# ---------------------------------------------------------------- small inputs
_chunk_reduce = _serial_if_small(_chunk_reduce_par, 0)
_chunk_split_sums = _serial_if_small(_chunk_split_sums_par, 0)
_pack_signs = _serial_if_small(_pack_signs_par, 0)
_unpack_signs = _serial_if_small(_unpack_signs_par, 4)
quantize = _serial_if_small(quantize_par, 0)
_dequantize = _serial_if_small(_dequantize_par, 5)
pack_bits = _serial_if_small(pack_bits_par, 0)
unpack_bits = _serial_if_small(unpack_bits_par, 2)
_to_fp16_bits = _serial_if_small(_to_fp16_bits_par, 0)
_from_fp16_bits = _serial_if_small(_from_fp16_bits_par, 0)

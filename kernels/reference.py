"""NumPy reference implementations: the definition every fast kernel is tested against.

Written for clarity, not speed. Inputs are already checked and normalised by the
dispatcher in ``mpidl.kernels`` (1-D, contiguous, float32 where a gradient is expected);
see its docstring for the conventions (sign bit 1 = negative, NaN counted as the largest
magnitude, the counter-based random numbers) and the NaN/Inf rules.
"""

import numpy as np

from . import wire

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)


# ---------------------------------------------------------------- random numbers
def hash64(seed, i):
    """splitmix64 of counter ``i`` (uint64 array) under ``seed``: the same bits on every backend."""
    z = _U64(seed) + (np.asarray(i, dtype=_U64) + _U64(1)) * _GOLDEN
    z = (z ^ (z >> _U64(30))) * _M1
    z = (z ^ (z >> _U64(27))) * _M2
    return z ^ (z >> _U64(31))


def hash_uniform(seed, count):
    """``count`` float32 numbers in [0, 1), the top 24 bits of hash64(seed, i)."""
    z = hash64(seed, np.arange(count, dtype=_U64))
    return (z >> _U64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def sample_indices(n, count, seed):
    """``count`` indices in [0, n), drawn with replacement: hash64(seed, i) mod n."""
    if n == 0:
        return np.zeros(0, np.int64)
    return (hash64(seed, np.arange(count, dtype=_U64)) % _U64(n)).astype(np.int64)


def randomk_indices(n, k, seed):
    """``k`` sorted distinct indices: one uniformly chosen in each of k equal strata of [0, n)."""
    j = np.arange(k, dtype=np.int64)
    lo = j * n // k
    width = (j + 1) * n // k - lo
    pick = hash64(seed, j.astype(_U64)) % width.astype(_U64)
    return lo + pick.astype(np.int64)


# ---------------------------------------------------------------- reductions
def chunk_count(n, chunk):
    """Chunks of ``chunk`` elements in n (chunk 0: the whole tensor, always one chunk)."""
    return 1 if chunk == 0 else -(-n // chunk)


def per_element(values, n, chunk):
    """Per-chunk ``values`` repeated over their chunks' elements (length n)."""
    size = n if chunk == 0 else chunk
    return np.repeat(values, size)[:n] if n else np.zeros(0, values.dtype)


def _chunk_starts(n, chunk):
    return np.arange(0, n, n if chunk == 0 else chunk)


def chunk_norms(x, chunk=0, kind="l2"):
    """Per-chunk L2 norm (accumulated in float64) or max |x|, as float32; NaN propagates."""
    n = x.size
    out = np.zeros(chunk_count(n, chunk), np.float32)
    if n:
        starts = _chunk_starts(n, chunk)
        if kind == "l2":
            out[:] = np.sqrt(np.add.reduceat(np.square(x, dtype=np.float64), starts))
        else:
            out[:] = np.maximum.reduceat(np.abs(x), starts)
    return out


def l2norm(x):
    return chunk_norms(x, 0, "l2")[0]


def maxabs(x):
    return chunk_norms(x, 0, "max")[0]


def magnitude(x):
    """|x| with NaN mapped to +inf: the ordering key of every selection kernel."""
    key = np.abs(x)
    key[np.isnan(key)] = np.inf
    return key


# ---------------------------------------------------------------- 1-bit signs
def pack_signs(x, residual=None, chunk=0, two_scales=False):
    """1-bit signs of v = x (+ residual) and per-chunk scales (chunk 0: the whole tensor).

    Bit i (byte i // 8, bit i % 8, least significant first) is 1 where v < 0. One scale:
    the mean |v| of the chunk; the receiver reads bit 0 as +scale and 1 as -scale. Two
    scales (Seide et al.'s 1-bit SGD): the mean of the chunk's v >= 0 (NaN counted there)
    and the mean |v| of its v < 0 (computed as (sum |v| - sum of the v >= 0) / count),
    interleaved as [pos0, neg0, pos1, neg1, ...]; the
    receiver reads 0 as +pos and 1 as -neg, which keeps each chunk's sum exact. With a
    residual, it becomes v - decoded.
    """
    n = x.size
    v = x + residual if residual is not None else x.copy()
    nc = chunk_count(n, chunk)
    neg = v < 0
    pos_s = np.zeros(nc, np.float32)
    neg_s = np.zeros(nc, np.float32)
    if n:
        starts = _chunk_starts(n, chunk)
        v64 = v.astype(np.float64)
        if two_scales:
            with np.errstate(invalid="ignore", divide="ignore"):
                npos = np.add.reduceat((~neg).astype(np.int64), starts)
                nneg = np.diff(np.append(starts, n)) - npos
                spos = np.add.reduceat(np.where(neg, 0.0, v64), starts)
                # the negative sum as the total |v| minus the non-negative sum: a NaN or
                # +inf makes both scales non-finite, a -inf the negative one
                sneg = np.add.reduceat(np.abs(v64), starts) - spos
                pos_s[:] = np.where(npos > 0, spos / np.maximum(npos, 1), 0.0)
                neg_s[:] = np.where(nneg > 0, sneg / np.maximum(nneg, 1), 0.0)
        else:
            pos_s[:] = np.add.reduceat(np.abs(v64), starts) / np.diff(np.append(starts, n))
            neg_s[:] = pos_s
    bits = np.packbits(neg, bitorder="little")
    if residual is not None:
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, by the documented rule
            residual[:] = v - np.where(neg, -per_element(neg_s, n, chunk),
                                       per_element(pos_s, n, chunk))
    scales = np.stack([pos_s, neg_s], axis=1).reshape(-1) if two_scales else pos_s
    return bits, scales


def unpack_signs(bits, scales, n, chunk=0, two_scales=False):
    neg = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
    if two_scales:
        pos_s, neg_s = scales[0::2], scales[1::2]
    else:
        pos_s = neg_s = scales
    return np.where(neg, -per_element(neg_s, n, chunk),
                    per_element(pos_s, n, chunk)).astype(np.float32)


# ---------------------------------------------------------------- selection
def threshold_select(x, tau, residual=None):
    """Strom's rule: entries with |v| > tau are sent as sign * tau, the rest stay behind.

    Returns (sorted indices, packed sign bits, 1 = negative). With a residual, it becomes v
    minus what was sent.
    """
    v = x + residual if residual is not None else x
    idx = np.flatnonzero(magnitude(v) > tau).astype(np.int64)
    neg = v[idx] < 0
    if residual is not None:
        residual[:] = v
        residual[idx] = v[idx] - np.where(neg, -tau, tau).astype(np.float32)
    return idx, np.packbits(neg, bitorder="little")


def topk_keys(key, k):
    """Positions of the k largest keys, sorted; ties go to the lower position."""
    n = key.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.zeros(0, np.int64)
    t = np.partition(key, n - k)[n - k]
    gt = np.flatnonzero(key > t)
    eq = np.flatnonzero(key == t)[:k - gt.size]
    return np.sort(np.concatenate([gt, eq])).astype(np.int64)


def topk_exact(x, k):
    """Indices (sorted) of the k largest |x|, NaN counted as +inf, ties to the lower index."""
    return topk_keys(magnitude(x), k)


def sampled_rank(n, m, k):
    """Which order statistic of an m-sample estimates the k-th largest of n: max(1, round(k m / n))."""
    return max(1, (k * m + n // 2) // n)


def topk_sampled(x, k, sample):
    """DGC's approximate top-k: threshold t from a sample, keep |x| >= t (and > 0), at most k.

    ``sample`` holds indices into x. If more than k entries pass, the k largest of them are
    kept (the same as exact top-k then); if fewer pass, fewer are sent.
    """
    n, m = x.size, sample.size
    if k <= 0 or n == 0:
        return np.zeros(0, np.int64)
    key = magnitude(x)
    if m == 0:
        return topk_keys(key, k)
    sk = key[sample]
    j = sampled_rank(n, m, k)
    t = np.partition(sk, m - j)[m - j] if j <= m else sk.min()
    cand = np.flatnonzero((key >= t) & (key > 0)).astype(np.int64)
    if cand.size > k:
        cand = cand[topk_keys(key[cand], k)]
    return cand


# ---------------------------------------------------------------- quantization
def code_width(levels):
    """Bits per code of a quantizer with ``levels`` levels per sign: bit length of 2 * levels."""
    return int(2 * levels).bit_length()


def quant_multipliers(scales, levels):
    """levels / scale per chunk in float32: 0 for a zero scale, NaN for a NaN scale."""
    scales = np.asarray(scales, np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = np.float32(levels) / scales
    return np.where(scales > 0, mult, np.where(scales == 0, np.float32(0),
                                               np.float32(np.nan))).astype(np.float32)


def quantize(x, scales, levels, seed, chunk=0):
    """Stochastic quantization of x / scale to ``levels`` levels per sign, packed.

    One scale per chunk (chunk 0: per tensor). QSGD: scale = the chunk's L2 norm;
    TernGrad: max |x|, levels = 1. Level l = |x| * (levels / scale) in float32, rounded
    up with probability frac(l) (dither: hash_uniform(seed, i)), clamped to [0, levels];
    NaN gives level 0. The code is levels + l for x >= 0, levels - l for x < 0, packed
    in code_width(levels) bits.
    """
    s = np.float32(levels)
    mult = per_element(quant_multipliers(scales, levels), x.size, chunk)
    with np.errstate(invalid="ignore"):
        lv = np.abs(x) * mult
        fl = np.floor(lv)
        up = hash_uniform(seed, x.size) < (lv - fl)
        level = np.minimum(fl + up.astype(np.float32), s)
        level = np.where(lv > 0, level, np.float32(0))
    level = level.astype(np.int32)
    codes = np.where(x < 0, levels - level, levels + level).astype(np.uint8)
    return pack_bits(codes, code_width(levels))


def dequantize(packed, scales, levels, n, chunk=0):
    """Values of quantize's codes: (code - levels) * (scale / levels). Bad codes raise."""
    codes = unpack_bits(packed, code_width(levels), n)
    if n and codes.max() > 2 * levels:
        raise wire.PayloadError(f"quantized payload holds code {int(codes.max())}, "
                                f"more than {2 * levels} for {levels} levels")
    step = per_element((np.asarray(scales, np.float32) / np.float32(levels)).astype(
        np.float32), n, chunk)
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN, by the documented rule
        return (codes.astype(np.float32) - np.float32(levels)) * step


def pack_bits(codes, width):
    """Codes (uint8, each < 2**width) packed ``width`` bits each, least significant first."""
    bits = (codes[:, None] >> np.arange(width, dtype=np.uint8)) & 1
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(packed, width, n):
    bits = np.unpackbits(packed, count=n * width, bitorder="little").reshape(n, width)
    return (bits.astype(np.uint8) << np.arange(width, dtype=np.uint8)).sum(
        axis=1, dtype=np.uint8) if n else np.zeros(0, np.uint8)


# ---------------------------------------------------------------- fp16
def to_fp16(x):
    return x.astype(np.float16)


def from_fp16(h):
    return h.astype(np.float32)


# ---------------------------------------------------------------- sparse payloads
def _gaps(indices):
    idx = indices.astype(np.int64)
    gaps = np.diff(idx, prepend=-1) - 1
    return gaps.astype(np.uint64)


def _bit_length(values):
    out = np.zeros(values.size, np.int64)
    v = values.copy()
    while v.any():
        nz = v != 0
        out += nz
        v >>= _U64(1)
    return out


def encode_sparse(indices, values, n, kind="float32", scale=0.0):
    """One uint8 payload (see ``wire``) for sorted distinct ``indices`` into a tensor of n.

    ``values``: float32 values for kind "float32"/"float16"; packed sign bits (1 =
    negative) for kind "signs", which also carries one float32 ``scale``.
    """
    k = indices.size
    gaps = _gaps(indices)
    lengths = _bit_length(gaps)
    width = int(lengths.max()) if k else 0
    varint_bytes = int(np.maximum(1, -(-lengths // 7)).sum())
    fixed_bytes = wire.fixed_stream_bytes(k, width)
    if fixed_bytes <= varint_bytes:
        encoding = wire.FIXED
        bits = (gaps[:, None] >> np.arange(width, dtype=_U64)) & _U64(1)
        stream = np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")
    else:
        encoding, width = wire.VARINT, 0
        out = []
        for g in gaps.tolist():
            while True:
                byte = g & 0x7F
                g >>= 7
                out.append(byte | (0x80 if g else 0))
                if not g:
                    break
        stream = np.array(out, dtype=np.uint8)
    vk = wire.VALUE_KINDS[kind]
    if vk == wire.VALUES_F32:
        vals = values.astype(np.float32).view(np.uint8)
    elif vk == wire.VALUES_F16:
        vals = values.astype(np.float16).view(np.uint8)
    else:
        vals = np.concatenate([np.array([scale], np.float32).view(np.uint8),
                               values.astype(np.uint8)])
    head = wire.make_header(n, k, encoding, width, vk, stream.size)
    pad = np.zeros(wire.pad4(stream.size) - stream.size, np.uint8)
    return np.concatenate([head, stream, pad, vals])


def decode_sparse(blob, n=None):
    """(indices int64, values float32, dense length) of a payload; PayloadError if malformed."""
    dense_n, k, encoding, width, kind, nbytes = wire.parse_header(blob, n)
    stream = blob[wire.HEADER_BYTES:wire.HEADER_BYTES + nbytes]
    gaps = []
    if encoding == wire.FIXED:
        for i in range(k):
            g = 0
            for b in range(width):
                pos = i * width + b
                g |= ((int(stream[pos >> 3]) >> (pos & 7)) & 1) << b
            gaps.append(g)
    else:
        pos = 0
        for _ in range(k):
            g, shift = 0, 0
            while True:
                if pos >= nbytes:
                    raise wire.PayloadError("sparse payload: " + wire.DECODE_ERRORS[1])
                if shift >= 64:
                    raise wire.PayloadError("sparse payload: " + wire.DECODE_ERRORS[2])
                byte = int(stream[pos])
                pos += 1
                g |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            if g >= 2 ** 64:
                raise wire.PayloadError("sparse payload: " + wire.DECODE_ERRORS[2])
            gaps.append(g)
        if pos != nbytes:
            raise wire.PayloadError("sparse payload: " + wire.DECODE_ERRORS[4])
    idx, last = [], -1
    for g in gaps:
        last = last + 1 + g
        if last >= dense_n:
            raise wire.PayloadError("sparse payload: " + wire.DECODE_ERRORS[3])
        idx.append(last)
    indices = np.array(idx, dtype=np.int64)
    vals, sc = wire.split_values(blob, kind, k, nbytes)
    if kind == wire.VALUES_SIGNS:
        neg = np.unpackbits(vals, count=k, bitorder="little").astype(bool)
        values = np.where(neg, -sc, sc).astype(np.float32)
    else:
        values = vals.astype(np.float32)
    return indices, values, dense_n


def scatter_add(out, indices, values):
    """out[indices] += values, in order (indices may repeat across ranks' payloads)."""
    np.add.at(out, indices, values)
    return out

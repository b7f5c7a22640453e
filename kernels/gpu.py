"""CuPy GPU kernels: the CUDA sources in ``cuda/`` (RawModule) plus CuPy array operations.

Same contract and results as ``cpu`` (bit for bit, except where noted): the dispatcher
in ``mpidl.kernels`` sends CuPy arrays here. Scalars passed to RawKernels are wrapped in
NumPy types of the exact C type. Results that must be known on the host (how many
entries a selection found) synchronise, as ``cupy.flatnonzero`` does.

Noted differences (all allowed by the contract in ``mpidl.kernels``):
- a NaN made by arithmetic is CUDA's canonical NaN where x86 keeps an input NaN's payload
  (and negating a NaN may not flip its sign): "some NaN". Sign bits, selections and codes
  of NaN inputs are decided on bit patterns in cuda/*.cu, never by a comparison's NaN
  behaviour, and fp16 conversion is done on the bits so NaN keeps its sign;
- reductions (chunk sums, L2 norm) add in another order: float tolerance, as on the CPU;
- ``scatter_add`` uses atomics, so the order of additions (and the last bits of a sum of
  several ranks' values at one index) may differ from the CPU;
- ``decode_sparse`` runs on the host (the Numba decoder) and copies the result to the
  device: it checks untrusted bytes one by one, and sparse payloads are small.
"""

import functools
import os

import cupy as cp
import numpy as np

from . import cpu, wire

_CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
_THREADS = 256
_BLOCK = cpu.BLOCK
_i64, _u64, _f32, _i32 = np.int64, np.uint64, np.float32, np.int32


@functools.lru_cache(maxsize=None)
def _module(name):
    with open(os.path.join(_CUDA_DIR, name + ".cu"), encoding="utf-8") as f:
        return cp.RawModule(code=f.read())


def _launch(module, kernel, count, *args):
    """Run ``kernel`` of cuda/<module>.cu with one thread per item of ``count``."""
    if count <= 0:
        return
    fn = _module(module).get_function(kernel)
    fn(((count + _THREADS - 1) // _THREADS,), (_THREADS,), args)


# ---------------------------------------------------------------- random numbers
def sample_indices(n, count, seed):
    out = cp.empty(count, cp.int64)
    if n == 0:
        return out[:0]
    _launch("quantize", "sample_indices", count, _u64(seed), _i64(n), _i64(count), out)
    return out


def randomk_indices(n, k, seed):
    out = cp.empty(k, cp.int64)
    _launch("quantize", "randomk_indices", k, _u64(seed), _i64(n), _i64(k), out)
    return out


def hash_uniform(seed, count):
    out = cp.empty(count, cp.float32)
    _launch("quantize", "hash_uniform", count, _u64(seed), _i64(count), out)
    return out


# ---------------------------------------------------------------- reductions
ABS_SUM, ABS_SUM_R, SQ_SUM = 0, 1, 2  # modes of cuda/onebit.cu's chunk_sums


def _chunks(n, chunk):
    size = max(n, 1) if chunk == 0 else chunk
    return size, (1 if chunk == 0 else -(-n // chunk)), (size + _BLOCK - 1) // _BLOCK


def _chunk_sums(x, r, mode, chunk):
    n = x.size
    size, nc, per = _chunks(n, chunk)
    sums = cp.zeros(nc, cp.float64)
    if n:
        _module("onebit").get_function("chunk_sums")(
            (nc * per,), (_THREADS,),
            (x, r, _i32(mode), _i64(n), _i64(size), _i64(per), _i64(_BLOCK), sums))
    return sums


def chunk_norms(x, chunk, kind):
    if kind == "l2":
        return cp.sqrt(_chunk_sums(x, x, SQ_SUM, chunk)).astype(cp.float32)
    n = x.size
    size, nc, per = _chunks(n, chunk)
    bits = cp.zeros(nc, cp.uint32)
    if n:
        _module("onebit").get_function("chunk_max_bits")(
            (nc * per,), (_THREADS,),
            (x, _i64(n), _i64(size), _i64(per), _i64(_BLOCK), bits))
    out = bits.view(cp.float32).copy()
    out[bits > 0x7F800000] = cp.nan
    return out


# ---------------------------------------------------------------- 1-bit signs
def pack_signs(x, residual, chunk, two_scales):
    """Two passes, five launches at most: the chunk sums (one read of x and r), the scales
    (one thread per chunk), then signs and r <- v - decoded in one vectorised pass."""
    n = x.size
    use_r = residual is not None
    r = residual if use_r else x
    size, nc, per = _chunks(n, chunk)
    mod = _module("onebit")
    if two_scales:
        spos = cp.zeros(nc, cp.float64)
        sabs = cp.zeros(nc, cp.float64)
        cpos = cp.zeros(nc, cp.uint64)
        if n:
            mod.get_function("chunk_split_sums")(
                (nc * per,), (_THREADS,), (x, r, _i32(use_r), _i64(n), _i64(size), _i64(per),
                                          _i64(_BLOCK), spos, cpos, sabs))
        s1 = spos
    else:
        s1 = _chunk_sums(x, r, ABS_SUM_R if use_r else ABS_SUM, chunk)
        sabs, cpos = s1, cp.zeros(1, cp.uint64)  # unused with one scale
    scales = cp.empty(nc * (2 if two_scales else 1), cp.float32)
    mod.get_function("finish_scales")(
        ((nc + _THREADS - 1) // _THREADS,), (_THREADS,),
        (s1, sabs, cpos, _i32(two_scales), _i64(n), _i64(size), _i64(nc), scales))
    bits = cp.empty((n + 7) // 8, cp.uint8)
    if n:
        vec = _aligned(x) and _aligned(r)
        mod.get_function("pack_signs4")(
            (_grid((n + 3) // 4),), (_THREADS,),
            (x, r, _i32(use_r), _i32(vec), scales, _i32(two_scales), _i64(size), _i64(n),
             bits))
    return bits, scales


def unpack_signs(bits, scales, n, chunk, two_scales):
    out = cp.empty(n, cp.float32)
    if two_scales:
        pos, neg = cp.ascontiguousarray(scales[0::2]), cp.ascontiguousarray(scales[1::2])
    else:
        pos = neg = scales
    _launch("onebit", "unpack_signs", n, bits, pos, neg,
            _i64(max(n, 1) if chunk == 0 else chunk), _i64(n), out)
    return out


# ---------------------------------------------------------------- selection
def magnitude(x):
    key = cp.empty(x.size, cp.float32)
    _launch("sparse", "magnitude", x.size, x, _i64(x.size), key)
    return key


_TILE = 2048  # elements per block of cuda/sparse.cu's *_tiles kernels


def _compact(kernel, n, cap, *args):
    """Run cuda/sparse.cu's ``kernel`` (one of the *_tiles) over n items with room for
    ``cap`` entries: (stage, tiles, counter). No sync: counter[0] is the count selected
    (more than cap means the stage overflowed and the caller runs again)."""
    ntiles = -(-n // _TILE)
    stage = cp.empty(max(cap, 1), cp.int64)
    counter = cp.zeros(1, cp.uint64)
    off = cp.empty(ntiles, cp.uint64)
    cnt = cp.empty(ntiles, cp.uint32)
    _module("sparse").get_function(kernel)(
        (ntiles,), (_THREADS,), args + (_i64(n), stage, _i64(cap), counter, off, cnt))
    return stage, (off, cnt, cp.cumsum(cnt, dtype=cp.int64), _i64(ntiles)), counter


def _gather(stage, tiles, total, index_map=None, x=None):
    """The ``total`` compacted entries in order (through ``index_map``), and with ``x`` their
    top-k keys (see gather_tiles); keys is empty without it."""
    out = cp.empty(total, cp.int64)
    keys = cp.empty(total if x is not None else 0, cp.uint64)
    _launch("sparse", "gather_tiles", total, stage, *tiles, _i64(total),
            _i32(index_map is not None), stage if index_map is None else index_map, out,
            _i32(x is not None), stage if x is None else x, keys)
    return out, keys


def _kth_largest(keys, rank, passes=8):
    """A device array whose element 0 gets the top 8 * passes bits of the rank-th largest
    of ``keys`` (uint64), in ``passes`` launches and no sync."""
    state = cp.empty(3, cp.uint64)
    hist = cp.empty(256, cp.uint32)
    mod = _module("sparse")
    mod.get_function("radix_init")((1,), (256,), (state, hist, _i64(rank)))
    grid = _grid(keys.size)
    for p in range(passes):
        mod.get_function("radix_pass")(
            (grid,), (256,), (keys, _i64(keys.size), _i32(56 - 8 * p), state, hist))
    return state


def threshold_select(x, tau, r, use_r):
    """One pass over n (v = x + r into r, |v| > tau compacted tile by tile into a staging
    buffer), then one thread per 8 selected entries writes them in order with their sign
    byte and r -= sign * tau. The staging buffer holds n / 64 entries; when more are
    selected, the pass runs again on v with room for all of them."""
    n = x.size
    if n == 0:
        return cp.zeros(0, cp.int64), cp.zeros(0, cp.uint8)
    cap = min(n, max(1 << 16, n // 64))
    stage, tiles, counter = _compact("threshold_tiles", n, cap, x, r, _i32(use_r),
                                     _i32(_aligned(x) and _aligned(r)), _f32(tau))
    count = int(counter[0])
    if count > cap:  # r holds v now (or x is v): select again without adding
        v = r if use_r else x
        stage, tiles, counter = _compact("threshold_tiles", n, count, v, r, _i32(0),
                                         _i32(_aligned(v)), _f32(tau))
    idx = cp.empty(count, cp.int64)
    neg = cp.empty((count + 7) // 8, cp.uint8)
    _launch("sparse", "threshold_gather", (count + 7) // 8, stage, *tiles, _i64(count), x, r,
            _i32(use_r), _f32(tau), idx, neg)
    return idx, neg


def topk_keys(key, k):
    n = key.size
    if k >= n:
        return cp.arange(n, dtype=cp.int64)
    if k <= 0:
        return cp.zeros(0, cp.int64)
    t = cp.partition(key, n - k)[n - k]
    gt = cp.flatnonzero(key > t)
    eq = cp.flatnonzero(key == t)[:k - gt.size]
    return cp.sort(cp.concatenate([gt, eq])).astype(cp.int64)


def _candidates(x, sample, rank, cap, k):
    """Sorted indices of the entries whose key is >= the rank-th largest key at ``sample``
    (and > 0), cut to the k largest of them (ties to the lower index) when more pass;
    None when more than ``cap`` pass. One pass over x, one sync."""
    n, m = x.size, sample.size
    skeys = cp.empty(m, cp.uint64)
    _launch("sparse", "sample_keys", m, x, sample, _i64(m), skeys)
    t = _kth_largest(skeys, rank, passes=4)  # the key is the high 32 bits
    stage, tiles, counter = _compact("at_least_tiles", n, cap, x, _i32(_aligned(x)), t)
    c = int(counter[0])
    if c > cap:
        return None
    cand, keys = _gather(stage, tiles, c, x=x if c > k else None)
    if c <= k:
        return cand
    kth = _kth_largest(keys, k)
    stage, tiles, _ = _compact("at_least_u64_tiles", c, k, keys, kth)  # exactly k pass
    return _gather(stage, tiles, k, index_map=cand)[0]


def topk_exact(x, k):
    """As the CPU version: candidates above a threshold sampled for about 2k of them, the
    k largest among them when at least k pass, else the full selection."""
    n = x.size
    if n >= 1 << 16 and 0 < k and 16 * k <= n:
        m = min(n, max(1024, (256 * n + k - 1) // k))
        sample = sample_indices(n, m, cpu._FILTER_SEED)
        j = max(1, (2 * k * m + n // 2) // n)
        cand = _candidates(x, sample, min(j, m), 4 * k + 1024, k)
        if cand is not None and cand.size >= k:
            return cand
    return topk_keys(magnitude(x), k)


def topk_sampled(x, k, sample, m_rank):
    n, m = x.size, sample.size
    if k <= 0 or n == 0:
        return cp.zeros(0, cp.int64)
    if m == 0:
        return topk_exact(x, k)
    cand = _candidates(x, sample, min(m_rank, m), min(n, 2 * k + 1024), k)
    return topk_exact(x, k) if cand is None else cand


# ---------------------------------------------------------------- quantization
_QTILE = 8192  # elements per block of cuda/quantize.cu's dequantize


def quantize(x, mults, levels, seed, width, size):
    n = x.size
    out = cp.empty((n * width + 7) // 8, cp.uint8)
    _launch("quantize", "quantize", (n + 7) // 8, x, _i64(n), mults, _i64(size),
            _i32(levels), _u64(seed), _i32(width), _i64(out.size), out)
    return out


def dequantize(packed, steps, levels, width, n, size):
    out = cp.empty(n, cp.float32)
    bad = cp.zeros(1, cp.uint64)
    if n:
        _module("quantize").get_function("dequantize")(
            (-(-n // _QTILE),), (_THREADS,),
            (packed, _i64(packed.size), steps, _i64(size), _i32(levels), _i32(width),
             _i32(_aligned(packed, to=4) and _aligned(out)), _i64(n), out, bad))
    return out, int(bad[0])


def pack_bits(codes, width):
    n = codes.size
    out = cp.empty((n * width + 7) // 8, cp.uint8)
    _launch("quantize", "pack_bits", (n + 7) // 8, codes, _i64(n), _i32(width),
            _i64(out.size), out)
    return out


def unpack_bits(packed, width, n):
    out = cp.empty(n, cp.uint8)
    _launch("quantize", "unpack_bits", (n + 7) // 8, packed, _i64(packed.size), _i32(width),
            _i64(n), out)
    return out


# ---------------------------------------------------------------- fp16
def _grid(count):
    """Blocks for a grid-stride kernel: enough to fill the device, no more than needed."""
    return max(1, min((count + _THREADS - 1) // _THREADS, _sm_count() * 16))


@functools.lru_cache(maxsize=None)
def _sm_count():
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def _aligned(*arrays, to=16):
    return all(a.data.ptr % to == 0 for a in arrays)


def to_fp16(x):
    """One elementwise kernel on the bits, the same bits as the Numba version (CuPy's
    astype would give CUDA's canonical NaN, losing a NaN's sign)."""
    n = x.size
    out = cp.empty(n, cp.float16)
    if n:
        vec = _aligned(x) and _aligned(out, to=8)
        _module("quantize").get_function("to_fp16")(
            (_grid((n + 3) // 4),), (_THREADS,), (x, _i64(n), _i32(vec), out))
    return out


def from_fp16(h):
    n = h.size
    out = cp.empty(n, cp.float32)
    if n:
        vec = _aligned(h, to=8) and _aligned(out)
        _module("quantize").get_function("from_fp16")(
            (_grid((n + 3) // 4),), (_THREADS,), (h, _i64(n), _i32(vec), out))
    return out


# ---------------------------------------------------------------- sparse payloads
def encode_sparse(indices, values, n, kind, scale):
    k = indices.size
    gap = cp.empty(k, cp.uint64)
    bitlen = cp.zeros(k, cp.int32)
    bad = cp.zeros(1, cp.int32)
    _launch("sparse", "gaps", k, indices, _i64(k), _i64(n), gap, bitlen, bad)
    if int(bad[0]):
        raise ValueError(f"encode_sparse: indices must be strictly increasing and in "
                         f"[0, {n}) (sorted, distinct)")
    width = int(bitlen.max()) if k else 0
    vlen = cp.maximum(1, (bitlen + 6) // 7).astype(cp.int64)
    varint_bytes = int(vlen.sum()) if k else 0
    fixed_bytes = wire.fixed_stream_bytes(k, width)
    if fixed_bytes <= varint_bytes:
        encoding = wire.FIXED
        stream = cp.empty(fixed_bytes, cp.uint8)
        _launch("sparse", "pack_fixed", (k + 7) // 8, gap, _i64(k), _i32(width),
                _i64(fixed_bytes), stream)
    else:
        encoding, width = wire.VARINT, 0
        stream = cp.empty(varint_bytes, cp.uint8)
        offset = cp.cumsum(vlen) - vlen
        _launch("sparse", "pack_varint", k, gap, offset, _i64(k), stream)
    vk = wire.VALUE_KINDS[kind]
    if vk == wire.VALUES_F32:
        vals = values.view(cp.uint8)
    elif vk == wire.VALUES_F16:
        vals = to_fp16(values).view(cp.uint8)
    else:
        vals = cp.concatenate([cp.asarray(np.array([scale], np.float32).view(np.uint8)),
                               values])
    head = cp.asarray(wire.make_header(n, k, encoding, width, vk, stream.size))
    pad = cp.zeros(wire.pad4(stream.size) - stream.size, cp.uint8)
    return cp.concatenate([head, stream, pad, vals])


def decode_sparse(blob, n=None):
    indices, values, dense_n = cpu.decode_sparse(cp.asnumpy(blob), n)
    return cp.asarray(indices), cp.asarray(values), dense_n


def scatter_add(out, indices, values):
    if indices.size:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= out.size:
            raise wire.PayloadError(f"scatter_add: index {lo if lo < 0 else hi} is outside "
                                    f"[0, {out.size})")
        _launch("sparse", "scatter_add", indices.size, indices, values, _i64(indices.size),
                out)
    return out


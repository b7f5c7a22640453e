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

from . import cpu, reference, wire

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


def _pack_flags(flags):
    bits = cp.empty((flags.size + 7) // 8, cp.uint8)
    _launch("onebit", "pack_flags", bits.size, flags, _i64(flags.size), bits)
    return bits


# ---------------------------------------------------------------- selection
def magnitude(x):
    key = cp.empty(x.size, cp.float32)
    _launch("sparse", "magnitude", x.size, x, _i64(x.size), key)
    return key


def threshold_select(x, tau, r, use_r):
    n = x.size
    flags = cp.empty(n, cp.uint8)
    _launch("sparse", "threshold_flags", n, x, r, _i32(use_r), _f32(tau), _i64(n), flags)
    idx = cp.flatnonzero(flags).astype(cp.int64)
    neg = cp.empty(idx.size, cp.uint8)
    _launch("sparse", "threshold_send", idx.size, idx, _i64(idx.size), _f32(tau), x, r,
            _i32(use_r), neg)
    return idx, _pack_flags(neg)


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


def topk_exact(x, k):
    return topk_keys(magnitude(x), k)


def topk_sampled(x, k, sample, m_rank):
    n, m = x.size, sample.size
    if k <= 0 or n == 0:
        return cp.zeros(0, cp.int64)
    if m == 0:
        return topk_exact(x, k)
    sk = magnitude(x[sample])
    t = cp.partition(sk, m - m_rank)[m - m_rank] if m_rank <= m else sk.min()
    flags = cp.empty(n, cp.uint8)
    _launch("sparse", "at_least", n, x, _f32(float(t)), _i64(n), flags)
    cand = cp.flatnonzero(flags).astype(cp.int64)
    if cand.size > k:
        cand = cand[topk_keys(magnitude(x[cand]), k)]
    return cand


# ---------------------------------------------------------------- quantization
_QTILE = 8192  # elements per block of cuda/quantize.cu's quantize and dequantize


def quantize(x, mults, levels, seed, width, size):
    n = x.size
    out = cp.empty((n * width + 7) // 8, cp.uint8)
    if n:
        _module("quantize").get_function("quantize")(
            (-(-n // _QTILE),), (_THREADS,),
            (x, _i64(n), mults, _i64(size), _i32(levels), _u64(seed), _i32(width),
             _i32(_aligned(x) and _aligned(out, to=4)), _i64(out.size), out))
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


"""Quantization and sparse-packing kernels for compressed gradient exchange (``mpidl.kernels``).

Each kernel has three versions with the same results: a NumPy reference
(``mpidl.kernels.reference``, the definition), a Numba CPU version (``.cpu``) and a CuPy
GPU version (``.gpu``, CUDA sources in ``cuda/``). The functions here check their
arguments and pick the version by the array's type: NumPy arrays run the Numba kernels,
CuPy arrays the GPU ones. Gradients are float32; any shape is accepted and read flat.

Conventions
-----------
- Sign bits: 1 = negative, like the IEEE sign bit; element i is bit ``i % 8`` (least
  significant first) of byte ``i // 8``. The receiver reads 0 as +scale, 1 as -scale.
- Magnitude order: selection kernels (threshold, top-k) order entries by ``|x|`` with NaN
  counted as +inf; ties go to the lower index. Selected indices come back sorted.
- Random numbers are counter-based (splitmix64 of the element's index under a seed), so
  every backend draws the same numbers and tests compare bit for bit.

What the three versions agree on (checked in tests/test_kernels.py)
-------------------------------------------------------------------
Two levels of agreement, and one relaxation for NaN:

- **bitwise**: the same bytes from the reference, Numba and CuPy. Every integer output
  (sign bits, indices, codes, payload bytes, random numbers) is bitwise on *all* inputs,
  NaN and Inf included (one exception: the two bytes of a NaN sent as float16). Float
  outputs made by one IEEE float32 operation per element (threshold residual,
  ``unpack_signs``, ``dequantize``, ``to_fp16``/``from_fp16``, max norms) are bitwise
  on finite and infinite inputs.
- **rtol 1e-6**: outputs that are sums (1-bit scales and the 1-bit residual computed from
  them, L2 norms, ``scatter_add`` on the GPU, whose atomics add in any order) agree to a
  float tolerance on finite inputs; their non-finite class (NaN, +inf, -inf) is the same.
- **some NaN**: wherever a rule below gives NaN, any NaN satisfies it, on every backend:
  the payload *and the sign bit of that NaN* are unspecified (x86 keeps an input NaN's
  payload, CUDA returns its canonical NaN; negating a NaN may or may not flip its sign).
  A NaN never matches a number, and a number never matches a NaN.

No kernel spends a pass looking for NaN/Inf; they propagate by these rules, so a
diverging rank shows up instead of being hidden. v is x (+ residual), one float32 add.

- Sign bits (``pack_signs``, ``threshold_select``): the bit is 1 exactly where v < 0:
  -inf and negative numbers give 1; +0, -0, +inf and **every NaN (either sign) give 0**.
  The CUDA code tests the bit pattern (negative, nonzero, not NaN), not a comparison.
- ``pack_signs`` scales, per chunk, by what the chunk's v hold (a NaN wins over an inf):
  one scale: a NaN -> NaN; else any +-inf -> +inf; else the mean |v|.
  Two scales (pos = mean of v >= 0 with NaN counted there, neg = mean |v| of v < 0,
  computed as (sum |v| - sum of the v >= 0) / count): pos is NaN if a NaN, else +inf if
  a +inf, else finite (0 if the chunk has no v >= 0). neg is 0 if the chunk has no v < 0;
  otherwise NaN if a NaN or a +inf (inf - inf), else +inf if a -inf, else finite.
  ``unpack_signs`` gives +pos for bit 0 and -neg for bit 1 (a NaN scale: some NaN). The
  residual becomes v - decoded in float32: NaN where v or its scale is NaN or where
  inf - inf, +-inf where IEEE says so.
- ``threshold_select``, ``topk_*``: the key is |v| with every NaN counted as +inf, so
  NaN and +-inf entries are always selected by a threshold (tau is finite) and rank
  first (ties to the lower index) in top-k. Top-k sends values, so the NaN reaches every
  rank. Threshold sends only a sign (NaN reads as positive: +tau); the residual becomes
  v - sign * tau for the selected entries (NaN stays some NaN, +-inf stay +-inf) and v
  for the rest.
- ``quantize``: the codes are always valid. A chunk whose scale is NaN or negative gets
  a NaN multiplier, a zero scale a zero one, and an infinite scale a zero one
  (levels / inf); then an element whose level |x| * multiplier is NaN or <= 0 (x NaN, x
  +-inf times 0, a NaN multiplier) gets level 0, i.e. code ``levels``; a level above
  ``levels`` (|x| above the scale, or an infinite product) is clamped to ``levels``.
  ``dequantize`` multiplies (code - levels) by scale / levels: a NaN scale decodes the
  whole chunk to some NaN (so every rank sees it); an infinite scale gives +-inf, and NaN
  for code ``levels`` (0 * inf).
- ``chunk_norms``: a NaN in a chunk gives some NaN, else an inf gives +inf ("l2" also
  +inf if the norm overflows float32).
- ``to_fp16``: IEEE round to nearest even, |x| >= 65520 becomes +-inf. A NaN gives a
  quiet NaN **of the same sign** (an exception to "some NaN": the sign is kept; the
  payload is some NaN, as NumPy's and F16C's differ; the Numba and CUDA kernels give the
  same bits, 0x7E00 | the top 10 payload bits). ``from_fp16``: exact; NaN likewise.
- Sparse payloads: float32 values are copied byte for byte (NaN payloads too); float16
  values go through ``to_fp16`` (a NaN's two bytes: some NaN); "signs" decode as
  +-scale (a NaN scale: some NaN).
- Zero gradients give well-formed payloads of the normal shape (1-bit: zero scale;
  sparse: a header with k = 0), never an empty message a peer would wait for in vain.

Decoders (``decode_sparse``, ``dequantize``, ``unpack_signs``) check what they receive
and raise ``PayloadError`` (a ValueError) for a truncated, over-long or out-of-range
payload; they never read or write outside their arrays.
"""

import math

import numpy as np

from . import reference, wire
from .wire import PayloadError

try:  # only to recognise CuPy arrays' module; nothing here needs CuPy
    from mpidl.backend import cupy_module
except ImportError:  # kernels used on their own
    def cupy_module():
        import cupy  # noqa: PLC0415

        return cupy

__all__ = [
    "PayloadError", "share_cores", "pack_signs", "unpack_signs", "threshold_select", "topk_exact",
    "topk_sampled", "sample_size", "sample_indices", "randomk_indices", "hash_uniform",
    "chunk_norms", "l2norm", "maxabs", "quantize", "dequantize", "code_width", "pack_bits", "unpack_bits",
    "to_fp16", "from_fp16", "encode_sparse", "decode_sparse", "scatter_add", "reference",
]

_SEED_MASK = (1 << 64) - 1


def _check_chunk(chunk):
    chunk = int(chunk)
    if chunk < 0 or chunk % 8:
        raise ValueError(f"chunk must be 0 (one scale per tensor) or a positive multiple of "
                         f"8, got {chunk}")
    return chunk


def _is_gpu(a):
    return type(a).__module__.startswith("cupy")


def _impl(a):
    """The backend module for ``a``: ``gpu`` for CuPy arrays, ``cpu`` (Numba) otherwise."""
    if _is_gpu(a):
        from . import gpu  # noqa: PLC0415 - CuPy only where it is used

        return gpu
    from . import cpu  # noqa: PLC0415 - import compiles nothing; first calls do

    return cpu


def _flat(a, what, dtype=np.float32):
    """``a`` as a flat contiguous view of the expected dtype, or a clear TypeError."""
    if not hasattr(a, "dtype") or not hasattr(a, "reshape"):
        raise TypeError(f"{what}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{what}: expected {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise TypeError(f"{what}: expected a contiguous array (a view with strides was given)")
    return a.reshape(-1)


def _residual(x, residual):
    if residual is None:
        return None
    r = _flat(residual, "residual")
    if r.size != x.size or _is_gpu(r) != _is_gpu(x):
        raise ValueError(f"residual has {r.size} elements on "
                         f"{'GPU' if _is_gpu(r) else 'CPU'}, the gradient {x.size} on "
                         f"{'GPU' if _is_gpu(x) else 'CPU'}")
    return r


def _seed(seed):
    return np.uint64(int(seed) & _SEED_MASK)


def _count(value, what, upper=None):
    value = int(value)
    if value < 0 or (upper is not None and value > upper):
        raise ValueError(f"{what} must be in [0, {upper}], got {value}")
    return value


def share_cores(ranks_on_node):
    """Give this rank's CPU kernels its share of the node's cores: at most
    cpu_count // ranks_on_node Numba threads (never more than it has). Several ranks each
    running one thread per core oversubscribe the node, and every parallel kernel then
    waits for threads the OS has not scheduled. An explicit NUMBA_NUM_THREADS is left
    alone. Applies to the calling thread; returns the thread count in effect."""
    import os  # noqa: PLC0415

    import numba  # noqa: PLC0415

    if "NUMBA_NUM_THREADS" not in os.environ and ranks_on_node > 1:
        share = max(1, (os.cpu_count() or 1) // int(ranks_on_node))
        if share < numba.get_num_threads():
            numba.set_num_threads(share)
    return numba.get_num_threads()


# ---------------------------------------------------------------- 1-bit signs
def pack_signs(x, residual=None, chunk=0, two_scales=False):
    """1-bit compression: ``(bits, scales)`` of v = x (+ residual), residual updated in place.

    ``bits`` (uint8, ceil(n/8)) holds the sign of each v (1 = negative). ``scales``
    (float32), per chunk of ``chunk`` elements (one chunk when chunk = 0): the mean |v|;
    or, with ``two_scales`` (Seide et al.), the mean of the v >= 0 and the mean |v| of
    the v < 0, interleaved [pos0, neg0, pos1, ...], so each chunk's sum is kept exactly.
    With a residual (error feedback), it becomes v - decoded in the same pass.
    """
    x = _flat(x, "pack_signs: x")
    return _impl(x).pack_signs(x, _residual(x, residual), _check_chunk(chunk),
                               bool(two_scales))


def unpack_signs(bits, scales, n, chunk=0, two_scales=False):
    """Decode ``pack_signs``: +pos / -neg scale per element (float32, n); checks sizes."""
    chunk = _check_chunk(chunk)
    bits = _flat(bits, "unpack_signs: bits", np.uint8)
    scales = _flat(scales, "unpack_signs: scales")
    n = _count(n, "n")
    if bits.size != (n + 7) // 8:
        raise PayloadError(f"1-bit payload has {bits.size} bytes of signs, "
                           f"{n} elements need {(n + 7) // 8}")
    want = reference.chunk_count(n, chunk) * (2 if two_scales else 1)
    if scales.size != want:
        raise PayloadError(f"1-bit payload has {scales.size} scales, {n} elements in "
                           f"chunks of {chunk or n} need {want}")
    return _impl(bits).unpack_signs(bits, scales, n, chunk, bool(two_scales))


# ---------------------------------------------------------------- selection
def threshold_select(x, tau, residual=None):
    """Strom's threshold: ``(indices, sign_bits)`` of the entries with |v| > tau.

    v = x (+ residual). Selected entries are sent as sign * tau; the residual, if given,
    becomes v minus what was sent (the rest of v stays in it whole).
    """
    x = _flat(x, "threshold_select: x")
    tau = float(tau)
    if not (tau >= 0 and math.isfinite(tau)):
        raise ValueError(f"threshold tau must be a finite number >= 0, got {tau}")
    r = _residual(x, residual)
    return _impl(x).threshold_select(x, np.float32(tau), r if r is not None else x,
                                     r is not None)


def topk_exact(x, k):
    """Sorted indices (int64) of the k largest |x| (NaN first, ties to the lower index)."""
    x = _flat(x, "topk_exact: x")
    return _impl(x).topk_exact(x, _count(k, "k", x.size))


def sample_size(n, k):
    """Sample size of ``topk_sampled``: about 128 expected hits, at least 1024, at most n."""
    if k <= 0:
        return 0
    return min(n, max(1024, -(-128 * n // k)))


def topk_sampled(x, k, seed=0, sample=None):
    """DGC's approximate top-k: at most k sorted indices, one pass after a sampled threshold.

    The threshold is the matching order statistic of |x| at ``sample`` (indices; by default
    ``sample_indices(n, sample_size(n, k), seed)``); entries with |x| >= threshold (and
    nonzero) are kept. When more than k pass, the k largest of them are returned (the same
    as ``topk_exact``); when fewer pass, fewer are returned.
    """
    x = _flat(x, "topk_sampled: x")
    n = x.size
    k = _count(k, "k", n)
    impl = _impl(x)
    if sample is None:
        sample = impl.sample_indices(n, sample_size(n, k), _seed(seed))
    else:
        sample = _flat(sample, "topk_sampled: sample", np.int64)
    m = sample.size
    return impl.topk_sampled(x, k, sample, reference.sampled_rank(n, m, k) if m else 1)


def sample_indices(n, count, seed, like=None):
    """``count`` indices in [0, n) with replacement, from the counter-based hash."""
    return _impl(like).sample_indices(_count(n, "n"), _count(count, "count"), _seed(seed))


def randomk_indices(n, k, seed, like=None):
    """k sorted distinct indices, one uniformly in each of k equal strata of [0, n).

    The same seed gives the same indices on every rank and backend, so random-k payloads
    need no indices and can be summed.
    """
    n = _count(n, "n")
    k = _count(k, "k", n)
    if k and n * k >= 1 << 63:
        raise ValueError(f"randomk_indices: n * k = {n * k} overflows int64")
    return _impl(like).randomk_indices(n, k, _seed(seed))


def hash_uniform(seed, count, like=None):
    """``count`` float32 uniforms in [0, 1) from the counter-based hash."""
    return _impl(like).hash_uniform(_seed(seed), _count(count, "count"))


# ---------------------------------------------------------------- quantization
def _chunks(n, chunk):
    """(elements per chunk, number of chunks) for kernels; chunk 0 = one per tensor."""
    return (max(n, 1), 1) if chunk == 0 else (chunk, -(-n // chunk))


def chunk_norms(x, chunk=0, kind="l2"):
    """Per-chunk L2 norm (float64 accumulation) or max |x| ("max"), float32, NaN propagates.

    One value per chunk of ``chunk`` elements; chunk 0 gives one value for the tensor.
    """
    x = _flat(x, "chunk_norms: x")
    if kind not in ("l2", "max"):
        raise ValueError(f"chunk_norms: kind must be 'l2' or 'max', got {kind!r}")
    return _impl(x).chunk_norms(x, _check_chunk(chunk), kind)


def l2norm(x):
    """||x||_2 accumulated in float64, as a float32 scalar (NaN/Inf propagate)."""
    return np.float32(float(chunk_norms(x, 0, "l2")[0]))  # float(): a CuPy 0-d syncs


def maxabs(x):
    """max |x| as a float32 scalar (NaN if any entry is NaN)."""
    return np.float32(float(chunk_norms(x, 0, "max")[0]))


def code_width(levels):
    """Bits per quantized code for ``levels`` levels per sign (2 for TernGrad)."""
    return reference.code_width(levels)


def _check_levels(levels):
    levels = int(levels)
    if not 1 <= levels <= 127:
        raise ValueError(f"quantization levels must be in [1, 127] (codes of at most 8 "
                         f"bits), got {levels}")
    return levels


def _scales(scales, n, chunk, like, what):
    """The per-chunk scales as a float32 array of the right length (a scalar is allowed
    for one chunk), on the backend of ``like``."""
    mod = cupy_module() if _is_gpu(like) else np
    scales = mod.asarray(scales, dtype=mod.float32).reshape(-1)
    want = reference.chunk_count(n, chunk)
    if scales.size != want:
        raise PayloadError(f"{what}: {scales.size} scales, {n} elements in chunks of "
                           f"{chunk or n} need {want}")
    return mod, scales


def quantize(x, scales, levels, seed, chunk=0):
    """Stochastic quantization of x / scale to ``levels`` levels per sign, bit-packed.

    One scale per chunk (chunk 0: one per tensor): QSGD uses ``chunk_norms(x, chunk)``,
    TernGrad ``chunk_norms(x, chunk, "max")`` with levels = 1. Returns uint8 codes packed
    ``code_width(levels)`` bits each; see ``reference.quantize`` for the rule.
    """
    x = _flat(x, "quantize: x")
    levels = _check_levels(levels)
    chunk = _check_chunk(chunk)
    mod, scales = _scales(scales, x.size, chunk, x, "quantize")
    s = mod.float32(levels)
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = s / scales
    mults = mod.where(scales > 0, mult, mod.where(scales == 0, mod.float32(0),
                                                  mod.float32(np.nan))).astype(mod.float32)
    return _impl(x).quantize(x, mults, levels, _seed(seed), code_width(levels),
                             _chunks(x.size, chunk)[0])


def dequantize(packed, scales, levels, n, chunk=0):
    """Decode ``quantize``; a payload of the wrong size or with impossible codes raises."""
    levels = _check_levels(levels)
    chunk = _check_chunk(chunk)
    packed = _flat(packed, "dequantize: packed", np.uint8)
    n = _count(n, "n")
    width = code_width(levels)
    if packed.size != (n * width + 7) // 8:
        raise PayloadError(f"quantized payload has {packed.size} bytes, {n} codes of "
                           f"{width} bits need {(n * width + 7) // 8}")
    mod, scales = _scales(scales, n, chunk, packed, "dequantize")
    steps = (scales / mod.float32(levels)).astype(mod.float32)
    out, bad = _impl(packed).dequantize(packed, steps, levels, width, n,
                                        _chunks(n, chunk)[0])
    if bad:
        raise PayloadError(f"quantized payload holds {bad} codes above {2 * levels}, "
                           f"impossible for {levels} levels")
    return out


def pack_bits(codes, width):
    """uint8 codes (each < 2**width, width 1..8) packed least significant bit first."""
    codes = _flat(codes, "pack_bits: codes", np.uint8)
    return _impl(codes).pack_bits(codes, _count(width, "width", 8))


def unpack_bits(packed, width, n):
    packed = _flat(packed, "unpack_bits: packed", np.uint8)
    width = _count(width, "width", 8)
    if packed.size != (n * width + 7) // 8:
        raise PayloadError(f"bit-packed payload has {packed.size} bytes, {n} codes of "
                           f"{width} bits need {(n * width + 7) // 8}")
    return _impl(packed).unpack_bits(packed, width, _count(n, "n"))


# ---------------------------------------------------------------- fp16
def to_fp16(x):
    """float32 -> float16, IEEE round to nearest even (overflow to +-inf, NaN stays NaN)."""
    x = _flat(x, "to_fp16: x")
    return _impl(x).to_fp16(x)


def from_fp16(h):
    h = _flat(h, "from_fp16: h", np.float16)
    return _impl(h).from_fp16(h)


# ---------------------------------------------------------------- sparse payloads
def encode_sparse(indices, values, n, kind="float32", scale=0.0):
    """One uint8 payload for sorted distinct ``indices`` into a tensor of n elements.

    kind "float32"/"float16": ``values`` holds one value per index; kind "signs":
    ``values`` holds packed sign bits (1 = negative) and ``scale`` the magnitude. The index
    gaps are packed as varint or fixed width, whichever is smaller (layout in ``wire``).
    """
    if kind not in wire.VALUE_KINDS:
        raise ValueError(f"unknown value kind {kind!r}: expected one of "
                         f"{', '.join(wire.VALUE_KINDS)}")
    indices = _flat(indices, "encode_sparse: indices", np.int64)
    k = indices.size
    if kind == "signs":
        values = _flat(values, "encode_sparse: sign bits", np.uint8)
        if values.size != (k + 7) // 8:
            raise ValueError(f"encode_sparse: {k} indices need {(k + 7) // 8} sign bytes, "
                             f"got {values.size}")
    else:
        values = _flat(values, "encode_sparse: values")
        if values.size != k:
            raise ValueError(f"encode_sparse: {k} indices but {values.size} values")
    return _impl(indices).encode_sparse(indices, values, _count(n, "n"), kind, scale)


def decode_sparse(payload, n=None):
    """``(indices, values, n)`` of a sparse payload, checked: PayloadError if malformed.

    ``n`` is the dense length the receiver expects (checked against the header).
    """
    return _impl(payload).decode_sparse(payload, n)


def scatter_add(out, indices, values):
    """out[indices] += values in order; indices may repeat (several ranks' payloads)."""
    out = _flat(out, "scatter_add: out")
    indices = _flat(indices, "scatter_add: indices", np.int64)
    values = _flat(values, "scatter_add: values")
    if indices.size != values.size:
        raise ValueError(f"scatter_add: {indices.size} indices but {values.size} values")
    return _impl(out).scatter_add(out, indices, values)

"""Every fast kernel against its NumPy reference (``mpidl.kernels.reference``).

The agreement is the contract in ``mpidl.kernels``' docstring: bit-exact for packed bits,
integer codes, indices, payload bytes and single-operation float outputs; float tolerances
where a kernel adds in another order (chunk scales, norms: rtol 1e-6, from float64
accumulation); and where the contract says "some NaN", any NaN matches any NaN (``same``
with ``some_nan=True``) while a number never matches a NaN. Inputs include empty arrays,
length 1, lengths not divisible by 8, sizes that cross the kernels' 65536-element work
units, NaN (of both signs, with a payload)/Inf, ties and all-zero gradients.
Written once for both backends: the CuPy runs skip without a CUDA device.
"""

import numpy as np
import pytest

import mpidl.kernels as K
from mpidl.kernels import reference as R
from mpidl.kernels.wire import PayloadError

SIZES = [0, 1, 7, 8, 9, 31, 33, 1000, 65536 + 13, 200003]
KINDS = ["normal", "zeros", "nonfinite", "ties"]


def _gpu_ready():
    from mpidl.backend import gpu_count

    return gpu_count() > 0


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "numpy":
        return np
    if not _gpu_ready():
        pytest.skip("CuPy with a CUDA device is not available")
    import cupy

    return cupy


def host(a):
    return a.get() if type(a).__module__.startswith("cupy") else np.asarray(a)


def make(n, kind, seed=0):
    rng = np.random.default_rng(seed + n)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        x[:] = 0
    elif kind == "nonfinite" and n:
        pos = rng.choice(n, size=min(n, 4), replace=False)
        x[pos[0]] = np.nan
        if n > 1:
            x[pos[1]] = np.inf
        if n > 2:
            x[pos[2]] = -np.inf
        if n > 3:  # a negative NaN with a payload: its sign bit must not leak anywhere
            x[pos[3]] = NEG_NAN
    elif kind == "ties":
        x = np.round(x * 2).astype(np.float32) / 2  # few distinct magnitudes, -0.0 too
    return x


NEG_NAN = np.uint32(0xFFC00001).view(np.float32)


def same_bits(a, b, some_nan=False):
    """The one comparison of these tests: same dtype, shape and bytes. With ``some_nan``
    (where the contract in ``mpidl.kernels`` says "some NaN"), a NaN in ``a`` matches any
    NaN in ``b`` (payload and sign free); a NaN against a number fails, and every other
    entry must still have the same bits (so -0.0 is not 0.0, and a finite difference of one
    ulp fails)."""
    a, b = np.atleast_1d(host(a)), np.atleast_1d(host(b))
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    a, b = a.reshape(-1), b.reshape(-1)
    if some_nan and a.dtype.kind == "f":
        na, nb = np.isnan(a), np.isnan(b)
        assert np.array_equal(na, nb), (
            f"NaN against a number at {np.flatnonzero(na != nb)[:8].tolist()}: "
            f"{a[na != nb][:8].tolist()} vs {b[na != nb][:8].tolist()}")
        a, b = a[~na], b[~nb]
    ua, ub = (v.view(np.uint8).reshape(v.size, v.dtype.itemsize) for v in (a, b))
    diff = np.flatnonzero((ua != ub).any(axis=1))
    assert diff.size == 0, (f"{diff.size} of {a.size} entries differ, first at "
                            f"{diff[:8].tolist()}: {a[diff[:8]].tolist()} vs "
                            f"{b[diff[:8]].tolist()}")


def test_same_bits_follows_the_contract():
    """The comparison itself can fail: a finite difference, a NaN against a number, -0.0
    against 0.0 and a NaN payload without ``some_nan`` are all rejected."""
    x = np.array([1.0, np.nan, -np.inf], np.float32)
    same_bits(x, x.copy())
    other_nan = x.copy()
    other_nan[1] = NEG_NAN  # another sign and payload
    same_bits(x, other_nan, some_nan=True)
    with pytest.raises(AssertionError):
        same_bits(x, other_nan)
    for bad in ([np.nextafter(np.float32(1), np.float32(2)), np.nan, -np.inf],  # one ulp
                [1.0, 0.0, -np.inf],  # NaN against a number
                [1.0, np.nan, np.inf],  # the sign of an inf
                [np.nan, np.nan, -np.inf]):  # a number against a NaN
        with pytest.raises(AssertionError):
            same_bits(x, np.array(bad, np.float32), some_nan=True)
    with pytest.raises(AssertionError):
        same_bits(np.float32([0.0]), np.float32([-0.0]), some_nan=True)
    with pytest.raises(AssertionError):  # dtype
        same_bits(np.float32([1.0]), np.float64([1.0]), some_nan=True)
    h = np.array([np.nan, 1], np.float16)
    same_bits(h, np.array([-np.nan, 1], np.float16), some_nan=True)
    with pytest.raises(AssertionError):
        same_bits(h, np.array([np.nan, 2], np.float16), some_nan=True)
    with pytest.raises(AssertionError):  # integers: never relaxed
        same_bits(np.uint8([1, 2]), np.uint8([1, 3]), some_nan=True)


# ---------------------------------------------------------------- 1-bit signs
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk,two", [(0, False), (8, False), (1024, False), (0, True),
                                       (8, True), (1024, True)])
def test_pack_signs_matches_reference(xp, n, kind, chunk, two):
    x = make(n, kind)
    r0 = (0.1 * np.random.default_rng(1).standard_normal(n)).astype(np.float32)
    r_fast, r_ref = xp.asarray(r0.copy()), r0.copy()
    bits, scales = K.pack_signs(xp.asarray(x), r_fast, chunk, two)
    rbits, rscales = R.pack_signs(x, r_ref, chunk, two)
    same_bits(bits, rbits)
    np.testing.assert_allclose(host(scales), rscales, rtol=1e-6)
    finite = rscales[np.isfinite(rscales)]
    atol = 1e-6 * float(np.abs(finite).max(initial=0))
    np.testing.assert_allclose(host(r_fast), r_ref, rtol=1e-6, atol=atol)
    out = K.unpack_signs(bits, scales, n, chunk, two)
    # -NaN scale: some NaN (negating a NaN need not flip its sign on the GPU)
    same_bits(out, R.unpack_signs(host(bits), host(scales), n, chunk, two), some_nan=True)
    # without a residual: the same signs of x itself
    bits2, scales2 = K.pack_signs(xp.asarray(x), None, chunk, two)
    same_bits(bits2, R.pack_signs(x, None, chunk, two)[0])
    np.testing.assert_allclose(host(scales2), R.pack_signs(x, None, chunk, two)[1], rtol=1e-6)


def test_pack_signs_nonfinite_and_zero_rules():
    x = np.ones(64, np.float32)
    x[3] = np.nan
    bits, scales = K.pack_signs(x, None, chunk=32)
    assert np.isnan(scales[0]) and scales[1] == 1.0  # NaN poisons only its chunk
    assert np.isnan(K.unpack_signs(bits, scales, 64, 32)[:32]).all()
    x = np.array([3, 1, -1, -1, -1, -1, 2, 0], np.float32)  # two scales keep the sum
    bits, scales = K.pack_signs(x, None, two_scales=True)
    assert scales.tolist() == [1.5, 1.0]
    assert K.unpack_signs(bits, scales, 8, two_scales=True).sum() == x.sum()
    r = np.zeros(16, np.float32)
    bits, scales = K.pack_signs(np.zeros(16, np.float32), r)
    assert bits.size == 2 and scales.tolist() == [0.0] and not r.any()
    bits, scales = K.pack_signs(np.zeros(0, np.float32))
    assert bits.size == 0 and scales.tolist() == [0.0]  # still one scale: well-formed


def test_sign_bit_of_nan_is_zero():
    """The packed sign of every NaN (either sign) and of -0.0 is 0, of -inf 1 (contract);
    a chunk's scales follow the table in mpidl.kernels."""
    x = np.array([np.nan, NEG_NAN, -0.0, -np.inf, np.inf, -1.0, 2.0, 0.0], np.float32)
    for fn in (K.pack_signs, R.pack_signs):
        bits, _ = fn(x.copy(), None, 0, False)
        assert np.unpackbits(bits, bitorder="little").tolist() == [0, 0, 0, 1, 0, 1, 0, 0]
    idx, signs = K.threshold_select(x, 0.5)
    assert idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert np.unpackbits(signs, count=6, bitorder="little").tolist() == [0, 0, 1, 0, 1, 0]
    # two scales: -inf alone leaves pos finite and makes neg +inf; +inf makes neg NaN
    _, sc = K.pack_signs(np.array([1, -1, -np.inf, 3], np.float32), None, 0, True)
    assert sc[0] == 2.0 and sc[1] == np.inf
    _, sc = K.pack_signs(np.array([1, -1, np.inf, 3], np.float32), None, 0, True)
    assert sc[0] == np.inf and np.isnan(sc[1])
    _, sc = K.pack_signs(np.array([1, np.inf, 3, 5], np.float32), None, 0, True)
    assert sc[0] == np.inf and sc[1] == 0.0  # no v < 0: neg is 0


def test_pack_signs_error_feedback_is_exact():
    """Over many steps: sum of decoded + final residual == sum of gradients (float32 ops)."""
    rng = np.random.default_rng(7)
    n, steps = 1003, 200
    r = np.zeros(n, np.float32)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    vmax = 0.0
    for _ in range(steps):
        g = rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 3)
        vmax = max(vmax, float(np.abs(g + r).max()))
        two = bool(rng.integers(2))
        bits, scales = K.pack_signs(g, r, 64, two)
        sent += K.unpack_signs(bits, scales, n, 64, two)
        total += g
    # each step rounds v = g + r and r = v - d once each: at most 2 ulp of |v| per step
    tol = steps * 2 * np.finfo(np.float32).eps * vmax
    np.testing.assert_allclose(sent + r, total, rtol=0, atol=tol)


def test_pack_signs_argument_errors():
    x = np.ones(16, np.float32)
    with pytest.raises(TypeError, match="float32"):
        K.pack_signs(x.astype(np.float64))
    with pytest.raises(TypeError, match="contiguous"):
        K.pack_signs(np.ones(32, np.float32)[::2])
    with pytest.raises(ValueError, match="multiple of 8"):
        K.pack_signs(x, chunk=12)
    with pytest.raises(ValueError, match="residual"):
        K.pack_signs(x, np.zeros(15, np.float32))
    with pytest.raises(PayloadError, match="bytes of signs"):
        K.unpack_signs(np.zeros(1, np.uint8), np.ones(1, np.float32), 16)
    with pytest.raises(PayloadError, match="scales"):
        K.unpack_signs(np.zeros(2, np.uint8), np.ones(3, np.float32), 16, chunk=8)


# ---------------------------------------------------------------- selection
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_threshold_select_matches_reference(xp, n, kind):
    x = make(n, kind)
    r0 = (0.5 * np.random.default_rng(2).standard_normal(n)).astype(np.float32)
    for tau in (0.0, 1.5):
        r_fast, r_ref = xp.asarray(r0.copy()), r0.copy()
        idx, signs = K.threshold_select(xp.asarray(x), tau, r_fast)
        ridx, rsigns = R.threshold_select(x, np.float32(tau), r_ref)
        same_bits(idx, ridx)
        same_bits(signs, rsigns)
        same_bits(r_fast, r_ref, some_nan=True)
        idx2, signs2 = K.threshold_select(xp.asarray(x), tau)
        same_bits(idx2, R.threshold_select(x, np.float32(tau))[0])


def test_threshold_rules():
    x = np.array([0.0, -3.0, np.nan, 0.5, np.inf], np.float32)
    r = np.zeros(5, np.float32)
    idx, signs = K.threshold_select(x, 1.0, r)
    assert idx.tolist() == [1, 2, 4]  # NaN counts as the largest magnitude
    assert np.unpackbits(signs, count=3, bitorder="little").tolist() == [1, 0, 0]
    assert r[1] == -2.0 and np.isnan(r[2]) and r[3] == 0.5
    idx, signs = K.threshold_select(np.zeros(10, np.float32), 0.0)
    assert idx.size == 0 and signs.size == 0
    with pytest.raises(ValueError, match="tau"):
        K.threshold_select(x, -1.0)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_topk_matches_reference(xp, n, kind):
    x = make(n, kind)
    for k in sorted({0, min(1, n), n // 1000, n // 10, max(0, n - 1), n}):
        same_bits(K.topk_exact(xp.asarray(x), k), R.topk_exact(x, k))
        sample = R.sample_indices(n, K.sample_size(n, k), 11)
        same_bits(K.sample_indices(n, sample.size, 11, like=xp.zeros(1)), sample)
        got = K.topk_sampled(xp.asarray(x), k, sample=xp.asarray(sample))
        same_bits(got, R.topk_sampled(x, k, sample))
        assert got.size <= k


def test_topk_rules():
    x = np.array([1.0, -2.0, 2.0, np.nan, 0.5, -2.0], np.float32)
    assert K.topk_exact(x, 1).tolist() == [3]  # NaN first
    assert K.topk_exact(x, 3).tolist() == [1, 2, 3]  # ties to the lower index
    assert K.topk_sampled(np.zeros(5000, np.float32), 10).size == 0  # zeros: nothing
    x = make(1 << 20, "normal")
    k = 1000
    got = K.topk_sampled(x, k, seed=3)
    exact = set(K.topk_exact(x, k).tolist())
    assert 0.7 * k <= got.size <= k and set(got.tolist()) <= exact


def test_random_indices_match_reference(xp):
    like = xp.zeros(1)
    for n, k in [(0, 0), (1, 1), (10, 3), (1000, 1000), (100003, 101)]:
        idx = K.randomk_indices(n, k, 42, like=like)
        same_bits(idx, R.randomk_indices(n, k, np.uint64(42)))
        h = host(idx)
        assert np.all(np.diff(h) > 0) and (h.size == 0 or (h[0] >= 0 and h[-1] < n))
    u = K.hash_uniform(5, 100000, like=like)
    same_bits(u, R.hash_uniform(np.uint64(5), 100000))
    hu = host(u)
    assert 0 <= hu.min() and hu.max() < 1 and abs(hu.mean() - 0.5) < 0.01
    with pytest.raises(ValueError, match="k"):
        K.randomk_indices(10, 11, 0)


# ---------------------------------------------------------------- quantization
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [0, 8, 1024])
def test_norms_match_reference(xp, n, kind, chunk):
    x = make(n, kind)
    l2 = K.chunk_norms(xp.asarray(x), chunk)
    np.testing.assert_allclose(host(l2), R.chunk_norms(x, chunk, "l2"), rtol=1e-6)
    same_bits(K.chunk_norms(xp.asarray(x), chunk, "max"), R.chunk_norms(x, chunk, "max"),
              some_nan=True)
    if chunk == 0:
        np.testing.assert_allclose(K.l2norm(xp.asarray(x)), R.l2norm(x), rtol=1e-6)
        same_bits(np.float32(K.maxabs(xp.asarray(x))), R.maxabs(x), some_nan=True)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("levels,chunk", [(1, 0), (2, 8), (4, 0), (7, 512), (127, 0),
                                          (1, 1024)])
def test_quantize_matches_reference(xp, n, kind, levels, chunk):
    x = make(n, kind)
    scales = R.chunk_norms(x, chunk, "l2" if levels > 1 else "max")
    packed = K.quantize(xp.asarray(x), xp.asarray(scales), levels, 9, chunk)
    same_bits(packed, R.quantize(x, scales, levels, np.uint64(9), chunk))
    out = K.dequantize(packed, xp.asarray(scales), levels, n, chunk)
    same_bits(out, R.dequantize(host(packed), scales, levels, n, chunk), some_nan=True)
    if kind == "nonfinite" and n and chunk == 0:
        assert np.isnan(host(out)).all()  # a NaN scale reaches every value
    if kind == "zeros":
        assert not host(out).any()


def test_quantize_is_unbiased():
    """400 copies of one gradient, one scale per copy (chunks of 4096): each copy gets
    its own dither, so their mean estimates the expectation."""
    x = make(4096, "normal")
    scale = R.l2norm(x)
    reps = np.tile(x, 400)
    out = K.dequantize(K.quantize(reps, np.full(400, scale), 4, 7, 4096), np.full(400, scale),
                       4, reps.size, 4096).reshape(400, 4096)
    step = scale / 4
    assert np.abs(out.mean(axis=0) - x).max() < 0.2 * step  # std of the mean <= step / 40


def test_quantize_payload_errors():
    with pytest.raises(PayloadError, match="need"):
        K.dequantize(np.zeros(3, np.uint8), 1.0, 1, 16)
    with pytest.raises(PayloadError, match="codes above"):
        K.dequantize(np.full(4, 0xFF, np.uint8), 1.0, 1, 16)  # code 3 > 2 for TernGrad
    with pytest.raises(ValueError, match="levels"):
        K.quantize(np.ones(4, np.float32), 1.0, 128, 0)
    with pytest.raises(PayloadError, match="scales"):
        K.dequantize(np.zeros(8, np.uint8), np.ones(3, np.float32), 1, 32, chunk=8)


@pytest.mark.parametrize("width", range(1, 9))
def test_pack_bits_matches_reference(xp, width):
    rng = np.random.default_rng(width)
    for n in (0, 1, 7, 9, 70001):
        codes = rng.integers(0, 1 << width, n).astype(np.uint8)
        packed = K.pack_bits(xp.asarray(codes), width)
        same_bits(packed, R.pack_bits(codes, width))
        same_bits(K.unpack_bits(packed, width, n), codes)


# ---------------------------------------------------------------- fp16
def test_fp16_matches_numpy(xp):
    """Bitwise with NumPy except NaN payloads (NumPy's and F16C's differ: some NaN), but a
    NaN keeps its sign; the Numba and CUDA kernels give the same bits, payloads included."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x477FE000, 0x477FF000,
                        0x477FEFFF, 0x33000000, 0x33000001, 0x387FC000, 0x38800000,
                        0x7FC00000, 0x7F800001, 0x00000001, 0xFFC00001, 0xFF800001],
                       np.uint32)
    x = np.concatenate([bits, special, (rng.standard_normal(1000) * 1e-5).astype(
        np.float32).view(np.uint32)]).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    for offset in (0, 1):  # 1: a view that is not 16-byte aligned (the scalar path)
        got = K.to_fp16(xp.asarray(x)[offset:])
        same_bits(got, want[offset:], some_nan=True)
        nan = np.isnan(want[offset:])
        assert np.array_equal(np.signbit(host(got)[nan]), np.signbit(want[offset:][nan]))
        same_bits(got, K.to_fp16(x[offset:]))  # the Numba kernel's bits, NaN included
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    want = halves.astype(np.float32)
    for offset in (0, 3):
        back = K.from_fp16(xp.asarray(halves)[offset:])
        same_bits(back, want[offset:], some_nan=True)
        nan = np.isnan(want[offset:])
        assert np.array_equal(np.signbit(host(back)[nan]), np.signbit(want[offset:][nan]))
        same_bits(back, K.from_fp16(halves[offset:]))
    for n in (0, 1, 9):
        same_bits(K.to_fp16(xp.asarray(make(n, "normal"))), make(n, "normal").astype(np.float16))


# ---------------------------------------------------------------- sparse payloads
def _sparse_case(n, k, seed, clustered=False):
    rng = np.random.default_rng(seed)
    if clustered and k:  # small gaps: fixed width wins
        start = rng.integers(0, max(1, n - 2 * k))
        idx = np.sort(rng.choice(np.arange(start, min(n, start + 2 * k)), k, replace=False))
    else:
        idx = np.sort(rng.choice(n, k, replace=False)) if k else np.zeros(0, np.int64)
    return idx.astype(np.int64), rng.standard_normal(k).astype(np.float32)


# (n, k, clustered); a huge tensor once (its indices are not clustered)
SPARSE_CASES = [(n, k, c) for n, k in [(0, 0), (1, 0), (1, 1), (10, 10), (1000, 7),
                                       (1000, 999), (100003, 100), (70001, 3000)]
                for c in (False, True)] + [(1 << 40, 50, False)]


@pytest.mark.parametrize("n,k,clustered", SPARSE_CASES)
@pytest.mark.parametrize("kind", ["float32", "float16", "signs"])
def test_sparse_payload_matches_reference(xp, n, k, kind, clustered):
    if n > 1 << 30:
        rng = np.random.default_rng(0)
        idx = np.unique(rng.integers(0, n, k)).astype(np.int64)
        vals = rng.standard_normal(idx.size).astype(np.float32)
    else:
        idx, vals = _sparse_case(n, k, n + k, clustered)
    scale = 0.0
    if kind == "signs":
        vals = np.packbits(vals < 0, bitorder="little")
        scale = 0.25
    blob = K.encode_sparse(xp.asarray(idx), xp.asarray(vals), n, kind, scale)
    ref = R.encode_sparse(idx, vals, n, kind, scale)
    same_bits(blob, ref)
    gi, gv, gn = K.decode_sparse(blob, n)
    ri, rv, rn = R.decode_sparse(ref, n)
    same_bits(gi, ri)
    same_bits(gv, rv)
    assert gn == rn == n
    assert np.array_equal(host(gi), idx)
    # the smaller of the two encodings was chosen
    gaps = np.diff(idx, prepend=-1) - 1
    lengths = np.array([int(g).bit_length() for g in gaps], np.int64)
    fixed = (k * int(lengths.max(initial=0)) + 7) // 8
    varint = int(np.maximum(1, -(-lengths // 7)).sum())
    assert int.from_bytes(host(blob)[24:32].tobytes(), "little") == min(fixed, varint)


def test_sparse_encode_errors():
    with pytest.raises(ValueError, match="strictly increasing"):
        K.encode_sparse(np.array([3, 3], np.int64), np.ones(2, np.float32), 10)
    with pytest.raises(ValueError, match="strictly increasing"):
        K.encode_sparse(np.array([10], np.int64), np.ones(1, np.float32), 10)
    with pytest.raises(ValueError, match="values"):
        K.encode_sparse(np.array([1], np.int64), np.ones(2, np.float32), 10)
    with pytest.raises(ValueError, match="kind"):
        K.encode_sparse(np.array([1], np.int64), np.ones(1, np.float32), 10, "int8")


def _header(blob, field, value):
    b = blob.copy()
    off = {"n": 8, "k": 16, "L": 24}[field]
    b[off:off + 8] = np.array([value], "<u8").view(np.uint8)
    return b


def test_sparse_decode_errors():
    idx = np.array([2, 5, 9, 300], np.int64)
    blob = K.encode_sparse(idx, np.ones(4, np.float32), 1000)
    cases = {
        "truncated": blob[:-1],
        "header alone needs": blob[:10],
        "expected 999": None,
        "bad magic": np.concatenate([[0], blob[1:]]).astype(np.uint8),
        "reserved": np.concatenate([blob[:6], [1], blob[7:]]).astype(np.uint8),
        "claims": _header(blob, "k", 2000),
        "1-D uint8": blob.astype(np.int16),
        "implies": np.concatenate([blob, np.zeros(4, np.uint8)]),
    }
    for message, bad in cases.items():
        with pytest.raises(PayloadError, match=message):
            K.decode_sparse(blob if bad is None else bad, 999 if bad is None else 1000)
    # an index past the end: a tensor of 200 cannot hold index 300
    with pytest.raises(PayloadError, match="out of range"):
        K.decode_sparse(_header(blob, "n", 200), 200)
    # a varint stream whose last gap never ends (continuation bit on the last byte)
    v = R.encode_sparse(np.array([0, 1, 2, 3, 4, 9000], np.int64), np.ones(6, np.float32),
                        10000)
    assert v[3] == 0  # varint
    v[32 + int(v[24]) - 1] |= 0x80
    with pytest.raises(PayloadError, match="truncated"):
        K.decode_sparse(v, 10000)


def _decode_both(blob, n):
    """(fast outcome, reference outcome): the indices and values, or the error type."""
    out = []
    for decode in (K.decode_sparse, R.decode_sparse):
        try:
            i, v, _ = decode(blob, n)
            out.append((i.tolist(), v.view(np.uint32).tolist()))
        except PayloadError:
            out.append("error")
    return out


def test_sparse_decoder_fuzz():
    """4000 random corruptions: a clear PayloadError or a valid decode, never a crash, and
    always the same outcome as the reference decoder."""
    rng = np.random.default_rng(12345)
    bases = []
    for n, k, kind, clustered in [(5000, 40, "float32", False), (5000, 40, "float16", True),
                                  (300, 60, "signs", False), (1 << 33, 20, "float32", False),
                                  (64, 0, "float32", False)]:
        if n > 1 << 30:
            idx = np.unique(rng.integers(0, n, k)).astype(np.int64)
        else:
            idx, _ = _sparse_case(n, k, k, clustered)
        vals = rng.standard_normal(idx.size).astype(np.float32)
        if kind == "signs":
            vals = np.packbits(vals < 0, bitorder="little")
        bases.append((K.encode_sparse(idx, vals, n, kind, 0.5), n))
    errors = 0
    for trial in range(4000):
        blob, n = bases[trial % len(bases)]
        b = blob.copy()
        how = trial % 5
        if how == 0:  # flip a few bytes anywhere
            for p in rng.integers(0, b.size, rng.integers(1, 4)):
                b[p] = rng.integers(0, 256)
        elif how == 1:  # flip bytes in the header's numbers or the index stream
            p = rng.integers(3, min(b.size, 32 + 16))
            b[p] ^= np.uint8(1 << rng.integers(0, 8))
        elif how == 2:  # truncate
            b = b[:rng.integers(0, b.size)]
        elif how == 3:  # extend with junk
            b = np.concatenate([b, rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8)])
        else:  # random bytes behind a valid-looking header
            b = np.concatenate([b[:32], rng.integers(0, 256, b.size - 32, dtype=np.uint8)])
        fast, ref = _decode_both(b, n)
        assert fast == ref, f"trial {trial}: fast and reference decoders disagree"
        if fast == "error":
            errors += 1
        else:
            idx = np.array(fast[0], np.int64)
            assert np.all(np.diff(idx) > 0) and (idx.size == 0 or idx[-1] < n)
    assert errors > 2000  # most corruptions are caught, not silently accepted


def test_scatter_add_matches_reference(xp):
    rng = np.random.default_rng(4)
    out = np.zeros(1000, np.float32)
    idx = np.concatenate([np.sort(rng.choice(1000, 50, replace=False)) for _ in range(4)])
    vals = rng.standard_normal(idx.size).astype(np.float32)
    got = K.scatter_add(xp.asarray(out.copy()), xp.asarray(idx.astype(np.int64)),
                        xp.asarray(vals))
    want = R.scatter_add(out.copy(), idx, vals)
    if xp is np:
        same_bits(got, want)
    else:  # atomics add in any order
        np.testing.assert_allclose(host(got), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(PayloadError, match="outside"):
        K.scatter_add(xp.asarray(out), xp.asarray(np.array([1000], np.int64)),
                      xp.asarray(np.ones(1, np.float32)))

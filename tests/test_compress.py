"""Compressors, memories, payload frames and the exchanger in one process.

Multi-rank exchange is in test_compress_mpi.py (real ranks)."""

import numpy as np
import pytest

from mpidl.compress import (COMPRESSORS, DGCMemory, Exchanger, MomentumMemory,
                            ResidualMemory, make_compressor)
from mpidl.compress import frame
from mpidl.compress.powersgd import orthogonalize
from mpidl.kernels import PayloadError

EF = ["onebit", "threshold", "topk", "dgc", "randomk"]


def grads(steps, shape=(37, 29), seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * rng.uniform(0.05, 2)).astype(np.float32)
            for _ in range(steps)]


# ---------------------------------------------------------------- factory
def test_every_compressor_round_trips_shape_and_dtype():
    for name in COMPRESSORS:
        for dtype in (np.float32, np.float64):
            c = make_compressor(name, memory="none")
            for shape in [(0,), (1,), (13,), (8, 9), (3, 4, 5)]:
                g = np.random.default_rng(1).standard_normal(shape).astype(dtype)
                payload, ctx = c.compress(g, f"t{len(shape)}")
                assert all(type(a) is np.ndarray for a in payload)
                out = c.decompress([a.copy() for a in payload], ctx)
                assert out.shape == g.shape and out.dtype == g.dtype, (name, shape, dtype)
                assert np.isfinite(out).all()


def test_lossless_and_near_lossless():
    g = grads(1)[0]
    c = make_compressor("none")
    assert np.array_equal(c.decompress(*c.compress(g, "w")), g)
    c = make_compressor("fp16")
    np.testing.assert_allclose(c.decompress(*c.compress(g, "w")), g, rtol=1e-3, atol=1e-4)
    c = make_compressor("topk", ratio=1.0, memory="none")
    assert np.array_equal(c.decompress(*c.compress(g, "w")), g)


def test_make_compressor_errors_say_what_is_accepted():
    with pytest.raises(ValueError, match="unknown compressor 'top-k'.*topk"):
        make_compressor("top-k")
    with pytest.raises(TypeError, match="'onebit' has no parameter 'ratio'.*chunk"):
        make_compressor("onebit", ratio=0.1)
    with pytest.raises(TypeError, match="'fp16' has no parameter 'ratio'.*no parameters"):
        make_compressor("fp16", ratio=0.1)
    for name, kw in [("topk", {"ratio": 0}), ("dgc", {"ratio": 1.5}),
                     ("randomk", {"ratio": -1}), ("onebit", {"chunk": 12}),
                     ("qsgd", {"levels": 0}), ("qsgd", {"bucket": 7}),
                     ("threshold", {"threshold": -1}), ("powersgd", {"rank": 0}),
                     ("dgc", {"momentum": 1.0}), ("terngrad", {"clip": -1})]:
        with pytest.raises(ValueError, match=name):
            make_compressor(name, **kw)
    with pytest.raises(ValueError, match="unknown memory"):
        make_compressor("topk", memory="lots")


def test_spec_strings_carry_parameters():
    c = make_compressor("dgc:momentum=0.5,warmup_steps=10,clip=none", ratio=0.01)
    assert (c.momentum, c.warmup_steps, c.clip, c.ratio) == (0.5, 10, None, 0.01)
    assert c.memory.momentum == 0.5
    assert make_compressor("qsgd:memory=residual,levels=15").memory is not None
    assert make_compressor("topk:ratio=0.5", ratio=0.25).ratio == 0.25  # keywords win
    with pytest.raises(ValueError, match="key=value"):
        make_compressor("topk:0.5")
    with pytest.raises(TypeError, match="no parameter 'levels'"):
        make_compressor("topk:levels=3")
    c = make_compressor("topk:memory=dgc,momentum=0.9")
    assert isinstance(c.memory, DGCMemory) and c.memory.momentum == 0.9
    with pytest.raises(TypeError, match="momentum needs memory"):
        make_compressor("topk:momentum=0.9")


def test_default_memories():
    assert type(make_compressor("topk").memory) is ResidualMemory
    assert type(make_compressor("onebit").memory) is MomentumMemory
    assert isinstance(make_compressor("dgc").memory, DGCMemory)
    for name in ("none", "fp16", "qsgd", "terngrad", "powersgd", "randomk"):
        assert make_compressor(name).memory is None
    assert make_compressor("qsgd", memory="residual").memory is not None


# ---------------------------------------------------------------- error feedback
@pytest.mark.parametrize("name", EF)
@pytest.mark.parametrize("fused", [True, False])
def test_error_feedback_is_exact(name, fused):
    """Over many steps: everything sent + the residual == the sum of the gradients."""
    kw = {"momentum": 0.0} if name == "dgc" else {}
    c = make_compressor(name, memory="residual", **kw)
    mem = c.memory
    sent = np.zeros((37, 29), np.float64)
    total = np.zeros_like(sent)
    vmax = 0.0
    steps = grads(60)
    for g in steps:
        if fused:
            payload, ctx = mem.compress(c, g, "w")
        else:  # the generic path the parameter server takes
            t = mem.compensate(g, "w")
            payload, ctx = c.compress(t, "w")
            mem.update(t, "w", c, payload, ctx)
        vmax = max(vmax, float(np.abs(mem.residuals["w"]).max()), float(np.abs(g).max()))
        sent += c.decompress(payload, ctx)
        total += g
    residual = mem.residuals["w"].reshape(total.shape)
    # float32 rounding of v = g + r and r = v - sent, a few ulp of |v| per step
    tol = len(steps) * 4 * np.finfo(np.float32).eps * vmax
    np.testing.assert_allclose(sent + residual, total, rtol=0, atol=tol)
    assert np.abs(sent).sum() > 0


def test_dgc_momentum_correction_and_masking():
    m, ratio = 0.9, 0.05
    c = make_compressor("dgc", ratio=ratio, momentum=m)
    u = np.zeros(37 * 29, np.float32)
    v = np.zeros_like(u)
    for g in grads(20):
        payload, ctx = c.memory.compress(c, g, "w")
        u = u * np.float32(m) + g.reshape(-1)
        v = v + u
        sent = c.decompress(payload, ctx).reshape(-1)
        nz = sent != 0
        assert nz.sum() <= round(ratio * u.size)
        np.testing.assert_array_equal(sent[nz], v[nz])  # the accumulated velocity is sent
        v[nz] = 0
        u[nz] = 0  # momentum factor masking
        np.testing.assert_array_equal(c.memory.residuals["w"], v)
        np.testing.assert_array_equal(c.memory.mom["w"], u)


def test_dgc_warmup_clip_and_zero_gradients():
    c = make_compressor("dgc", ratio=0.001, warmup_steps=4)
    d = [c.density(s) for s in range(6)]
    assert d[0] == 0.25 and all(a > b for a, b in zip(d, d[1:5])) and d[4] == d[5] == 0.001
    g = np.zeros((100, 100), np.float32)
    for _ in range(3):  # nothing to send is still a well-formed payload
        payload, ctx = c.memory.compress(c, g, "z")
        assert payload[0].size >= 32 and not c.decompress(payload, ctx).any()
    c = make_compressor("dgc", ratio=0.5, momentum=0.0, clip=1.0)
    big = np.full((10,), 100.0, np.float32)
    payload, ctx = c.memory.compress(c, big, "b")
    assert np.linalg.norm(c.decompress(payload, ctx)) <= 1.0 + 1e-5


class FakeSGD:
    def __init__(self, momentum, nesterov=False):
        self.momentum, self.nesterov = momentum, nesterov


@pytest.mark.parametrize("fused", [True, False])
def test_momentum_correction_is_error_feedback_on_momentum(fused):
    """sent + residual == the sum of the momentum sequence u_t = m u_(t-1) + g_t."""
    c = make_compressor("onebit")
    opt = FakeSGD(0.9, nesterov=True)
    assert c.memory.adopt_momentum(opt) == 0.9
    assert (opt.momentum, opt.nesterov, c.memory.momentum) == (0.0, False, 0.9)
    mem = c.memory
    u = np.zeros((37, 29), np.float64)
    sent, total = np.zeros_like(u), np.zeros_like(u)
    for g in grads(50):
        if fused:
            payload, ctx = mem.compress(c, g, "w")
        else:
            t = mem.compensate(g, "w")
            payload, ctx = c.compress(t, "w")
            mem.update(t, "w", c, payload, ctx)
        u = 0.9 * u + g
        total += u
        sent += c.decompress(payload, ctx)
    np.testing.assert_allclose(sent + mem.residuals["w"].reshape(u.shape), total, atol=2e-3)
    # momentum already set (dgc:momentum=0.5) still turns the optimizer's off
    c = make_compressor("dgc", momentum=0.5)
    opt = FakeSGD(0.9)
    assert c.memory.adopt_momentum(opt) == 0.5 and opt.momentum == 0.0
    # plain error feedback leaves the optimizer alone; None until handed over = plain EF
    opt = FakeSGD(0.9)
    assert make_compressor("topk").memory.adopt_momentum(opt) == 0.0 and opt.momentum == 0.9
    m = MomentumMemory()
    g = grads(1)[0]
    assert np.array_equal(m.compensate(g, "w"), g)


def test_topk_and_threshold_send_what_they_promise():
    g = grads(1, (1000,))[0]
    c = make_compressor("topk", ratio=0.01, memory="none")
    out = c.decompress(*c.compress(g, "w"))
    nz = np.flatnonzero(out)
    assert nz.size == 10 and set(nz) == set(np.argsort(-np.abs(g))[:10])
    c = make_compressor("threshold", threshold=1.0, memory="none")
    out = c.decompress(*c.compress(g, "w"))
    assert set(np.flatnonzero(out)) == set(np.flatnonzero(np.abs(g) > 1.0))
    assert set(np.abs(out[out != 0])) == {1.0}


def test_randomk_indices_agree_between_instances():
    a, b = make_compressor("randomk", ratio=0.1), make_compressor("randomk", ratio=0.1)
    g = grads(1)[0]
    for _ in range(3):  # the same indices step after step, different ones across steps
        pa, ca = a.compress(g, "w")
        pb, cb = b.compress(g * 2, "w")
        assert ca == cb
        np.testing.assert_array_equal(pa[0] * 2, pb[0])
    assert a.compress(g, "w")[1] != a.compress(g, "w")[1]


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_stochastic_quantizers_are_unbiased(name):
    """1000 copies of one 512-entry gradient in one tensor: every copy is quantized with
    its own dither (and, per bucket of 512, the same scale), so the copies' mean estimates
    the expectation."""
    kw = {"clip": 0.0} if name == "terngrad" else {}
    c = make_compressor(name, **kw)
    g = grads(1, (512,))[0]
    out = c.decompress(*c.compress(np.tile(g, 1000), "w")).reshape(1000, 512)
    step = np.abs(g).max() if name == "terngrad" else np.linalg.norm(g) / 7
    # per entry: variance <= step^2 / 4, so the mean of 1000 has std <= step / 63
    assert np.abs(out.mean(axis=0) - g).max() < step / 63 * 5


def test_terngrad_clips_outliers():
    g = np.zeros(1000, np.float32)
    g[:500] = 0.01
    g[0] = 100.0
    c = make_compressor("terngrad")  # clip 2.5 sigma: the outlier no longer sets the scale
    payload, _ = c.compress(g, "w")
    assert payload[0][0] < 100.0


def test_powersgd_low_rank_and_whole_tensors():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((40, 2)), rng.standard_normal((30, 2))
    m = (a @ b.T).astype(np.float32)  # exactly rank 2
    c = make_compressor("powersgd", rank=2)
    for _ in range(3):  # power iteration with warm start converges on a rank-2 matrix
        out = c.decompress(*c.compress(m, "w"))
    np.testing.assert_allclose(out, m, atol=1e-3 * np.abs(m).max())
    v = rng.standard_normal(17).astype(np.float32)
    payload, ctx = c.compress(v, "b")
    assert len(payload) == 1 and np.array_equal(c.decompress(payload, ctx), v)
    p = orthogonalize(rng.standard_normal((50, 3)).astype(np.float32))
    np.testing.assert_allclose(p.T @ p, np.eye(3), atol=1e-5)


def test_powersgd_error_feedback_is_exact():
    c = make_compressor("powersgd", rank=1)
    sent = np.zeros((37, 29))
    total = np.zeros_like(sent)
    for g in grads(30):
        sent += c.decompress(*c.compress(g, "w"))
        total += g
    np.testing.assert_allclose(sent + c._err["w"], total, atol=1e-3)


# ---------------------------------------------------------------- payload checks
def test_decompress_rejects_malformed_payloads():
    g = grads(1)[0]
    for name in COMPRESSORS:
        c = make_compressor(name, memory="none")
        payload, ctx = c.compress(g, "w")
        bad = [payload[:-1], payload + [np.zeros(1, np.uint8)],
               [np.zeros(3, a.dtype) for a in payload],
               [a.astype(np.float64) for a in payload]]
        for p in bad:
            with pytest.raises(PayloadError):
                c.decompress(p, ctx)


def test_frame_round_trip_and_fuzz():
    arrays = [np.arange(5, dtype=np.uint8), np.zeros(0, np.float32),
              np.linspace(0, 1, 7).astype(np.float64), np.array([-3], np.int64),
              np.ones(3, np.float16)]
    buf = frame.pack(arrays)
    assert buf.size % 8 == 0
    back = frame.unpack(buf)
    assert len(back) == len(arrays)
    for a, b in zip(arrays, back):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert frame.unpack(frame.pack([], like=buf)) == []
    rng = np.random.default_rng(0)
    caught = 0
    for trial in range(2000):
        b = buf.copy()
        if trial % 3 == 0:
            b = b[:rng.integers(0, b.size)]
        elif trial % 3 == 1:
            b[rng.integers(0, 8 + 16 * 5)] = rng.integers(0, 256)
        else:
            b = np.concatenate([b, rng.integers(0, 256, 8, dtype=np.uint8)])
        try:
            parts = frame.unpack(b)
            assert sum(p.nbytes for p in parts) <= b.size
        except PayloadError:
            caught += 1
    assert caught > 1000
    with pytest.raises(TypeError, match="complex"):
        frame.pack([np.zeros(2, np.complex64)])


# ---------------------------------------------------------------- exchanger, one rank
@pytest.fixture
def comm(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "tuning.json"))
    from mpidl.comm import Communicator

    c = Communicator()
    yield c
    c.close()


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_exchanger_one_rank(comm, name):
    c = make_compressor(name)
    ex = Exchanger(comm, c)
    ref = make_compressor(name)
    named = [("a", grads(1, (20, 10), 1)[0]), ("b", grads(1, (7,), 2)[0]),
             ("z", np.zeros((4, 4), np.float32))]
    for step in range(3):
        outs = ex.exchange_all(named) if step == 1 else [ex.exchange(g, n) for n, g in named]
        for (n, g), out in zip(named, outs):
            assert out.shape == g.shape and out.dtype == g.dtype
            # one rank: the mean is its own decompressed payload
            if ref.memory is not None:
                payload, ctx = ref.memory.compress(ref, g, n)
            elif hasattr(ref, "reduce"):
                want = ref.reduce(g, n, lambda a, _n: a)
                np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
                continue
            else:
                payload, ctx = ref.compress(g, n)
            np.testing.assert_allclose(out, ref.decompress(payload, ctx), rtol=1e-6,
                                       atol=1e-7)
    stats = ex.stats()
    assert stats["calls"] == 9 and stats["bytes_sent"] == 0  # one rank sends nothing
    assert stats["payload_bytes"] > 0 and stats["dense_bytes"] == 3 * 4 * (200 + 7 + 16)
    opt = FakeSGD(0.9)
    assert ex.adopt_momentum(opt) == (0.9 if name in ("onebit", "dgc") else 0.0)
    state = ex.state_dict()
    ex2 = Exchanger(comm, make_compressor(name))
    ex2.load_state_dict(state)
    assert ex2.state_dict().keys() == state.keys()

"""Compressed exchange on real ranks: every compressor, against an independent check.

For each compressor, every rank exchanges a few tensors for a few steps (including an
all-zero one, so "nothing to send" is exercised). Each rank also runs a twin compressor
on the same gradients and all-gathers its payloads with plain mpi4py (pickled objects):
the exchanged mean must equal the mean of the decompressed twin payloads, bit for bit for
the all-gather compressors (same order of additions), within rounding for the summable
ones; and every rank must hold the same bits. Then: bytes counters, a malformed payload
from one rank (every rank raises PayloadError naming it), PowerSGD's two-round protocol,
and the blocking exchange (collectives on the caller's thread) giving the pipelined one's
bits. Rank 0 prints "COMPRESS OK".
"""

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.compress import COMPRESSORS, Exchanger, make_compressor
from mpidl.kernels import PayloadError

W = MPI.COMM_WORLD
RANK, P = W.Get_rank(), W.Get_size()
SHAPES = {"w1": (64, 30), "b1": (30,), "w2": (30, 5), "zero": (6, 6)}


def gradient(name, step):
    if name == "zero":
        return np.zeros(SHAPES[name], np.float32)
    rng = np.random.default_rng([RANK, step, len(name), SHAPES[name][0]])
    return rng.standard_normal(SHAPES[name]).astype(np.float32)


def twin_payload(c, g, name):
    if c.memory is not None:
        return c.memory.compress(c, g, name)
    return c.compress(g, name)


def same_on_all_ranks(a, what):
    everyone = W.allgather(np.ascontiguousarray(a).tobytes())
    assert all(b == everyone[0] for b in everyone), f"{what}: ranks hold different results"


def check_compressor(comm, name):
    ex = Exchanger(comm, make_compressor(name))
    twin = make_compressor(name)
    twin.bind(RANK, P)
    for step in range(3):
        named = [(n, gradient(n, step)) for n in SHAPES]
        outs = ex.exchange_all(named) if step == 2 else [ex.exchange(g, n) for n, g in named]
        for (n, g), out in zip(named, outs):
            what = f"{name} step {step} tensor {n}"
            assert out.shape == g.shape and out.dtype == g.dtype, what
            same_on_all_ranks(out, what)
            if hasattr(twin, "reduce"):
                continue  # checked in check_powersgd
            payload, ctx = twin_payload(twin, g, n)
            everyone = W.allgather([np.asarray(a) for a in payload])
            want = np.zeros(ctx.n, np.float32)
            for parts in everyone:
                want += np.asarray(twin.decompress(parts, ctx), np.float32).reshape(-1)
            want /= np.float32(P)
            if twin.summable:
                np.testing.assert_allclose(out.reshape(-1), want, rtol=1e-3, atol=1e-3,
                                           err_msg=what)
            else:
                assert np.array_equal(out.reshape(-1), want), what
            if n == "zero":
                assert not out.any(), what
    return ex.stats()


def check_blocking(names):
    """``blocking=True`` (no spare core for a progress thread): every compressor gives
    the bits the pipelined exchange gives, and no progress thread is ever started."""
    blocking, pipelined = Communicator(), Communicator()
    for name in names:
        exchangers = [Exchanger(c, make_compressor(name), blocking=b)
                      for c, b in ((blocking, True), (pipelined, False))]
        for step in range(2):
            named = [(n, gradient(n, step)) for n in SHAPES]
            outs = [ex.exchange_all(named) for ex in exchangers]
            for (n, _), a, b in zip(named, *outs):
                assert np.array_equal(a, b), f"{name} step {step} tensor {n}: blocking differs"
    assert blocking._progress is None and pipelined._progress is not None
    blocking.close()
    pipelined.close()


def check_malformed(comm):
    ex = Exchanger(comm, make_compressor("topk", ratio=0.1))
    if RANK == P - 1:  # this rank's compressor sends garbage instead of a sparse payload
        ex.compressor.compress_ef = lambda t, r, name: ([np.arange(40, dtype=np.uint8)],
                                                        ex.compressor._payload(
                                                            np.zeros(0, np.int64),
                                                            np.zeros(1, np.float32), t)[1])
    try:
        ex.exchange(gradient("w1", 0), "w1")
    except PayloadError as e:
        assert f"rank {P - 1}'s payload" in str(e) and "'w1'" in str(e), str(e)
    else:
        raise AssertionError("a malformed payload was accepted")


def check_powersgd(comm):
    ex = Exchanger(comm, make_compressor("powersgd", rank=2))
    rng = np.random.default_rng(5)  # the same low-rank gradient on every rank ...
    a, b = rng.standard_normal((64, 2)), rng.standard_normal((30, 2))
    m = (a @ b.T).astype(np.float32)
    for _ in range(3):
        out = ex.exchange(m * (RANK + 1), "w1")  # ... scaled by rank + 1
    same_on_all_ranks(out, "powersgd")
    mean_scale = (P + 1) / 2
    np.testing.assert_allclose(out, m * mean_scale, atol=1e-3 * np.abs(m).max() * P)
    v = ex.exchange(np.full(7, RANK, np.float32), "bias")  # a vector: sent whole
    np.testing.assert_allclose(v, np.full(7, (P - 1) / 2), rtol=1e-6)
    # bytes: two all-reduces of (64 + 30) * 2 floats per step, not 64 * 30
    assert ex.payload_bytes == 3 * (64 + 30) * 2 * 4 + 7 * 4, ex.payload_bytes


def main():
    comm = Communicator()
    stats = {name: check_compressor(comm, name) for name in COMPRESSORS}
    dense = stats["none"]["bytes_sent"]
    assert dense > 0
    for name in ("topk", "dgc", "threshold", "onebit", "qsgd", "terngrad", "fp16"):
        assert stats[name]["bytes_sent"] < dense, (name, stats[name], dense)
    assert stats["fp16"]["bytes_sent"] < 0.6 * dense  # half, plus frame headers
    check_malformed(comm)
    check_powersgd(comm)
    check_blocking(COMPRESSORS)
    comm.close()
    if RANK == 0:
        for name, s in stats.items():
            print(f"{name:10s} bytes_sent {s['bytes_sent']:8d}  ratio "
                  f"{s['compression_ratio']:6.1f}")
        print("COMPRESS OK", flush=True)


if __name__ == "__main__":
    main()

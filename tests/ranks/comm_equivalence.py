"""Every algorithm of every mpidl collective against MPI's native result, on real ranks.

Launched once per p by tests/test_comm_collectives.py (``mpiexec -n p python -m mpi4py
comm_equivalence.py --sections ...``); many cases per launch, because a launch costs
seconds on a 2-core machine.

Sections:
  grid         collectives x algorithms x dtypes (float16/32/64, int32/64) x counts
               (0, 1, p-1, not divisible by p, several ring segments), in place and out
               of place, every op, non-contiguous input and output
  large        >= 4M elements, once per algorithm of every collective (float32)
  random       cases drawn with a fixed seed: collective, algorithm, dtype, size, op, root,
               in place, non-contiguous
  nonblocking  i-collectives, several in flight, waited in reverse order
  staged       the pinned-staging transport (used for GPU arrays without CUDA-aware MPI),
               driven with host arrays

Tolerances, stated: integers and max/min must be exact. A float sum of p terms rounds
at most p-1 times in either implementation, so ``|ours - native| <= 2 (p-1) eps S`` per
element, with eps the dtype's machine epsilon and S the sum of |x_i| over ranks (mean:
divided by p, plus one rounding of the result). float16's native reference is the sum
in float64 rounded once to float16 (MPI may lack a float16 datatype: Open MPI 4.1), which
the same bound covers (at most p roundings of half an eps in all). allreduce results must
also be bitwise identical on every rank. Failures are collected and printed by rank 0; exit 1 then.
"""

import argparse
import functools
import sys
import zlib

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator, even_split
from mpidl.comm.communicator import DEFAULT_SEGMENT_BYTES

ALGS = ("ring", "tree", "recursive_doubling", "shared", "mpi", "auto")
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)
W = MPI.COMM_WORLD
P, RANK = W.Get_size(), W.Get_rank()
RAW = W.Dup()  # native reference calls
failures = []
ncases = {"n": 0}
_EPOCH = [0]  # bumped by bind(): cached tolerances and references belong to one group


def bind(raw):
    """Point every helper at another communicator: ``raw`` is the native reference for
    the group under test (tests/ranks/comm_groups.py runs these cases on mesh groups).
    P and RANK become the group's; the caches start afresh."""
    global P, RANK, RAW
    RAW, P, RANK = raw, raw.Get_size(), raw.Get_rank()
    _EPOCH[0] += 1
    _native_cache.clear()


@functools.lru_cache(maxsize=64)
def _data(seed, n, dtype, rank):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return rng.uniform(-1, 1, n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def data(seed, n, dtype, rank=None):
    """Rank ``rank``'s input of a case (default: this rank; cached: large cases reuse it;
    callers copy)."""
    x = _data(seed, n, np.dtype(dtype), RANK if rank is None else rank)
    x.flags.writeable = False
    return x


def tolerance(seed, n, dtype, op):
    """Per-element bound on |ours - native| (0: exact)."""
    return _tolerance(seed, n, dtype, op, _EPOCH[0])


@functools.lru_cache(maxsize=16)
def _tolerance(seed, n, dtype, op, epoch):
    dtype = np.dtype(dtype)
    if dtype.kind != "f" or op in ("max", "min"):
        return 0.0
    eps = float(np.finfo(dtype).eps)
    s = np.abs(data(seed, n, dtype).astype(np.float64))
    if n:
        RAW.Allreduce(MPI.IN_PLACE, s, MPI.SUM)  # S = sum over ranks of |x_i|
    bound = 2 * max(P - 1, 1) * eps * s
    if op == "mean":
        bound = bound / P + eps * s / P
    return bound


_native_cache = {}


def native_allreduce(x, op):
    key = (id(x), x.size, x.dtype, op)
    hit = _native_cache.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    ref = _native(x, op)
    if x.size > 1_000_000:
        _native_cache.clear()
        _native_cache[key] = (x, ref)
    return ref


def _native(x, op):
    """MPI's own reduction of ``x``. float16 reduces in float64 and is rounded once at
    the end: MPI may have no float16 datatype (Open MPI 4.1 has none), and the tolerance
    bounds the distance to that once-rounded sum as well."""
    ref = x.astype(np.float64) if x.dtype == np.float16 else x.copy()
    if x.size:
        RAW.Allreduce(MPI.IN_PLACE, ref, {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX,
                                          "min": MPI.MIN}[op])
    if op == "mean":
        ref = ref / P
    return ref.astype(x.dtype, copy=False)


def compare(label, got, ref, tol):
    ncases["n"] += 1
    got = np.asarray(got)
    if got.shape != ref.shape and got.size == ref.size:
        got = got.reshape(ref.shape)
    if got.shape != ref.shape or got.dtype != ref.dtype:
        failures.append(f"rank {RANK} {label}: got {got.shape} {got.dtype}, "
                        f"expected {ref.shape} {ref.dtype}")
        return
    if np.isscalar(tol) and tol == 0:
        ok = np.array_equal(got, ref)
    else:
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        ok = bool(np.all(diff <= np.reshape(tol, -1) + 1e-300)) if got.size else True
    if not ok:
        bad = np.flatnonzero(~np.isclose(got.astype(np.float64).ravel(),
                                         ref.astype(np.float64).ravel(), rtol=0, atol=0))[:5]
        failures.append(f"rank {RANK} {label}: mismatch at {bad.tolist()}: "
                        f"got {got.ravel()[bad].tolist()} expected {ref.ravel()[bad].tolist()}")


def same_everywhere(label, arr):
    """allreduce results must be bitwise identical on all ranks."""
    crc = zlib.crc32(np.ascontiguousarray(arr).tobytes())
    crcs = RAW.allgather(crc)
    if len(set(crcs)) != 1:
        failures.append(f"rank {RANK} {label}: results differ between ranks (crc {crcs})")


def counts_for(p):
    return sorted({0, 1, max(p - 1, 0), 7 * p + 3, 1237})


# ---------------------------------------------------------------------------- cases
def case_allreduce(comm, seed, n, dtype, op, alg, mode, noncontig=False, check_same=True):
    label = f"allreduce n={n} {np.dtype(dtype).name} op={op} alg={alg} {mode}" + \
        (" noncontig" if noncontig else "")
    x = data(seed, n, dtype)
    ref = native_allreduce(x, op)
    if noncontig:
        base = np.zeros(2 * n, dtype=dtype)
        base[::2] = x
        xin = base[::2]
    else:
        xin = x.copy()
    if mode == "inplace":
        got = comm.allreduce(xin, out=xin, op=op, algorithm=alg, name=label)
        assert got is xin, label
        if noncontig:
            assert np.array_equal(base[1::2], np.zeros(n, dtype)), label + " clobbered gaps"
    elif mode == "out":
        if noncontig:
            obase = np.zeros(3 * n, dtype=dtype)
            out = obase[::3]
        else:
            out = np.empty(n, dtype=dtype)
        got = comm.allreduce(xin, out=out, op=op, algorithm=alg, name=label)
        assert got is out, label
        compare(label + " (input untouched)", xin, x, 0)
    else:
        got = comm.allreduce(xin, op=op, algorithm=alg, name=label)
        compare(label + " (input untouched)", xin, x, 0)
    compare(label, got, ref, tolerance(seed, n, dtype, op))
    if check_same:
        same_everywhere(label, got)


def case_reduce_scatter(comm, seed, n, dtype, op, alg, noncontig=False):
    label = f"reduce_scatter n={n} {np.dtype(dtype).name} op={op} alg={alg}" + \
        (" noncontig" if noncontig else "")
    x = data(seed, n, dtype)
    full = native_allreduce(x, op)
    counts, displs = even_split(n, P)
    ref = full[displs[RANK]:displs[RANK] + counts[RANK]]
    if noncontig:
        base = np.zeros((n, 2), dtype=dtype)
        base[:, 0] = x
        xin = base[:, 0]
    else:
        xin = x.copy()
    got = comm.reduce_scatter(xin, op=op, algorithm=alg, name=label)
    tol = tolerance(seed, n, dtype, op)
    if not np.isscalar(tol):
        tol = tol[displs[RANK]:displs[RANK] + counts[RANK]]
    compare(label, got, ref, tol)
    compare(label + " (input untouched)", xin, x, 0)


def case_reduce(comm, seed, n, dtype, op, alg, root, inplace):
    label = f"reduce n={n} {np.dtype(dtype).name} op={op} alg={alg} root={root}" + \
        (" inplace" if inplace else "")
    x = data(seed, n, dtype)
    ref = native_allreduce(x, op)
    xin = x.copy()
    out = xin if (inplace and RANK == root) else None
    got = comm.reduce(xin, root=root, out=out, op=op, algorithm=alg, name=label)
    tol = tolerance(seed, n, dtype, op)  # collective: every rank computes it
    if RANK == root:
        compare(label, got, ref, tol)
    else:
        if got is not None:
            failures.append(f"rank {RANK} {label}: non-root got {type(got)}, expected None")
        compare(label + " (non-root input untouched)", xin, x, 0)


def case_bcast(comm, seed, n, dtype, alg, root, noncontig=False):
    label = f"bcast n={n} {np.dtype(dtype).name} alg={alg} root={root}" + \
        (" noncontig" if noncontig else "")
    ref = data(seed, n, dtype, rank=root)
    mine = ref.copy() if RANK == root else np.full(n, 3, dtype=dtype)
    if noncontig:
        base = np.zeros(2 * n, dtype=dtype)
        base[1::2] = mine
        buf = base[1::2]
    else:
        buf = mine
    got = comm.bcast(buf, root=root, algorithm=alg, name=label)
    assert got is buf, label
    compare(label, got, ref, 0)


def case_allgather(comm, seed, n, dtype, alg, with_out):
    label = f"allgather n={n} {np.dtype(dtype).name} alg={alg}" + (" out" if with_out else "")
    x = data(seed, n, dtype)
    ref = np.empty(P * n, dtype=dtype)
    RAW.Allgather([x, MPI.BYTE], [ref, MPI.BYTE])  # bytes: any dtype, any MPI
    out = np.empty(P * n, dtype=dtype) if with_out else None
    got = comm.allgather(x, out=out, algorithm=alg, name=label)
    if with_out:
        assert got is out, label
    compare(label, got, ref, 0)


def case_allgatherv(comm, seed, pattern, dtype, alg):
    mine_n = (RANK * 3 + pattern) % 4 if pattern < 4 else (RANK + 1) * pattern
    label = f"allgatherv pattern={pattern} {np.dtype(dtype).name} alg={alg}"
    x = data(seed, mine_n, dtype)
    counts = RAW.allgather(mine_n)
    ref = np.empty(sum(counts), dtype=dtype)
    displs = [sum(counts[:i]) for i in range(P)]
    size = np.dtype(dtype).itemsize  # bytes: any dtype, any MPI
    RAW.Allgatherv([x, MPI.BYTE], [ref, [c * size for c in counts],
                                   [d * size for d in displs], MPI.BYTE])
    got, got_counts = comm.allgatherv(x, algorithm=alg, name=label)
    if list(got_counts) != list(counts):
        failures.append(f"rank {RANK} {label}: counts {got_counts} != {counts}")
    compare(label, got, ref, 0)


# ---------------------------------------------------------------------------- sections
def section_grid(comm):
    comm.segment_bytes = 512  # several ring segments per chunk, uneven segment counts
    seed = 0
    for n in counts_for(P):
        for dtype in DTYPES:
            for alg in ALGS:
                seed += 1
                for mode in ("inplace", "out", "new"):
                    case_allreduce(comm, seed, n, dtype, "sum", alg, mode)
                case_reduce_scatter(comm, seed, n, dtype, "sum", alg)
                case_reduce(comm, seed, n, dtype, "sum", alg, root=P - 1, inplace=True)
                case_reduce(comm, seed, n, dtype, "sum", alg, root=0, inplace=False)
                case_bcast(comm, seed, n, dtype, alg, root=P // 2)
                case_allgather(comm, seed, n, dtype, alg, with_out=(n % 2 == 0))
    for dtype in (np.float32, np.int32, np.float16):
        for op in ("max", "min", "mean"):
            if op == "mean" and np.dtype(dtype).kind != "f":
                continue
            for alg in ALGS:
                seed += 1
                n = 7 * P + 3
                case_allreduce(comm, seed, n, dtype, op, alg, "out")
                case_reduce_scatter(comm, seed, n, dtype, op, alg)
                case_reduce(comm, seed, n, dtype, op, alg, root=P // 2, inplace=False)
    for alg in ALGS:  # non-contiguous inputs and outputs
        seed += 1
        n = 7 * P + 3
        case_allreduce(comm, seed, n, np.float64, "sum", alg, "inplace", noncontig=True)
        case_allreduce(comm, seed, n, np.float32, "sum", alg, "out", noncontig=True)
        case_reduce_scatter(comm, seed, n, np.int64, "sum", alg, noncontig=True)
        case_bcast(comm, seed, n, np.float32, alg, root=0, noncontig=True)
    for pattern in (0, 1, 2, 3, 5):  # zero-length contributions included
        for dtype in DTYPES:
            for alg in ALGS:
                seed += 1
                case_allgatherv(comm, seed, pattern, dtype, alg)
    comm.segment_bytes = DEFAULT_SEGMENT_BYTES


def section_large(comm):
    n = 4 * 1024 * 1024 + 3  # >= 4M elements and not divisible by p (for p > 1)
    for alg in ALGS:
        seed = 10_000  # same inputs for every algorithm: references computed once
        case_allreduce(comm, seed, n, np.float32, "sum", alg, "out")
        case_reduce_scatter(comm, seed, n, np.float32, "sum", alg)
        case_reduce(comm, seed, n, np.float32, "sum", alg, root=0, inplace=False)
        case_bcast(comm, seed, n, np.float32, alg, root=P - 1)
        case_allgather(comm, seed, -(-n // P) + 1, np.float32, alg, with_out=True)


def section_random(comm, seed):
    rng = np.random.default_rng(seed)  # same draws on every rank
    kinds = ("allreduce", "reduce_scatter", "reduce", "bcast", "allgather", "allgatherv")
    for i in range(60):
        kind = kinds[rng.integers(len(kinds))]
        alg = ALGS[rng.integers(len(ALGS))]
        dtype = DTYPES[rng.integers(len(DTYPES))]
        n = int(rng.choice([0, 1, P - 1, int(10 ** rng.uniform(0, 5))]))
        ops = ("sum", "max", "min", "mean") if np.dtype(dtype).kind == "f" else \
            ("sum", "max", "min")
        op = ops[rng.integers(len(ops))]
        root = int(rng.integers(P))
        noncontig = bool(rng.integers(2))
        mode = ("inplace", "out", "new")[rng.integers(3)]
        comm.segment_bytes = int(rng.choice([256, 4096, 256 * 1024]))
        s = 20_000 + i
        if kind == "allreduce":
            case_allreduce(comm, s, n, dtype, op, alg, mode, noncontig)
        elif kind == "reduce_scatter":
            case_reduce_scatter(comm, s, n, dtype, op, alg, noncontig)
        elif kind == "reduce":
            case_reduce(comm, s, n, dtype, op, alg, root, mode == "inplace")
        elif kind == "bcast":
            case_bcast(comm, s, n, dtype, alg, root, noncontig)
        elif kind == "allgather":
            case_allgather(comm, s, n, dtype, alg, mode == "out")
        else:
            case_allgatherv(comm, s, int(rng.integers(6)), dtype, alg)
    comm.segment_bytes = DEFAULT_SEGMENT_BYTES


def section_nonblocking(comm):
    n = 7 * P + 3
    for alg in ALGS:
        xs = [data(30_000 + k, n * (k + 1), np.float64) for k in range(4)]
        refs = [native_allreduce(x, "sum") for x in xs]
        handles = [comm.iallreduce(x, algorithm=alg, name=f"nb{k}") for k, x in enumerate(xs)]
        vx = data(30_100, RANK + 1, np.int32)
        hv = comm.iallgatherv(vx, algorithm=alg, name="nbv")
        for k in reversed(range(4)):
            compare(f"iallreduce {alg} #{k}", handles[k].wait(),
                    refs[k], tolerance(30_000 + k, n * (k + 1), np.float64, "sum"))
        got, counts = hv.wait()
        ref = np.concatenate([data(30_100, r + 1, np.int32, rank=r) for r in range(P)])
        compare(f"iallgatherv {alg}", got, ref, 0)
        if counts != [r + 1 for r in range(P)]:
            failures.append(f"rank {RANK} iallgatherv {alg}: counts {counts}")
        # a blocking collective between issue and wait uses another channel
        h = comm.iallreduce(np.ones(5), algorithm=alg, name="nb-mix")
        b = comm.allreduce(np.full(3, 2.0), algorithm=alg, name="b-mix")
        compare(f"blocking between i-calls {alg}", b, np.full(3, 2.0 * P), 0)
        compare(f"iallreduce after blocking {alg}", h.wait(), np.full(5, float(P)), 0)
        for kind in ("ireduce_scatter", "ibcast", "iallgather", "ireduce"):
            x = data(30_200, n, np.float32).copy()
            if kind == "ireduce_scatter":
                c, d = even_split(n, P)
                ref = native_allreduce(x, "sum")[d[RANK]:d[RANK] + c[RANK]]
                got = comm.ireduce_scatter(x, algorithm=alg, name=kind).wait()
                tol = tolerance(30_200, n, np.float32, "sum")[d[RANK]:d[RANK] + c[RANK]]
            elif kind == "ibcast":
                ref = data(30_200, n, np.float32, rank=0)
                got = comm.ibcast(x, root=0, algorithm=alg, name=kind).wait()
                tol = 0
            elif kind == "iallgather":
                ref = np.concatenate([data(30_200, n, np.float32, rank=r) for r in range(P)])
                got = comm.iallgather(x, algorithm=alg, name=kind).wait()
                tol = 0
            else:
                ref = native_allreduce(x, "sum")
                got = comm.ireduce(x, root=0, algorithm=alg, name=kind).wait()
                tol = tolerance(30_200, n, np.float32, "sum")
                if RANK != 0:
                    continue
            compare(f"{kind} {alg}", got, ref, tol)


def section_staged(comm_staged):
    comm = comm_staged
    comm.segment_bytes = 512
    for alg in ALGS:
        for n in (0, 1, 7 * P + 3, 3000):
            s = 40_000 + n
            case_allreduce(comm, s, n, np.float32, "sum", alg, "out")
            case_allreduce(comm, s, n, np.float16, "max", alg, "inplace")
            case_reduce_scatter(comm, s, n, np.float64, "sum", alg)
            case_reduce(comm, s, n, np.int32, "sum", alg, root=P - 1, inplace=True)
            case_bcast(comm, s, n, np.int64, alg, root=P // 2)
            case_allgather(comm, s, n, np.float32, alg, True)
        case_allgatherv(comm, 40_500, 2, np.float32, alg)
    h = comm.iallreduce(data(40_600, 100, np.float64), algorithm="ring", name="staged-nb")
    compare("staged iallreduce", h.wait(), native_allreduce(data(40_600, 100, np.float64),
                                                            "sum"),
            tolerance(40_600, 100, np.float64, "sum"))


def main():
    global ALGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="grid,large,random,nonblocking,staged")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--algorithms", default=",".join(ALGS),
                    help="the algorithms under test (default: the built-in ones and auto)")
    args = ap.parse_args()
    ALGS = tuple(args.algorithms.split(","))
    sections = args.sections.split(",")
    comm = Communicator(check="always")
    import time
    for name in sections:
        t0 = time.perf_counter()
        before = ncases["n"]
        if name == "grid":
            section_grid(comm)
        elif name == "large":
            section_large(comm)
        elif name == "random":
            section_random(comm, args.seed)
        elif name == "nonblocking":
            section_nonblocking(comm)
        elif name == "staged":
            staged = Communicator(_staging="host")
            section_staged(staged)
            staged.close()
        else:
            raise SystemExit(f"unknown section {name}")
        RAW.Barrier()
        if RANK == 0:
            print(f"section {name}: {ncases['n'] - before} comparisons on rank 0, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    comm.close()
    report(RAW, failures, f"EQUIVALENCE OK p={P}")


def report(raw, failures, ok_line):
    """Gather every rank's failures on rank 0: print them and exit 1, or print ``ok_line``."""
    everyone = raw.gather(failures, root=0)
    if raw.Get_rank() == 0:
        bad = [f for fs in everyone for f in fs]
        for f in bad[:50]:
            print("FAIL", f)
        if bad:
            print(f"{len(bad)} failures")
            sys.exit(1)
        print(ok_line)


if __name__ == "__main__":
    main()

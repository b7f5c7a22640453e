"""OSU-style benchmark of mpidl's collectives against MPI's native calls, in the same run.

For every message size and algorithm: a few warm-up calls, then ``repeats`` timed runs of
``iters`` back-to-back calls, each run bracketed by barriers; a run's time per call is the
slowest rank's (a collective is done when its last rank is), and the figure reported is
the median over runs. Algorithms are interleaved within each run so that the noise of a
shared machine hits all of them alike; ratios to native (``native time / algorithm
time``: above 1 is faster than MPI) are the figures to trust, absolute times drift.

Bandwidths follow nccl-tests: ``algbw = bytes / time``; ``busbw`` scales algbw by the
share every rank must move — ``2(p-1)/p`` for allreduce, ``(p-1)/p`` for reduce-scatter
and all-gather (sizes are the whole vector: the input of reduce-scatter, the output of
all-gather), 1 for reduce and broadcast.

Run under ``mpiexec -n P``: ``bench/collectives.py`` (JSON + PNG under bench/results),
or ``mpidl bench collectives`` (a table). ``--tune`` saves the fastest algorithm per size
for ``algorithm="auto"`` (see ``mpidl.comm.auto``).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "bcast", "reduce")
ALGORITHMS = ("ring", "tree", "recursive_doubling", "mpi")
NATIVE = "native"
DEFAULT_SIZES = [4 << i for i in range(25)]  # 4 B .. 64 MiB
_BUS_FACTOR = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "bcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}
_UNITS = {"b": 1, "": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


# ---------------------------------------------------------------------------- parsing
def parse_size(text):
    """``"4"``, ``"4B"``, ``"64KiB"``, ``"1M"`` -> bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: use a number with an optional unit "
                         "(B, KiB, MiB, GiB), e.g. 4, 64KiB, 16MiB")
    value = float(num) * _UNITS[unit]
    if value < 1 or value != int(value):
        raise ValueError(f"bad size {text!r}: sizes are whole numbers of bytes >= 1")
    return int(value)


def parse_sizes(text):
    """``"4:64MiB"`` (powers of two from..to), ``"4,1KiB,1MiB"`` or a mix -> sorted bytes."""
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            lo_s, hi_s = part.split(":", 1)
            lo, hi = parse_size(lo_s), parse_size(hi_s)
            if lo > hi:
                raise ValueError(f"bad size range {part!r}: start is above end")
            s = lo
            while s <= hi:
                out.add(s)
                s *= 2
        else:
            out.add(parse_size(part))
    if not out:
        raise ValueError(f"no sizes in {text!r}")
    return sorted(out)


def parse_algorithms(text):
    """The algorithms to measure: any the communicator has (``hierarchical`` too: on one
    node it is a tree; bench/vcluster.py measures it across nodes), or ``auto``."""
    from mpidl.comm import ALGORITHMS as REGISTERED  # noqa: PLC0415  ("auto" first)

    algs = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in algs if a not in REGISTERED]
    if bad or not algs:
        raise ValueError(f"unknown algorithm(s) {', '.join(bad) or text!r}: choose from "
                         f"{', '.join(REGISTERED)}")
    return algs


def human(nbytes):
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------- measuring
def _calls(comm, collective, algorithms, nbytes, dtype):
    """{label: zero-argument callable} for native and each algorithm, on shared buffers."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.comm.ops import mpi_datatype  # noqa: PLC0415

    p, rank = comm.size, comm.rank
    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    dt = mpi_datatype(dtype)
    raw = comm._bench_raw  # a duplicate of the MPI communicator for the native calls
    x = np.ones(n, dtype=dtype)
    calls = {}
    if collective == "allreduce":
        out = np.empty(n, dtype=dtype)
        calls[NATIVE] = lambda: raw.Allreduce([x, dt], [out, dt], MPI.SUM)
        for a in algorithms:
            calls[a] = (lambda a=a: comm.allreduce(x, out=out, algorithm=a, name="bench"))
    elif collective == "reduce_scatter":
        from mpidl.comm import even_split  # noqa: PLC0415

        counts = list(even_split(n, p)[0])
        out = np.empty(counts[rank], dtype=dtype)
        calls[NATIVE] = lambda: raw.Reduce_scatter([x, dt], [out, dt], counts, MPI.SUM)
        for a in algorithms:
            calls[a] = (lambda a=a: comm.reduce_scatter(x, out=out, algorithm=a, name="bench"))
    elif collective == "allgather":
        out = np.empty(n * p, dtype=dtype)
        calls[NATIVE] = lambda: raw.Allgather([x, dt], [out, dt])
        for a in algorithms:
            calls[a] = (lambda a=a: comm.allgather(x, out=out, algorithm=a, name="bench"))
    elif collective == "bcast":
        calls[NATIVE] = lambda: raw.Bcast([x, dt], 0)
        for a in algorithms:
            calls[a] = (lambda a=a: comm.bcast(x, root=0, algorithm=a, name="bench"))
    elif collective == "reduce":
        out = np.empty(n, dtype=dtype)
        calls[NATIVE] = lambda: raw.Reduce([x, dt], [out, dt] if rank == 0 else None,
                                           MPI.SUM, 0)
        for a in algorithms:
            calls[a] = (lambda a=a: comm.reduce(x, root=0, out=out, algorithm=a, name="bench"))
    else:
        raise ValueError(f"unknown collective {collective!r}: choose from "
                         f"{', '.join(COLLECTIVES)}")
    return n * itemsize, calls


def _time_run(raw, fn, iters):
    """Seconds per call of ``fn`` over ``iters`` calls, the slowest rank's."""
    from mpi4py import MPI  # noqa: PLC0415

    raw.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    return raw.allreduce(dt, op=MPI.MAX)


def _pick_iters(raw, fn, nbytes, target):
    """Iterations for about ``target`` seconds per run (agreed by all ranks)."""
    from mpi4py import MPI  # noqa: PLC0415

    raw.Barrier()
    t0 = time.perf_counter()
    fn()
    fn()
    est = raw.allreduce((time.perf_counter() - t0) / 2, op=MPI.MAX)
    cap = 1000 if nbytes <= 64 * KiB else 200
    return int(min(cap, max(2, target / max(est, 1e-7))))


def measure(comm, collective="allreduce", sizes=None, algorithms=ALGORITHMS, iters=None,
            repeats=5, warmup=3, target=0.01, dtype=np.float32, progress=None):
    """Time native and ``algorithms`` for each size; returns a list of records (dicts).

    ``comm``: an ``mpidl.comm.Communicator``. ``iters=None`` picks iterations per size and
    algorithm for about ``target`` seconds per timed run: short runs, many repeats, so
    that on a shared machine most runs are not cut by the scheduler. Every rank must
    call this.
    """
    sizes = list(sizes or DEFAULT_SIZES)
    if not hasattr(comm, "_bench_raw"):
        comm._bench_raw = comm.mpi.Dup()
    raw = comm._bench_raw
    p = comm.size
    factor = _BUS_FACTOR[collective](p)
    records = []
    for nbytes in sizes:
        real_bytes, calls = _calls(comm, collective, list(algorithms), nbytes, dtype)
        labels = list(calls)
        for label in labels:  # warm up: scratch buffers, consistency check, caches
            for _ in range(warmup):
                calls[label]()
        n_it = {label: iters or _pick_iters(raw, calls[label], real_bytes, target)
                for label in labels}
        times = {label: [] for label in labels}
        for _ in range(repeats):
            for label in labels:
                times[label].append(_time_run(raw, calls[label], n_it[label]))
        native_med = statistics.median(times[NATIVE])
        for label in labels:
            med = statistics.median(times[label])
            algbw = real_bytes / med / 1e9
            records.append({
                "collective": collective, "algorithm": label, "bytes": real_bytes, "p": p,
                "iters": n_it[label], "repeats": repeats,
                "lat_us": med * 1e6, "lat_us_min": min(times[label]) * 1e6,
                "lat_us_runs": [t * 1e6 for t in times[label]],
                "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                "speedup_vs_native": native_med / med,
            })
        if progress is not None:
            progress(nbytes)
    return records


def measure_check_cost(comm, sizes, algorithm="auto", repeats=21, target=0.01,
                       dtype=np.float32, modes=("off", "digest", "off-again")):
    """What the signature check costs per call: allreduce timed on one communicator whose
    ``check`` mode is switched between runs (``set_check``), so buffers, memory placement
    and MPI state are the same for every mode; the runs are interleaved. The digest
    windows are first grown to their longest (``check_period`` calls): the steady state of
    a run (its first ~2 x check_period calls compare more often).

    Returns one record per size with each mode's median time per call and
    ``overhead_<mode>`` = median over repeats of (that mode's run / the first mode's run)
    - 1: paired runs, back to back, in an order that rotates every repeat, so drift and
    position cancel. ``off-again`` is the unchecked mode once more: its "overhead" is the
    noise floor of the measurement (an A/A comparison). Every rank must call this."""
    from mpidl.comm import Communicator  # noqa: PLC0415

    bench = Communicator(comm.mpi, check="off")
    raw = comm.mpi.Dup()
    records = []
    try:
        for nbytes in sizes:
            itemsize = np.dtype(dtype).itemsize
            n = max(1, nbytes // itemsize)
            x, out = np.ones(n, dtype=dtype), np.empty(n, dtype=dtype)

            def call():
                bench.allreduce(x, out=out, algorithm=algorithm, name="bench")

            for m in modes:
                bench.set_check(m.split("-")[0])
                for _ in range(3):
                    call()
            # the steady state: digest windows grown to their longest (64, 128, ... calls)
            bench.set_check("digest")
            window = bench._main.period
            while window < bench.check_period:
                for _ in range(window):
                    call()
                window = bench._main.period
            bench.set_check("off")
            # The same number of calls for every mode, enough for a digest comparison.
            iters = max(_pick_iters(raw, call, nbytes, target),
                        2048 if nbytes <= 64 * KiB else 256)
            times = {m: [] for m in modes}
            for rep in range(repeats):
                k = rep % len(modes)
                for m in modes[k:] + modes[:k]:
                    bench.set_check(m.split("-")[0])
                    times[m].append(_time_run(raw, call, iters))
            base = times[modes[0]]
            rec = {"bytes": n * itemsize, "p": comm.size, "algorithm": algorithm,
                   "iters": iters, "repeats": repeats}
            for m in modes:
                rec[f"lat_us_{m}"] = statistics.median(times[m]) * 1e6
                rec[f"lat_us_runs_{m}"] = [t * 1e6 for t in times[m]]
                if m != modes[0]:
                    rec[f"overhead_{m}"] = statistics.median(
                        t / b for t, b in zip(times[m], base)) - 1
            def unchecked():
                bench.set_check("off")
                return _time_run(raw, call, iters)

            added, cost = _check_work(raw, bench, x, out, modes, repeats, unchecked)
            for m in modes[1:]:
                rec[f"check_us_{m}"] = added[m] * 1e6
                rec[f"cost_{m}"] = cost[m]
            records.append(rec)
    finally:
        bench.close()
        raw.Free()
    return records


class _MovesNothing:
    """An allreduce algorithm that moves no data: timing calls through it with the check
    on and off isolates the check's own work on the real call path (key, lookup, window,
    and the real 16-byte comparison every ``check_period`` calls) from the communication,
    whose run-to-run noise on a shared machine is larger than the 1 % being measured."""

    @staticmethod
    def allreduce(t, src, dst, op, ctx):
        pass


_NULL = "moves-nothing (check-cost measurement)"
NULL_WINDOWS = 5  # digest windows of the longest length per timed run


def _check_work(raw, bench, x, out, modes, repeats, unchecked):
    """Seconds per call that each checked mode adds to an unchecked call of the same
    signature, and that as a share of the real call: ``({mode: seconds}, {mode: share})``
    (``off-again`` gives the floor of this measurement, an A/A comparison).

    Calls that move nothing do not keep the ranks in step as a real collective does:
    left alone, the faster rank would wait at each comparison for the slower one, and
    that wait, not the check, would be timed. So the ranks meet (a barrier, in every
    mode, outside the timed part) before each window's first call, the one that compares
    the window before it, and each rank times its own calls. Each repeat times a run of
    the real unchecked call (``unchecked()``: seconds per call) beside its runs of calls
    that move nothing (rotated as in measure_check_cost), so the share is taken of a
    call timed in the same moments: on a shared machine everything slows down together
    for a while, and a share of two figures timed apart would carry that. Per rank: the
    medians over the repeats; the result is the larger of the ranks' figures."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.comm import algorithms  # noqa: PLC0415

    algorithms.register(_NULL, _MovesNothing)
    try:
        period = bench.check_period
        calls = NULL_WINDOWS * period

        def run():
            """This rank's seconds in NULL_WINDOWS windows of calls and their comparisons."""
            spent = 0.0
            for _ in range(NULL_WINDOWS):
                raw.Barrier()
                t0 = time.perf_counter()
                for _ in range(period):
                    bench.allreduce(x, out=out, algorithm=_NULL, name="bench-null")
                spent += time.perf_counter() - t0
            raw.Barrier()
            t0 = time.perf_counter()
            bench.check_signatures()  # the last window's comparison
            return spent + time.perf_counter() - t0

        for m in modes:  # first calls (the full check of a new name), grown windows,
            bench.set_check(m.split("-")[0])  # and each window starting after a barrier
            run()
        added = {m: [] for m in modes[1:]}
        share = {m: [] for m in modes[1:]}
        for rep in range(repeats):
            real = unchecked()
            k = rep % len(modes)
            times = {}
            for m in modes[k:] + modes[:k]:
                bench.set_check(m.split("-")[0])
                times[m] = run() / calls
            for m in modes[1:]:
                added[m].append(times[m] - times[modes[0]])
                share[m].append(added[m][-1] / real)
        def larger_rank(per_mode):  # each rank's median; the larger of the ranks'
            return {m: raw.allreduce(statistics.median(v), op=MPI.MAX)
                    for m, v in per_mode.items()}

        return larger_rank(added), larger_rank(share)
    finally:
        bench.set_check("off")
        del algorithms.REGISTRY[_NULL]


def check_cost_table(records, modes=("off", "digest", "off-again")):
    """Per size: each mode's latency, the end-to-end cost (checked run / unchecked run - 1,
    with ``off-again`` as its A/A noise floor), and the check's own work per call measured
    apart from the communication (``_check_work``) as microseconds and as a share of the
    unchecked call timed beside it."""
    lines = [f"{'size':>10} " + " ".join(f"{m + ' us':>12}" for m in modes)
             + "".join(f" {'e2e ' + m:>14}" for m in modes[1:])
             + "".join(f" {'work ' + m:>13} {'cost ' + m:>12}" for m in modes[1:])]
    for r in records:
        lines.append(f"{human(r['bytes']):>10} "
                     + " ".join(f"{r['lat_us_' + m]:12.2f}" for m in modes)
                     + "".join(f" {100 * r['overhead_' + m]:13.2f}%" for m in modes[1:])
                     + "".join(f" {r['check_us_' + m]:10.3f} us {100 * r['cost_' + m]:11.2f}%"
                               for m in modes[1:]))
    return "\n".join(lines)


def check_cost_goals(records, mode="digest"):
    """The issue's goals for the per-call check: under 5 % at 4 B, under 1 % from 64 KiB,
    judged on the check's own work per call as a share of the unchecked call timed in the
    same repeats (the end-to-end difference is printed beside it with its A/A floor)."""
    out = []
    for r in records:
        limit = 0.05 if r["bytes"] <= 4 else 0.01 if r["bytes"] >= 64 * KiB else None
        if limit is not None:
            cost = r[f"cost_{mode}"]
            out.append((f"check={mode} costs {100 * cost:.2f}% per call at "
                        f"{human(r['bytes'])} ({r[f'check_us_{mode}']:.3f} us a call, "
                        f"unchecked call {r['lat_us_off']:.1f} us; end to end "
                        f"{100 * r[f'overhead_{mode}']:+.2f}%, A/A floor "
                        f"{100 * r['overhead_off-again']:+.2f}%; goal < {100 * limit:.0f}%)",
                        cost < limit))
    return out


# ---------------------------------------------------------------------------- reporting
def table(records, collective=None):
    """A text table: latency per algorithm and its ratio to native (native time / time)."""
    records = [r for r in records if collective is None or r["collective"] == collective]
    if not records:
        return "(no results)"
    labels = []
    for r in records:
        if r["algorithm"] not in labels:
            labels.append(r["algorithm"])
    by = {(r["bytes"], r["algorithm"]): r for r in records}
    sizes = sorted({r["bytes"] for r in records})
    head = f"{'size':>9} " + " ".join(
        f"{lab + ' us':>14}" if lab == NATIVE else f"{lab[:18] + ' us (x)':>27}" for lab in labels)
    head += f" {'native busbw':>12} {'best busbw':>12}"
    lines = [f"{records[0]['collective']}  p={records[0]['p']}  "
             "(median us per call; (x) = native time / algorithm time, >1 beats MPI; "
             "busbw GB/s)", head]
    for s in sizes:
        cells = []
        best = None
        for lab in labels:
            r = by.get((s, lab))
            if r is None:
                cells.append(" " * (14 if lab == NATIVE else 27))
                continue
            if lab == NATIVE:
                cells.append(f"{r['lat_us']:>14.1f}")
            else:
                cells.append(f"{r['lat_us']:>18.1f} ({r['speedup_vs_native']:>5.2f})")
                if best is None or r["busbw_GBps"] > best["busbw_GBps"]:
                    best = r
        nat = by.get((s, NATIVE))
        tail = f" {nat['busbw_GBps'] if nat else 0:>12.2f} " \
               f"{best['busbw_GBps'] if best else 0:>7.2f} {best['algorithm'][:4] if best else '':<4}"
        lines.append(f"{human(s):>9} " + " ".join(cells) + tail)
    return "\n".join(lines)


def goals(records, stat="median"):
    """The issue's goals for allreduce, checked on these records: list of (text, ok).

    ``stat="median"`` (the figures reported) or ``"min"`` (each algorithm's fastest run:
    what the code does when the machine leaves it alone, for noisy shared machines).
    """
    key = "lat_us" if stat == "median" else "lat_us_min"
    ar = [r for r in records if r["collective"] == "allreduce"]
    by = {(r["bytes"], r["algorithm"]): r for r in ar}

    def speed(size, alg):  # native time / algorithm time
        return by[(size, NATIVE)][key] / by[(size, alg)][key]

    out = []
    sizes = sorted({r["bytes"] for r in ar})
    mid = [s for s in sizes if MiB <= s <= 16 * MiB and (s, "ring") in by and (s, NATIVE) in by]
    if mid:
        worst = min(mid, key=lambda s: speed(s, "ring"))
        out.append((f"[{stat}] ring busbw >= 0.9x native, 1-16 MiB: worst "
                    f"{speed(worst, 'ring'):.2f}x ({human(worst)})",
                    speed(worst, "ring") >= 0.9))
    if (64 * MiB, "ring") in by and (64 * MiB, NATIVE) in by:
        r = speed(64 * MiB, "ring")
        out.append((f"[{stat}] ring busbw >= 2x native at 64 MiB: {r:.2f}x", r >= 2.0))
    for label, algs in (("best algorithm", ("ring", "tree", "recursive_doubling", "mpi")),
                        ("best home-made algorithm", ("ring", "tree", "recursive_doubling"))):
        worst_small = None
        for s in (s for s in sizes if s <= 4 * KiB and (s, NATIVE) in by):
            cands = [a for a in algs if (s, a) in by]
            if not cands:
                continue
            best = min(cands, key=lambda a: by[(s, a)][key])
            ratio = by[(s, best)][key] / by[(s, NATIVE)][key]
            if worst_small is None or ratio > worst_small[0]:
                worst_small = (ratio, s, best)
        if worst_small:
            ratio, s, alg = worst_small
            out.append((f"[{stat}] {label} latency <= 2.5x native at <= 4 KiB: worst "
                        f"{ratio:.2f}x ({human(s)}, {alg})", ratio <= 2.5))
    return out


def machine_info(comm=None):
    """What the figures were measured on: machine, versions, MPI settings."""
    import mpi4py  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    import mpidl  # noqa: PLC0415

    from mpidl.benchmarks.machine import cpu_model  # noqa: PLC0415

    cpu = cpu_model()
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem_gib = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        mem_gib = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = ""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
        "mem_GiB": mem_gib, "python": platform.python_version(), "numpy": np.__version__,
        "mpi4py": mpi4py.__version__, "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "mpidl": mpidl.__version__, "commit": commit,
        "ranks": comm.size if comm is not None else None,
        "env": {k: os.environ[k] for k in ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "OMP_NUM_THREADS",
                                           "MPIDL_RING_SEGMENT", "MPIDL_TUNING")
                if k in os.environ},
    }


def plot(records, path, title=None):
    """PNG: latency (small sizes) and bus bandwidth (all sizes) per algorithm, and the
    ratio to native."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = []
    for r in records:
        if r["algorithm"] not in labels:
            labels.append(r["algorithm"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for lab in labels:
        rs = sorted((r for r in records if r["algorithm"] == lab), key=lambda r: r["bytes"])
        xs = [r["bytes"] for r in rs]
        style = dict(marker="o", ms=3, lw=2.2 if lab == NATIVE else 1.3,
                     color="black" if lab == NATIVE else None)
        small = [(x, r["lat_us"]) for x, r in zip(xs, rs) if x <= 64 * KiB]
        if small:
            axes[0].plot(*zip(*small), label=lab, **style)
        axes[1].plot(xs, [r["busbw_GBps"] for r in rs], label=lab, **style)
        axes[2].plot(xs, [r["speedup_vs_native"] for r in rs], label=lab, **style)
    axes[0].set(xscale="log", yscale="log", xlabel="bytes", ylabel="latency (us)",
                title="latency, <= 64 KiB")
    axes[1].set(xscale="log", xlabel="bytes", ylabel="bus bandwidth (GB/s)",
                title="bus bandwidth")
    axes[2].set(xscale="log", yscale="log", xlabel="bytes",
                ylabel="native time / algorithm time", title="speed vs native (>1: faster)")
    axes[2].axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "mpidl collectives vs MPI native")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- tuning
TUNE_SIZES = [4 << (2 * i) for i in range(13)]  # 4 B, 16 B, ... 64 MiB (powers of 4)


def tune(comm, collectives=COLLECTIVES, sizes=None, repeats=3, path=None, log=print):
    """Measure every algorithm per size and save the fastest for ``algorithm="auto"``.

    Returns (path, tables). Rank 0 writes the file; every rank must call this.
    """
    from mpidl.comm import auto  # noqa: PLC0415

    sizes = sizes or TUNE_SIZES
    tables = {}
    for kind in collectives:
        recs = measure(comm, kind, sizes, ALGORITHMS, repeats=repeats, target=0.01)
        timings = {}
        for r in recs:
            if r["algorithm"] in ALGORITHMS:
                timings.setdefault(r["bytes"], {})[r["algorithm"]] = r["lat_us"]
        tables[kind] = {comm.size: auto.entries_from_timings(timings)}
        if comm.rank == 0 and log:
            log(f"{kind}: {tables[kind][comm.size]}")
    written = None
    if comm.rank == 0:
        written = auto.save(tables, path, info=machine_info(comm))
    return comm.mpi.bcast(written, root=0), tables


# ---------------------------------------------------------------------------- running
def add_arguments(p):
    p.add_argument("--collective", default="allreduce",
                   help=f"which collective(s), comma-separated: {', '.join(COLLECTIVES)} "
                   "or all (default: allreduce)")
    p.add_argument("--sizes", default="4:64MiB",
                   help="message sizes: a range of powers of two 'FROM:TO' and/or a list "
                   "'4,1KiB,1MiB' (default 4:64MiB)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help="mpidl algorithms to time beside native (default: all: "
                   f"{','.join(ALGORITHMS)}; 'auto' too)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timed run (default: chosen per size and algorithm, "
                   "~10 ms per run)")
    p.add_argument("--repeats", type=int, default=11,
                   help="timed runs per size and algorithm, interleaved; the median is "
                   "reported (default 11)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--plot", default=None, metavar="PATH", help="also write a PNG plot here")
    p.add_argument("--tune", action="store_true",
                   help="measure all algorithms and save the fastest per size for "
                   "algorithm='auto' (to $MPIDL_TUNING or ~/.cache/mpidl/tuning.json)")
    p.add_argument("--check-cost", action="store_true",
                   help="instead: time allreduce with the signature check off and with "
                   "check='digest' (the default), interleaved, and report what the check "
                   "costs per call (--algorithms: one algorithm, default auto)")
    p.add_argument("--np", type=int, default=None, metavar="P",
                   help="launch P ranks with mpiexec (when not already under a launcher)")
    return p


def validate(args):
    """Check the arguments (no communication): raises ValueError with a clear message."""
    args.size_list = parse_sizes(args.sizes)
    args.algorithm_list = parse_algorithms(args.algorithms)
    kinds = [k.strip() for k in args.collective.split(",") if k.strip()]
    if kinds == ["all"]:
        kinds = list(COLLECTIVES)
    bad = [k for k in kinds if k not in COLLECTIVES]
    if bad or not kinds:
        raise ValueError(f"unknown collective(s) {', '.join(bad) or args.collective!r}: "
                         f"choose from {', '.join(COLLECTIVES)} or all")
    args.collective_list = kinds
    if args.iters is not None and args.iters < 1:
        raise ValueError("--iters must be at least 1")
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if args.np is not None and args.np < 1:
        raise ValueError("--np must be at least 1")
    try:
        args.np_dtype = np.dtype(args.dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {args.dtype!r}") from None
    if args.np_dtype.kind not in "iuf":
        raise ValueError(f"--dtype {args.dtype}: use an integer or floating type")
    from mpidl.comm.ops import mpi_datatype  # noqa: PLC0415

    try:  # the native row is MPI's own collective on this type: it needs the datatype
        mpi_datatype(args.np_dtype)
    except TypeError:
        raise ValueError(f"--dtype {args.dtype}: this MPI library has no {args.np_dtype} "
                         "datatype (Open MPI 4.1 has no float16), so MPI's own collective "
                         "cannot be measured against mpidl's; choose another --dtype or "
                         "another MPI") from None
    return args


def relaunch(argv, nprocs, script=None):
    """Run this benchmark (or ``script``) under ``mpiexec -n nprocs``; returns its exit
    status."""
    import shutil  # noqa: PLC0415

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise ValueError("--np needs mpiexec (pip install mpich, or load your MPI module)")
    env = dict(os.environ)
    if nprocs <= (os.cpu_count() or 1):
        # one rank per core: busy-polling is fastest; yielding would only add latency
        env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)
    else:
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    target = [script] if script else ["-m", "mpidl.benchmarks.collectives"]
    cmd = [mpiexec, "-n", str(nprocs), sys.executable, "-m", "mpi4py"] + target + list(argv)
    return subprocess.call(cmd, env=env)


def run(args, out=print):
    """Run the benchmark described by validated ``args`` on COMM_WORLD.

    Prints tables on rank 0 and writes ``args.json``/``args.plot`` there; returns
    (records, info) on every rank.
    """
    from mpidl.comm import Communicator  # noqa: PLC0415

    comm = Communicator()
    try:
        root = comm.rank == 0
        info = machine_info(comm)
        if root and comm.size > (os.cpu_count() or 1):
            out(f"note: {comm.size} ranks on {os.cpu_count()} cores oversubscribe: timings "
                "mostly measure scheduling")
        if root and comm.size == 1:
            out("note: 1 rank; run under 'mpiexec -n 2' (or pass --np 2) to measure "
                "communication")
        if getattr(args, "check_cost", False):
            alg = args.algorithm_list[0] if len(args.algorithm_list) == 1 else "auto"
            records = measure_check_cost(comm, args.size_list, alg, repeats=args.repeats)
            if root:
                out(check_cost_table(records))
                out("(off-again: the unchecked mode once more, the noise floor)")
                checked = check_cost_goals(records)
                for text, ok in checked:
                    out(f"goal {'met   ' if ok else 'MISSED'} {text}")
                if args.json:
                    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                    with open(args.json, "w", encoding="utf-8") as f:
                        json.dump({"info": info, "check_cost": records,
                                   "goals": [{"goal": t, "met": ok} for t, ok in checked]},
                                  f, indent=1)
                    out(f"wrote {args.json}")
            return records, info
        if getattr(args, "tune", False):
            path, tables = tune(comm, args.collective_list, sizes=args.size_list,
                                repeats=max(2, args.repeats // 2), log=out if root else None)
            if root:
                out(f"tuning saved to {path}")
            return tables, info
        records = []
        for kind in args.collective_list:
            recs = measure(comm, kind, args.size_list, args.algorithm_list, iters=args.iters,
                           repeats=args.repeats, dtype=args.np_dtype)
            records += recs
            if root:
                out(table(recs))
                out("")
        if root:
            checked = goals(records, "median") + goals(records, "min")
            if checked and comm.size != 2:
                out(f"note: the goals are set for p = 2 (one rank per core); at p = "
                    f"{comm.size} they are shown for reference only")
            for text, ok in checked:
                out(f"goal {'met   ' if ok else 'MISSED'} {text}")
            doc = {"info": info, "collectives": args.collective_list, "results": records,
                   "goals": [{"goal": t, "met": ok} for t, ok in checked]}
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(doc, f, indent=1)
                out(f"wrote {args.json}")
            if args.plot:
                for kind in args.collective_list:
                    path = args.plot
                    if len(args.collective_list) > 1:
                        stem, ext = os.path.splitext(args.plot)
                        path = f"{stem}_{kind}{ext}"
                    plot([r for r in records if r["collective"] == kind], path,
                         title=f"mpidl {kind} vs MPI native, p={comm.size} "
                         f"({info['cpu']}, {info['mpi']})")
                    out(f"wrote {path}")
        return records, info
    finally:
        comm.close()


def main(argv=None):
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m mpidl.benchmarks.collectives", description=__doc__.split("\n")[0]))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        validate(args)
    except ValueError as e:
        parser.error(str(e))
    from mpi4py import MPI  # noqa: PLC0415

    if args.np and MPI.COMM_WORLD.Get_size() == 1 and args.np > 1:
        return relaunch(_drop_np(argv), args.np)
    run(args)
    return 0


def _drop_np(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--np":
            skip = True
            continue
        if a.startswith("--np="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())

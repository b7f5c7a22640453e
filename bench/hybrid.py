"""The conv-DP/FC-MP hybrid against plain data parallelism, sweeping the FC width.

    python bench/hybrid.py                  # -> bench/results/hybrid.json + hybrid.png
    python bench/hybrid.py --widths 256,1024,4096 --steps 5 --repeats 1 --out ... --plot ...
    python bench/hybrid.py --quick          # tiny run (the test's)

One launch of ``--ranks`` ranks (2 by default) does everything, so both layouts see the
same machine: for each width W of the cnn's hidden layer (Fashion-MNIST-shaped inputs,
float32, batch ``--batch`` per rank, SGD with momentum), it builds the model twice, once
under ``--strategy allreduce`` (every gradient all-reduced) and once under ``--hybrid
conv-dp-fc-mp``, both with ``--algorithm ring`` and no overlap, and times training
steps alternately (a barrier before each, the slowest rank's time), ``--steps`` of each
after a warm-up; the median per layout is the figure.

Prediction, from the same run: the bytes per step of each layout from the formulas
(``Hybrid.bytes_per_step``, ``dp_bytes_per_step``; checked against the counters once per
width), and a latency/bandwidth model calibrated here by timing ring all-reduces of 4
KiB to 64 MiB: ``t = a + bytes_sent / bw`` per collective (``a``: the 4 KiB time;
``bw``: the least-squares slope over 1 MiB and more). A layout's
predicted communication time is the sum over its collectives (the all-gathers count two
latencies: their counts are exchanged first). Compute is the same in both layouts to
first order (the hybrid runs 1/p of the FC columns on p times the rows), so the
predicted crossover is the width where the predicted communication times meet; the
bytes-only crossover (where the byte counts meet) is reported beside it. Widths between
grid points are interpolated linearly (data parallelism's bytes grow linearly with W, the
hybrid's do not depend on it).

The machine is shared: ``--repeats`` launches (3 by default) each measure everything
again; the JSON keeps every launch and the spread of the crossovers, the summary and
the plot's lines are the launch whose measured crossover is the median.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402

CAL_SIZES = [4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def calibrate(comm, repeats):
    """(latency s, bandwidth B/s, points) of ring all-reduces on this communicator."""
    import numpy as np

    from mpidl.runtime.hybrid import ring_allreduce_bytes

    points = []
    for size in CAL_SIZES:
        x = np.ones(size // 4, dtype=np.float32)
        comm.allreduce(x, out=x, algorithm="ring")  # warm
        times = []
        for _ in range(repeats):
            comm.mpi.Barrier()
            t = time.perf_counter()
            comm.allreduce(x, out=x, algorithm="ring")
            times.append(comm.mpi.allreduce(time.perf_counter() - t, op=_max()))
        sent = ring_allreduce_bytes(x.size, comm.size, comm.rank, 4)
        points.append({"bytes": size, "sent": sent, "s": statistics.median(times)})
    # latency: the smallest message (its bytes take next to no time); bandwidth: the
    # slope over the large ones (a least-squares intercept would be noise there)
    big = [p for p in points if p["bytes"] >= 1 << 20]
    slope, _ = np.polyfit([p["sent"] for p in big], [p["s"] for p in big], 1)
    return points[0]["s"], 1.0 / slope, points


def _max():
    from mpi4py import MPI

    return MPI.MAX


def predicted_seconds(terms, calls, latency, bandwidth):
    """A layout's communication time: a latency per call, its bytes at the bandwidth."""
    return calls * latency + terms / bandwidth


def time_steps(comm, layouts, steps, warmup):
    """Alternate steps of each layout; per layout the slowest rank's step times."""
    times = {name: [] for name in layouts}
    for i in range(warmup + steps):
        for name, (rt, x, y) in layouts.items():
            comm.mpi.Barrier()
            t = time.perf_counter()
            rt.train_step(x, y)
            dt = comm.mpi.allreduce(time.perf_counter() - t, op=_max())
            if i >= warmup:
                times[name].append(dt)
    return times


def build_layout(comm, width, hybrid, a):
    import numpy as np

    from mpidl.engine import SGD, SoftmaxCrossEntropy
    from mpidl.engine.models import cnn
    from mpidl.runtime import build

    model = cnn((1, 28, 28), 10, np.random.default_rng(a.seed), "float32", hidden=width)
    model.needs_input_grad = False
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9)
    options = {"hybrid": "conv-dp-fc-mp"} if hybrid else {}
    rt = build("allreduce", comm, algorithm="ring", overlap="off", **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((a.batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=a.batch)
    return rt, x, y


def calls_per_step(rt, hybrid):
    """Collective calls a step makes (each a latency in the model)."""
    if not hybrid:
        return len(rt.syncs[0][1].fusion.buckets)
    tp = rt.tp
    n = len(tp.conv_sync.fusion.buckets) + 2 * 2 + 1  # 2 all-gathers (counts + data), RS
    from mpidl.runtime.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for _, m in tp.model.modules():
        if isinstance(m, RowParallelLinear):
            n += 1
        elif isinstance(m, ColumnParallelLinear) and m.name != str(tp.boundary) \
                and m.needs_input_grad:
            n += 1
    return n


def run_rank(a):
    import gc

    from mpidl import backend
    from mpidl.comm import Communicator

    backend.use("cpu")
    comm = Communicator()
    latency, bandwidth, cal = calibrate(comm, a.calibrate_repeats)
    widths = [int(w) for w in a.widths.split(",")]
    rows = []
    for width in widths:
        dp = build_layout(comm, width, False, a)
        hy = build_layout(comm, width, True, a)
        times = time_steps(comm, {"dp": dp, "hybrid": hy}, a.steps, a.warmup)
        # the formulas, checked against the counters on one more step of each
        formula = {"hybrid": hy[0].tp.bytes_per_step([a.batch] * comm.size, comm.rank)["total"],
                   "dp": hy[0].tp.dp_bytes_per_step(comm.rank)}
        counted = {}
        for name, (rt, x, y) in (("dp", dp), ("hybrid", hy)):
            rt.group.reset_counters()
            rt.train_step(x, y)
            counted[name] = rt.group.counters()["total"]["bytes"]
        calls = {"dp": calls_per_step(dp[0], False), "hybrid": calls_per_step(hy[0], True)}
        row = {"width": width,
               "dp_ms": 1e3 * statistics.median(times["dp"]),
               "hybrid_ms": 1e3 * statistics.median(times["hybrid"]),
               "dp_ms_all": [1e3 * t for t in times["dp"]],
               "hybrid_ms_all": [1e3 * t for t in times["hybrid"]],
               "dp_bytes": formula["dp"], "hybrid_bytes": formula["hybrid"],
               "dp_bytes_counted": counted["dp"], "hybrid_bytes_counted": counted["hybrid"],
               "dp_calls": calls["dp"], "hybrid_calls": calls["hybrid"]}
        for name in ("dp", "hybrid"):
            row[f"{name}_comm_ms_predicted"] = 1e3 * predicted_seconds(
                row[f"{name}_bytes"], calls[name], latency, bandwidth)
        rows.append(row)
        if comm.rank == 0:
            print(f"W {width:5d}: dp {row['dp_ms']:8.1f} ms  hybrid {row['hybrid_ms']:8.1f} ms"
                  f"  bytes dp {row['dp_bytes']:>11,} hybrid {row['hybrid_bytes']:>9,} "
                  f"(counted equal: {counted == formula})", flush=True)
        del dp, hy
        gc.collect()
    if comm.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"latency_s": latency, "bandwidth_Bps": bandwidth, "calibration": cal,
                       "rows": rows}, f)
    comm.close()


def crossover(widths, diffs):
    """The smallest width from which ``diffs`` (hybrid - dp) stays negative, linearly
    interpolated between the grid points around the sign change; None if it never does,
    0 if it already is at the first width (the crossover lies below the sweep)."""
    for i in range(len(widths)):
        if all(d < 0 for d in diffs[i:]):
            if i == 0:
                return 0
            w0, w1, d0, d1 = widths[i - 1], widths[i], diffs[i - 1], diffs[i]
            return w0 + (w1 - w0) * d0 / (d0 - d1)
    return None


def summarize(res):
    rows = res["rows"]
    widths = [r["width"] for r in rows]
    res["crossover_measured"] = crossover(widths, [r["hybrid_ms"] - r["dp_ms"] for r in rows])
    res["crossover_predicted"] = crossover(
        widths, [r["hybrid_comm_ms_predicted"] - r["dp_comm_ms_predicted"] for r in rows])
    res["crossover_bytes"] = crossover(widths, [r["hybrid_bytes"] - r["dp_bytes"] for r in rows])
    res["formula_equals_counters"] = all(
        r["dp_bytes"] == r["dp_bytes_counted"] and r["hybrid_bytes"] == r["hybrid_bytes_counted"]
        for r in rows)
    return res


def plot(res, path):
    from mpidl.benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    rows = res["rows"]
    w = [r["width"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in res.get("launches", []):  # every launch, faint
        ws = [r["width"] for r in run["rows"]]
        ax.plot(ws, [r["dp_ms"] for r in run["rows"]], "-", color="tab:blue", alpha=0.25)
        ax.plot(ws, [r["hybrid_ms"] for r in run["rows"]], "-", color="tab:orange",
                alpha=0.25)
    ax.plot(w, [r["dp_ms"] for r in rows], "o-", color="tab:blue",
            label="data parallel, step (measured)")
    ax.plot(w, [r["hybrid_ms"] for r in rows], "s-", color="tab:orange",
            label="hybrid conv-dp-fc-mp, step (measured)")
    ax.plot(w, [r["dp_comm_ms_predicted"] for r in rows], "o:", color="tab:blue",
            label="data parallel, communication (predicted)")
    ax.plot(w, [r["hybrid_comm_ms_predicted"] for r in rows], "s:", color="tab:orange",
            label="hybrid, communication (predicted)")
    for key, style in (("crossover_measured", "-"), ("crossover_predicted", "--"),
                       ("crossover_bytes", ":")):
        if res.get(key):
            ax.axvline(res[key], color="gray", linestyle=style,
                       label=f"{key.split('_')[1]} crossover W = {res[key]:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("FC width W (cnn hidden units)")
    ax.set_ylabel("ms per step (median)")
    s = res["settings"]
    ax.set_title(f"{s['ranks']} ranks, batch {s['batch']}/rank, float32, ring")
    ax.legend(fontsize=7)
    bx.plot(w, [r["dp_bytes"] / 1e6 for r in rows], "o-", label="data parallel")
    bx.plot(w, [r["hybrid_bytes"] / 1e6 for r in rows], "s-", label="hybrid")
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xlabel("FC width W")
    bx.set_ylabel("MB sent per rank and step (formula = counters)")
    bx.set_title(f"calibrated: latency {1e6 * res['latency_s']:.0f} us, bandwidth "
                 f"{res['bandwidth_Bps'] / 1e9:.2f} GB/s")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("_run", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--widths", default="64,128,256,512,1024,2048,4096,8192")
    p.add_argument("--batch", type=int, default=128, help="samples per rank")
    p.add_argument("--steps", type=int, default=7, help="timed steps per layout and width")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibrate-repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="launches (the machine is shared)")
    p.add_argument("--quick", action="store_true", help="tiny run (the test's)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(HERE, "results", "hybrid.json"))
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    if a._run == "_run":
        return run_rank(a)
    if a.quick:
        a.widths, a.batch, a.steps, a.warmup, a.calibrate_repeats = "64,256", 8, 2, 1, 2
        a.repeats = 1
    a.plot = a.plot or os.path.splitext(a.out)[0] + ".png"
    work = a.out + ".rank.json"
    cmd = [mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "mpi4py",
           os.path.abspath(__file__), "_run", "--widths", a.widths, "--batch", str(a.batch),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--calibrate-repeats",
           str(a.calibrate_repeats), "--seed", str(a.seed), "--out", work]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    settings = {k: v for k, v in vars(a).items() if k not in ("_run", "out", "plot")}
    launches = []
    for i in range(a.repeats):
        load = os.getloadavg()
        t = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=launch_env(ROOT), timeout=a.timeout)
        print(proc.stdout, end="")
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode})")
        with open(work) as f:
            run = summarize(json.load(f))
        os.remove(work)
        run.update(load_average_before=load, load_average_after=os.getloadavg(),
                   wall_s=time.time() - t)
        launches.append(run)
        print(f"launch {i + 1}/{a.repeats}: " + _crossovers(run), flush=True)
    measured = sorted(launches, key=lambda r: (r["crossover_measured"] is None,
                                               r["crossover_measured"] or 0))
    res = dict(measured[(len(measured) - 1) // 2], machine=describe_machine(),
               settings=settings, command="python bench/hybrid.py " + " ".join(sys.argv[1:]),
               launches=launches)
    res["spread"] = {key: [r[key] for r in launches]
                     for key in ("crossover_measured", "crossover_predicted", "crossover_bytes",
                                 "latency_s", "bandwidth_Bps")}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, a.plot)
    print("median launch: " + _crossovers(res) + "; measured crossover over the launches: "
          + ", ".join(_w(w) for w in res["spread"]["crossover_measured"]))
    return 0


def _crossovers(res):
    return (f"crossover width measured {_w(res['crossover_measured'])}, predicted from the "
            f"calibrated latency/bandwidth {_w(res['crossover_predicted'])}, from bytes alone "
            f"{_w(res['crossover_bytes'])}; formula == counters: "
            f"{res['formula_equals_counters']}; latency {1e6 * res['latency_s']:.1f} us, "
            f"bandwidth {res['bandwidth_Bps'] / 1e9:.2f} GB/s")


def _w(w):
    return "above the sweep" if w is None else "below the sweep" if w == 0 else f"{w:.0f}"


if __name__ == "__main__":
    sys.exit(main())

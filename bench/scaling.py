"""Data-parallel scaling: images/s and the step split into compute / communication / wait,
for 1, 2 and 4 ranks, weak and strong scaling, overlap on and off, with PyTorch DDP (gloo)
on the same MLP in the same run.

    python bench/scaling.py                       # writes bench/results/scaling.json + .png
    python bench/scaling.py --quick               # fewer configurations and steps
    python bench/scaling.py --ranks 1 2 --repeats 5

Model: MLP 784-1024-1024-10, ReLU, softmax cross-entropy, SGD momentum 0.9, float32, random
in-memory data (only the step is timed). Weak scaling: 128 images per rank; strong scaling:
256 images per step in all. Every rank runs one BLAS/OpenMP thread (and torch one thread).

Each configuration is one ``mpiexec`` launch of ``mpidl.benchmarks.scaling``; the whole
list is run ``--repeats`` times in rotation, so drift on a shared machine spreads over all
configurations, and each figure is the median over the repeats (the median step inside
each launch). mpidl launches record the communicator's timeline (Chrome trace): the time
the all-reduces really ran and the fraction that lay under backward. The trace of the
2-rank overlapped run is kept as results/timeline_overlap_rank0.json (open it in
chrome://tracing or ui.perfetto.dev). The ratio to DDP is the figure to quote: absolute
times move with the machine's load, and 4 ranks on 2 cores oversubscribe.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=128, help="weak scaling: per-rank batch")
    ap.add_argument("--global-batch", type=int, default=256, help="strong scaling")
    ap.add_argument("--buckets", type=float, nargs="*", default=[1, 2, 8, 32],
                    help="extra bucket sizes (MiB) tried at 2 ranks, overlap on")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="2 repeats, 30 steps, no bucket sweep, no 4-rank strong scaling")
    ap.add_argument("--no-yield", action="store_true",
                    help="do not set MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (MPICH busy-polls)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "scaling.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.buckets = min(args.repeats, 2), 30, []
    if args.plot is None:
        args.plot = os.path.splitext(args.out)[0] + ".png"
    return args


def have_torch():
    try:
        import torch  # noqa: F401, PLC0415
    except Exception:
        return False
    return True


def launcher():
    """The command prefix that starts ranks (it must take ``-n N``): $MPIDL_MPIEXEC (e.g.
    "srun --mpi=pmi2", set by slurm/scaling.sbatch), else the mpiexec beside this Python
    (the mpich wheel's), else the one on PATH."""
    explicit = os.environ.get("MPIDL_MPIEXEC")
    if explicit:
        return shlex.split(explicit)
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not found:
        raise SystemExit("bench/scaling.py: no mpiexec found (pip install mpich, or set "
                         "MPIDL_MPIEXEC to the launcher command)")
    return [found]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configurations(args, torch):
    """(key, ranks, worker arguments) for every launch of one repeat.

    The key names the configuration: ``mpidl n=2 b=128 overlap`` is 2 ranks, 128 images
    per rank, overlap on; ``torch n=2 b=128`` the same with PyTorch (DDP for n > 1)."""
    out = []

    def add(key, n, fw, batch, *extra):
        if key not in {k for k, _, _ in out}:
            out.append((key, n, [fw, "--batch", str(batch)] + list(extra)))

    ranks = sorted(set(args.ranks))
    for n in ranks:
        for batch, kind in ((args.batch, "weak"), (args.global_batch // n, "strong")):
            if kind == "strong" and args.quick and n > 2:
                continue
            if n == 1:
                add(f"mpidl n=1 b={batch}", 1, "mpidl", batch, "--strategy", "local")
            else:
                add(f"mpidl n={n} b={batch} overlap", n, "mpidl", batch)
                add(f"mpidl n={n} b={batch} no-overlap", n, "mpidl", batch, "--no-overlap")
                if kind == "weak" and not args.quick:
                    # the ring with a progress thread that polls and sleeps instead of
                    # spinning inside MPI (which steals the core backward runs on)
                    add(f"mpidl n={n} b={batch} overlap ring+poll", n, "mpidl", batch,
                        "--algorithm", "ring", "--progress-wait", "poll")
            if torch:
                add(f"torch n={n} b={batch}", n, "torch", batch)
    if 2 in ranks:
        for mb in args.buckets:
            add(f"mpidl n=2 b={args.batch} overlap bucket={mb:g}", 2, "mpidl", args.batch,
                "--bucket-mb", str(mb))
    return out


def launch(n, worker_args, args, tmp, key, rep):
    out = os.path.join(tmp, f"r{rep}-{abs(hash(key))}.json")
    cmd = launcher() + ["-n", str(n), sys.executable, "-m", "mpidl.benchmarks.scaling"]
    cmd += worker_args + ["--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--out", out]
    timeline = None
    if worker_args[0] == "mpidl" and n > 1:
        timeline = os.path.join(tmp, f"tl-{rep}-{abs(hash(key))}-{{rank}}.json")
        cmd += ["--timeline", timeline]
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        env[var] = "1"
    if not args.no_yield:
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    t = time.perf_counter()
    for attempt in range(2):  # PyTorch's gloo sometimes aborts at exit; one retry
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, timeout=args.timeout, cwd=ROOT)
        if proc.returncode == 0:
            break
        if attempt == 0:
            print(f"{key}: launch failed ({proc.returncode}), retrying once; its output "
                  f"ended:\n{proc.stdout[-600:]}", flush=True)
            env["MASTER_PORT"] = str(free_port())
    else:
        raise RuntimeError(f"{key}: launch failed twice ({proc.returncode}):\n{proc.stdout}")
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    result["launch_s"] = time.perf_counter() - t
    result["retried"] = attempt
    result["timeline_file"] = timeline.format(rank=0) if timeline else None
    return result


def median_of(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs_by_key):
    summary = {}
    for key, runs in runs_by_key.items():
        first = runs[0]
        s = {k: first[k] for k in ("framework", "ranks", "batch_per_rank", "global_batch")}
        for k in ("overlap", "bucket_mb", "algorithm", "progress_wait", "overlap_auto",
                  "layout"):
            if k in first:
                s[k] = first[k]
        for k in ("images_per_sec", "step_ms_median", "forward_ms", "backward_ms",
                  "update_ms", "compute_ms", "wait_ms", "timeline_comm_ms",
                  "timeline_wait_ms", "overlap_backward", "hidden"):
            v = median_of(runs, k)
            if v is not None:
                s[k] = v
        s["images_per_sec_all"] = [r["images_per_sec"] for r in runs]
        s["images_per_sec_best"] = max(s["images_per_sec_all"])
        summary[key] = s
    return summary


def derived(summary, args):
    """Speed-ups, efficiencies and the ratio to DDP."""
    out = {}
    b, gb = args.batch, args.global_batch
    one = summary.get(f"mpidl n=1 b={b}")
    one_strong = summary.get(f"mpidl n=1 b={gb}")
    for key, s in summary.items():
        if s["framework"] != "mpidl" or s["ranks"] == 1 or "bucket" in key:
            continue
        n = s["ranks"]
        if s["batch_per_rank"] == b and one:
            out[f"weak efficiency {key}"] = s["images_per_sec"] / (n * one["images_per_sec"])
        if s["batch_per_rank"] * n == gb and one_strong:
            out[f"strong speed-up {key}"] = s["images_per_sec"] / one_strong["images_per_sec"]
        torch_key = f"torch n={n} b={s['batch_per_rank']}"
        if torch_key in summary:
            out[f"ratio to DDP-gloo {key}"] = (s["images_per_sec"]
                                               / summary[torch_key]["images_per_sec"])
    # the default settings (overlap="auto" picks one of the two measured modes)
    for key, s in summary.items():
        auto = s.get("overlap_auto")
        if s["framework"] != "mpidl" or not key.endswith(" overlap") or not auto:
            continue
        base = key[:-len(" overlap")]
        chosen = key if auto["on"] else base + " no-overlap"
        torch_key = f"torch n={s['ranks']} b={s['batch_per_rank']}"
        if chosen in summary and torch_key in summary:
            out[f"ratio to DDP-gloo {base} default (overlap auto -> "
                f"{'on' if auto['on'] else 'off'})"] = (
                summary[chosen]["images_per_sec"] / summary[torch_key]["images_per_sec"])
    return out


def machine_info():
    import numpy  # noqa: PLC0415

    from mpidl.benchmarks.machine import cpu_model  # noqa: PLC0415

    info = {"python": platform.python_version(), "numpy": numpy.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu_model()}
    try:
        import mpi4py  # noqa: PLC0415
        from mpi4py import MPI  # noqa: PLC0415

        info["mpi4py"] = mpi4py.__version__
        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:
        pass
    try:
        import torch  # noqa: PLC0415

        info["torch"] = torch.__version__
    except Exception:
        pass
    return info


def keep_timeline(src, dst, steps=6):
    """Copy the last ``steps`` steps of a Chrome trace (rank 0's) to ``dst``."""
    with open(src, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    backward = [e for e in events if e.get("name") == "compute backward"]
    if len(backward) > steps:
        forward = [e for e in events if e.get("name") == "compute forward"]
        t0 = forward[-steps]["ts"] if len(forward) >= steps else backward[-steps]["ts"]
        events = [e for e in events if e.get("ph") != "X" or e["ts"] >= t0]
        for e in events:
            if e.get("ph") == "X":
                e["ts"] = round(e["ts"] - t0, 3)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def print_table(summary, extra):
    print(f"{'configuration':44s} {'img/s':>8s} {'step ms':>8s} {'compute':>8s} "
          f"{'comm':>6s} {'wait':>6s} {'overlap':>7s}")
    for key, s in summary.items():
        def f(k, fmt="{:.1f}"):
            return fmt.format(s[k]) if k in s else "-"
        print(f"{key:44s} {s['images_per_sec']:8.0f} {s['step_ms_median']:8.1f} "
              f"{f('compute_ms'):>8s} {f('timeline_comm_ms'):>6s} {f('wait_ms'):>6s} "
              f"{f('overlap_backward', '{:.0%}'):>7s}")
    for k, v in extra.items():
        print(f"{k}: {v:.2f}")


def plot(report, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return None
    summary, args = report["summary"], report["settings"]
    b, gb = args["batch"], args["global_batch"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    series = [("mpidl overlap", "mpidl", "overlap", "C0", "-"),
              ("mpidl no overlap", "mpidl", "no-overlap", "C1", "-"),
              ("PyTorch (DDP gloo for n > 1)", "torch", "", "C3", "-")]
    for mode, batch_of, style in (("weak", lambda n: b, "-"),
                                  ("strong", lambda n: gb // n, "--")):
        for label, fw, ov, color, _ in series:
            xs, ys = [], []
            for n in sorted({s["ranks"] for s in summary.values()}):
                batch = batch_of(n)
                if fw == "mpidl" and n == 1:
                    key = f"mpidl n=1 b={batch}"
                elif fw == "mpidl":
                    key = f"mpidl n={n} b={batch} {ov}"
                else:
                    key = f"torch n={n} b={batch}"
                if key in summary:
                    xs.append(n)
                    ys.append(summary[key]["images_per_sec"])
            if xs:
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} ({mode})")
    ax.set_xlabel("ranks (2 cores: 4 ranks oversubscribe)")
    ax.set_ylabel("images/s (median of repeats)")
    ax.set_title(f"throughput: weak (solid, {b}/rank), strong (dashed, {gb} total)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    ax = axes[1]
    keys = [k for k, s in summary.items() if s["framework"] == "mpidl" and "bucket" not in k
            and "compute_ms" in s]
    comp = [summary[k]["compute_ms"] for k in keys]
    wait = [summary[k].get("wait_ms", 0) for k in keys]
    comm = [summary[k].get("timeline_comm_ms", 0) for k in keys]
    ys = range(len(keys))
    ax.barh(ys, comp, color="C2", label="compute (fwd+bwd+update)")
    ax.barh(ys, wait, left=comp, color="C3", label="wait (communication not hidden)")
    ax.scatter(comm, ys, color="k", marker="|", s=200, label="all-reduce time (timeline)",
               zorder=3)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([k.replace("mpidl ", "") for k in keys], fontsize=7)
    ax.set_xlabel("ms per step (rank mean, median of repeats)")
    ax.set_title("step split")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x")

    ax = axes[2]
    base = f"mpidl n=2 b={b} overlap"
    sweep = sorted((s["bucket_mb"], s["images_per_sec"]) for k, s in summary.items()
                   if (k == base or k.startswith(base + " bucket=")) and s.get("bucket_mb"))
    if sweep:
        ax.semilogx([x for x, _ in sweep], [y for _, y in sweep], marker="o", base=2)
        ddp = summary.get(f"torch n=2 b={b}")
        if ddp:
            ax.axhline(ddp["images_per_sec"], color="C3", ls=":", label="DDP gloo")
            ax.axhline(1.3 * ddp["images_per_sec"], color="C3", ls="--", label="1.3 x DDP")
            ax.legend(fontsize=7)
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("images/s")
    ax.set_title(f"2 ranks, {b}/rank, overlap on: fusion bucket size")
    ax.grid(alpha=0.3)
    fig.suptitle(f"mpidl data parallel vs PyTorch DDP — {report['machine'].get('cpu', '')}, "
                 f"{report['machine'].get('cpus')} CPUs (shared: noisy)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    args = parse_args(argv)
    torch = not args.no_torch and have_torch()
    configs = configurations(args, torch)
    runs = {key: [] for key, _, _ in configs}
    tmp = tempfile.mkdtemp(prefix="mpidl-scaling-")
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    overlap_trace = None
    try:
        for rep in range(args.repeats):
            for key, n, wargs in configs:
                r = launch(n, wargs, args, tmp, key, rep)
                runs[key].append(r)
                print(f"[{rep + 1}/{args.repeats}] {key}: {r['images_per_sec']:.0f} img/s "
                      f"(median step {r['step_ms_median']:.1f} ms)", flush=True)
                if key == f"mpidl n=2 b={args.batch} overlap" and r.get("timeline_file"):
                    overlap_trace = r["timeline_file"]
        summary = summarize(runs)
        extra = derived(summary, args)
        report = {
            "benchmark": "data-parallel scaling, MLP 784-1024-1024-10",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": machine_info(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "seconds": time.perf_counter() - t_start,
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
            "env": {"threads_per_rank": 1,
                    "MPIR_CVAR_ENABLE_HEAVY_YIELD": None if args.no_yield else "1"},
            "summary": summary,
            "derived": extra,
            "runs": {k: [{kk: vv for kk, vv in r.items() if kk not in ("layout",)}
                         for r in v] for k, v in runs.items()},
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        if overlap_trace and os.path.exists(overlap_trace):
            dst = os.path.join(os.path.dirname(os.path.abspath(args.out)),
                               "timeline_overlap_rank0.json")
            keep_timeline(overlap_trace, dst)
            report["timeline"] = os.path.relpath(dst, ROOT)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print_table(summary, extra)
        png = plot(report, args.plot)
        print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

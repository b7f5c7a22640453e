"""Accuracy against bytes sent: the MLP on Fashion-MNIST, 2 ranks, once per compressor.

Each configuration is one ``mpiexec -n 2 mpidl train`` run (same seed, data, model and
schedule); the dense baseline is the ordinary fused all-reduce. Bytes sent per step and
rank are counted the same way everywhere (what a ring moves: 2 (p-1)/p of an all-reduced
buffer, (p-1)/p of all-gathered payloads), so "x fewer" is dense bytes / compressed bytes.

    python bench/compression.py                      # all, 5 epochs (tens of minutes)
    python bench/compression.py --epochs 1 --only dense,topk,dgc --limit-train 6000
    python bench/compression.py --only onebit --merge   # redo one row, keep the others

Writes bench/results/compression.json (figures, commands, machine) and compression.png
(final test accuracy against bytes per step, log scale). Goals (issue 5): top-k and DGC
at 0.1 % send >= 100x fewer bytes than dense and stay within 1 point of its accuracy;
1-bit with error feedback stays within 1 point. One seed per row: differences of a few
tenths of a point are within run-to-run noise.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

# (key, label, --compression spec or None for dense, --ratio, extra flags)
CONFIGS = [
    ("dense", "dense (fused all-reduce)", None, None, []),
    ("none", "none (through the exchanger)", "none", None, []),
    ("fp16", "fp16", "fp16", None, []),
    # Momentum correction: the memory applies the momentum before compressing, so the
    # optimizer runs without it (--momentum 0).
    ("onebit", "1-bit (2 scales) + momentum corr. + EF", "onebit:momentum=0.9", None,
     ["--momentum", "0"]),
    # tau near the 99.9th percentile of |g| at the start (about 0.03 for this MLP)
    ("threshold", "threshold (Strom), tau 0.02 + EF", "threshold:threshold=0.02", None, []),
    ("topk", "top-k 0.1 % + EF", "topk", 0.001, []),
    ("topk_mc", "top-k 0.1 % + momentum corr., masking", "topk:memory=dgc,momentum=0.9",
     0.001, ["--momentum", "0"]),
    ("dgc", "DGC 0.1 % (momentum corr., masking)", "dgc:momentum=0.9", 0.001,
     ["--momentum", "0"]),
    ("randomk", "random-k 1 %", "randomk", 0.01, []),
    ("qsgd", "QSGD 4-bit (7 levels, buckets of 512)", "qsgd", None, []),
    ("terngrad", "TernGrad", "terngrad", None, []),
    ("powersgd", "PowerSGD rank 2 + EF", "powersgd:rank=2", None, []),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--np", type=int, default=2, help="ranks per run")
    ap.add_argument("--only", default=None,
                    help="comma-separated keys: " + ",".join(c[0] for c in CONFIGS))
    ap.add_argument("--limit-train", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=os.path.join(RESULTS, "compression.json"))
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of --out that this run does not redo")
    return ap.parse_args(argv)


def mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")


def mpidl():
    beside = os.path.join(os.path.dirname(sys.executable), "mpidl")
    return beside if os.path.exists(beside) else shutil.which("mpidl")


def run_one(args, key, spec, ratio, extra, workdir):
    out_dir = os.path.join(workdir, key)
    cmd = [mpiexec(), "-n", str(args.np), mpidl(), "train", "--model", "mlp",
           "--dataset", "fashion-mnist", "--epochs", str(args.epochs), "--seed",
           str(args.seed), "--no-progress", "--out-dir", out_dir]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.limit_train:
        cmd += ["--limit-train", str(args.limit_train)]
    if spec is not None:
        cmd += ["--compression", spec]
    if ratio is not None:
        cmd += ["--ratio", str(ratio)]
    cmd += extra
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{key}: {' '.join(cmd)} exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    epochs = []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                epochs.append(json.loads(line))
    last = epochs[-1]
    per_step = [e["bytes_sent_per_step"] for e in epochs if "bytes_sent_per_step" in e]
    return {"test_acc": last["test_acc"], "test_loss": last.get("test_loss"),
            "train_loss": last.get("train_loss"),
            "bytes_sent_per_step": sum(per_step) / len(per_step) if per_step else None,
            "step_ms": 1e3 * sum(e["epoch_time"] for e in epochs)
            / max(1, sum(1 for _ in epochs)) / max(1, last["step"] // len(epochs)),
            "acc_per_epoch": [e["test_acc"] for e in epochs], "wall_s": wall,
            "command": cmd}


def main(argv=None):
    args = parse_args(argv)
    wanted = None if args.only is None else set(args.only.split(","))
    configs = [c for c in CONFIGS if wanted is None or c[0] in wanted]
    unknown = (wanted or set()) - {c[0] for c in CONFIGS}
    if unknown:
        raise SystemExit(f"unknown configuration(s): {', '.join(sorted(unknown))}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpidl-compression-") as workdir:
        for key, label, spec, ratio, extra in configs:
            print(f"[{key}] {label} ...", flush=True)
            r = run_one(args, key, spec, ratio, extra, workdir)
            r.update(key=key, label=label, compression=spec, ratio=ratio)
            rows.append(r)
            print(f"[{key}] test acc {r['test_acc']:.4f}, "
                  f"{r['bytes_sent_per_step'] or 0:.0f} B/step, {r['wall_s']:.0f} s",
                  flush=True)
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = {r["key"]: r for r in json.load(f)["rows"]}
        old.update({r["key"]: r for r in rows})
        rows = [dict(old[c[0]], label=c[1]) for c in CONFIGS if c[0] in old]
    dense = next((r for r in rows if r["key"] == "dense"), None)
    for r in rows:
        if dense and r["bytes_sent_per_step"]:
            r["x_fewer_bytes"] = dense["bytes_sent_per_step"] / r["bytes_sent_per_step"]
            r["acc_minus_dense"] = r["test_acc"] - dense["test_acc"]
    goals = {}
    if dense:
        for key in ("topk", "topk_mc", "dgc"):
            r = next((x for x in rows if x["key"] == key), None)
            if r:
                goals[key] = {"x_fewer_bytes": r["x_fewer_bytes"],
                              "acc_minus_dense": r["acc_minus_dense"],
                              "met": r["x_fewer_bytes"] >= 100
                              and r["acc_minus_dense"] >= -0.01}
        r = next((x for x in rows if x["key"] == "onebit"), None)
        if r:
            goals["onebit"] = {"acc_minus_dense": r["acc_minus_dense"],
                               "met": r["acc_minus_dense"] >= -0.01}
    print_table(rows)
    for key, g in goals.items():
        print(f"goal {key}: {'met' if g['met'] else 'MISSED'} {g}")
    result = {"benchmark": "compression", "epochs": args.epochs, "ranks": args.np,
              "limit_train": args.limit_train, "seed": args.seed, "rows": rows,
              "goals": goals, "machine": {"cpu": platform.processor() or platform.machine(),
                                          "cores": os.cpu_count(),
                                          "platform": platform.platform()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    plot(rows, os.path.splitext(args.out)[0] + ".png", args)


def print_table(rows):
    print(f"| {'compressor':<40} | test acc | vs dense | bytes/step | x fewer |")
    print(f"|{'-' * 42}|----------|----------|------------|---------|")
    for r in rows:
        d = r.get("acc_minus_dense")
        print(f"| {r['label']:<40} | {100 * r['test_acc']:7.2f}% | "
              f"{'' if d is None else f'{100 * d:+.2f}':>8} | "
              f"{r['bytes_sent_per_step'] or 0:10.0f} | {r.get('x_fewer_bytes', 0):7.1f} |")


def plot(rows, path, args):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows:
        if not r["bytes_sent_per_step"]:
            continue
        ax.scatter(r["bytes_sent_per_step"], 100 * r["test_acc"],
                   color="0.3" if r["key"] in ("dense", "none") else "C0")
        ax.annotate(r["key"], (r["bytes_sent_per_step"], 100 * r["test_acc"]),
                    textcoords="offset points", fontsize=8,
                    xytext=(4, -10) if r["key"] == "none" else (4, 4))
    dense = next((r for r in rows if r["key"] == "dense"), None)
    if dense:
        ax.axhline(100 * dense["test_acc"] - 1, color="C3", lw=1, ls="--",
                   label="dense - 1 point")
        ax.axvline(dense["bytes_sent_per_step"] / 100, color="C2", lw=1, ls=":",
                   label="100x fewer bytes than dense")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step and rank")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"MLP on Fashion-MNIST, {args.np} ranks, {args.epochs} epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Parallax (``--sparse-sync ps``) against plain all-reduce on gpt-tiny: validation loss at
equal samples, and bytes per trainer and step.

    python bench/parallax.py                 # ~35 min here -> bench/results/parallax.json + .png
    python bench/parallax.py --trainers 2 --epochs 2 --limit-train 6400 --modes sync,async
    python bench/parallax.py --quick --data-dir FILE   # a tiny model, seconds (the test's)

Accuracy: ``mpidl train --model gpt-tiny --dataset text`` (its recipe: AdamW, warm-up,
cosine) with the same seed, global batch and steps, on ``--trainers`` W ranks with
``--strategy allreduce`` and on W + 1 ranks with ``--sparse-sync ps`` (1 server, the token
embedding on it), in each ``--modes`` (sync: the same bits as all-reduce; async: each
trainer's rows an update of their own). It reports every run's validation nats per
character, its gap to all-reduce (the goal: within 2 %), and whether the saved models are
the same bits.

Traffic: for each of ``--traffic-trainers`` N, a few steps of all-reduce on N ranks and of
Parallax on N + 1, and the epoch line's counters per trainer and step: the dense buckets'
ring all-reduce (a formula, the same in both), the embedding rows' all-gather (all-reduce)
or the rows pushed to the server and the table pulled back from it (Parallax).

Every run is a real ``mpiexec`` launch on this machine; on 2 shared cores 3+ ranks
oversubscribe, so the seconds in the JSON are not a speed comparison (none is claimed).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402
from mpidl.benchmarks.plotting import pyplot  # noqa: E402
from mpidl.benchmarks.scaling import write_json  # noqa: E402

MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
QUICK_MODEL = ["--layers", "1", "--heads", "2", "--width", "16", "--context", "32"]
COUNTERS = ("bytes_sent_per_step", "allgather_bytes_per_step", "ps_bytes_pushed_per_step",
            "ps_bytes_pulled_per_step")


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train(a, name, ranks, extra):
    """One ``mpidl train`` launch; returns (command as typed, metrics records, seconds,
    saved model path)."""
    out_dir = os.path.join(a.work, name)
    cmd = [mpiexec(), "-n", str(ranks)] + MPIDL + [
        "train", "--model", "gpt-tiny", "--dataset", "text", "--no-progress",
        "--seed", str(a.seed), "--out-dir", out_dir] + a.model_args + extra
    if a.data_dir:
        cmd += ["--data-dir", a.data_dir]
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=launch_env(ROOT), timeout=a.timeout)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"bench/parallax.py: {' '.join(cmd)} failed:\n{proc.stdout[-4000:]}")
    i = cmd.index("train")
    typed = [os.path.relpath(c, ROOT) if c == out_dir else c for c in cmd[i:]]
    shown = shlex.join(["mpiexec", "-n", str(ranks), "mpidl"] + typed)
    print(f"{name}: {seconds:.0f} s", flush=True)
    return shown, records(os.path.join(out_dir, "metrics.jsonl")), seconds, \
        os.path.join(out_dir, "model.npz")


def same_bits(path_a, path_b):
    import numpy as np  # noqa: PLC0415

    with np.load(path_a) as za, np.load(path_b) as zb:
        keys = [k for k in za.files if not k.startswith("__")]
        return sorted(keys) == sorted(k for k in zb.files if not k.startswith("__")) and all(
            np.array_equal(za[k], zb[k]) for k in keys)


def accuracy(a):
    """All-reduce on W ranks, Parallax on W + 1 in each mode: the same samples."""
    common = ["--epochs", str(a.epochs), "--limit-train", str(a.limit_train)]
    if a.limit_test:
        common += ["--limit-test", str(a.limit_test)]
    runs = {}
    cmd, recs, secs, model = train(a, "allreduce", a.trainers, common)
    runs["allreduce"] = {"command": cmd, "ranks": a.trainers, "records": recs,
                         "seconds": secs, "model": model}
    for mode in a.modes:
        name = f"parallax-{mode}"
        cmd, recs, secs, model = train(a, name, a.trainers + 1, common + [
            "--sparse-sync", "ps", "--mode", mode])
        runs[name] = {"command": cmd, "ranks": a.trainers + 1, "records": recs,
                      "seconds": secs, "model": model}
    base = runs["allreduce"]["records"][-1]["test_nats_per_char"]
    out = {}
    for name, r in runs.items():
        last = r["records"][-1]
        nats = last["test_nats_per_char"]
        out[name] = {
            "command": r["command"], "ranks": r["ranks"], "steps": last["step"],
            "global_batch": last["global_batch"], "wall_seconds": round(r["seconds"], 1),
            "valid_nats_per_char": nats, "valid_bits_per_char": last["test_bits_per_char"],
            "valid_next_char_accuracy": last["test_acc"],
            "gap_to_allreduce_percent": 100.0 * (nats - base) / base,
            "within_2_percent": abs(nats - base) <= 0.02 * base,
            "same_bits_as_allreduce": same_bits(r["model"], runs["allreduce"]["model"]),
            "per_epoch": [{k: e.get(k) for k in ("epoch", "step", "train_loss",
                                                   "test_nats_per_char", "elapsed") + COUNTERS
                           if k in e} for e in r["records"]],
            **{k: last[k] for k in COUNTERS + ("mem_optimizer", "ps_updates", "ps_pushed",
                                                "ps_mean_staleness") if k in last},
        }
    return out


def traffic(a):
    """Bytes per trainer and step for N trainers: a few steps of each layout."""
    batch = 4 if a.quick else 16
    rows = []
    for n in a.traffic_trainers:
        extra = ["--epochs", "1", "--limit-train", str(a.traffic_steps * n * batch),
                 "--limit-test", "64"]
        row = {"trainers": n}
        for name, ranks, flags in (("allreduce", n, []),
                                   ("parallax", n + 1, ["--sparse-sync", "ps"])):
            cmd, recs, _, _ = train(a, f"traffic-{name}-{n}", ranks, extra + flags)
            last = recs[-1]
            row[name] = {"command": cmd, **{k: last[k] for k in COUNTERS if k in last}}
        ar, px = row["allreduce"], row["parallax"]
        # the dense buckets' ring all-reduce: the same formula for both layouts
        row["dense_allreduce"] = ar["bytes_sent_per_step"] - ar.get("allgather_bytes_per_step", 0)
        row["allgather_rows"] = ar.get("allgather_bytes_per_step", 0.0)
        row["pushed_rows"] = px["ps_bytes_pushed_per_step"]
        row["pulled_table"] = px["ps_bytes_pulled_per_step"]
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks W (default 2)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit-train", type=int, default=6400,
                   help="training windows per epoch (default 6400: 200 steps at 2 x 16)")
    p.add_argument("--limit-test", type=int, default=0, help="validation windows (0: all)")
    p.add_argument("--modes", default="sync,async", help="Parallax's --mode values to run")
    p.add_argument("--traffic-trainers", default="2,4")
    p.add_argument("--traffic-steps", type=int, default=10)
    p.add_argument("--data-dir", default=None, help="text file or folder (default: fortunes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, seconds (tests)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per launch")
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-parallax"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "parallax.json"))
    p.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    a, rest = p.parse_known_args()
    a.model_args = (QUICK_MODEL + ["--batch-size", "4"] if a.quick else []) + rest
    a.modes = [m for m in a.modes.split(",") if m]
    a.traffic_trainers = [int(n) for n in a.traffic_trainers.split(",") if n]
    t0 = time.perf_counter()
    runs = accuracy(a)
    table = traffic(a)
    result = {
        "benchmark": "Parallax (--sparse-sync ps) against all-reduce on gpt-tiny",
        "trainers": a.trainers, "epochs": a.epochs, "limit_train": a.limit_train,
        "limit_test": a.limit_test or None, "model_args": a.model_args,
        "runs": runs, "traffic": table, "seconds": round(time.perf_counter() - t0, 1),
        "machine": describe_machine(),
    }
    write_json(a.out, result)
    plot(result, a.plot or os.path.splitext(a.out)[0] + ".png")
    for name, r in runs.items():
        print(f"{name:16s} {r['valid_nats_per_char']:.4f} nats/char "
              f"({r['gap_to_allreduce_percent']:+.2f} % vs all-reduce, same bits: "
              f"{r['same_bits_as_allreduce']}), {r.get('bytes_sent_per_step', 0):.0f} B/step")
    for row in table:
        print(f"N={row['trainers']}: dense {row['dense_allreduce']:.0f}, all-gather rows "
              f"{row['allgather_rows']:.0f}; pushed {row['pushed_rows']:.0f}, pulled "
              f"{row['pulled_table']:.0f} B per trainer and step")
    print(f"wrote {a.out}")


def plot(result, path):
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, r), style in zip(result["runs"].items(), ("o-", "x--", "s:")):
        ep = r["per_epoch"]
        left.plot([e["step"] for e in ep], [e["test_nats_per_char"] for e in ep], style,
                  label=f"{name} ({r['ranks']} ranks)")
    left.set_xlabel("step (same global batch)")
    left.set_ylabel("validation nats per character")
    left.set_title("gpt-tiny: all-reduce vs Parallax")
    left.legend()
    table = result["traffic"]
    xs = range(len(table))
    kb = 1e-3
    w = 0.38
    dense = [r["dense_allreduce"] * kb for r in table]
    gather = [r["allgather_rows"] * kb for r in table]
    pushed = [r["pushed_rows"] * kb for r in table]
    pulled = [r["pulled_table"] * kb for r in table]
    right.bar([x - w / 2 for x in xs], gather, w, label="all-reduce: rows all-gathered")
    right.bar([x + w / 2 for x in xs], pushed, w, label="Parallax: rows pushed")
    right.bar([x + w / 2 for x in xs], pulled, w, bottom=pushed,
              label="Parallax: table pulled (received)")
    right.set_xticks(list(xs))
    right.set_xticklabels([f"{r['trainers']} trainers\n(dense all-reduce: {d:.0f} kB)"
                           for r, d in zip(table, dense)])
    right.set_ylabel("kB per trainer and step")
    right.set_title("the embedding's traffic")
    top = max([g for g in gather] + [a + b for a, b in zip(pushed, pulled)] + [1e-9])
    right.set_ylim(0, 1.45 * top)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()

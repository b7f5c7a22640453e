"""Does compression pay off, and below which link rate? Measured on the virtual cluster,
predicted by ``mpidl simulate`` (issue 18, point 6).

    sudo python bench/compression_link.py                      # 1gbit and 10gbit links
    sudo python bench/compression_link.py --rates 250mbit --append   # one more rate

For each link rate, ``slurm/vcluster.sh`` brings up 2 nodes (one rank each, links limited
by ``tbf``; taken down at the end if this script made it), then:

1. ``mpidl simulate --calibrate`` measures the cluster (latency and bandwidth between
   the nodes, the mlp's compute per layer);
2. ``mpidl train`` trains the mlp on Fashion-MNIST dense (all-reduce), with DGC at 0.1 %
   (``--compression dgc --ratio 0.001``: momentum correction, the optimizer's momentum
   taken over) and with 1-bit (``--compression onebit``), the same seed, data and
   schedule; ``--overlap off`` for all (what the prediction assumes on CPU). Each epoch
   is a slice of ``--limit-train`` images followed by an evaluation on the 10 000 test
   images, so the time to the target accuracy (85 %) is read off the accuracy curve over
   the training time (the sum of the epochs' ``epoch_time``: evaluations excluded),
   linearly between epochs;
3. ``mpidl simulate --compression ...`` on the calibrated machine predicts each step time
   at the measured link, and over a sweep of link rates (``--beta-inter``) the rate
   below which each compressor's step is faster than the dense one (``crossover``); with
   the steps each run needed to reach the target, the rate below which it reaches the
   target sooner (``crossover_to_target``).

Results: ``bench/results/compression_link.json`` and ``.png`` (predicted step time over
the link rate, the measured steps as points). Root is needed for the namespaces.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

VCLUSTER = os.path.join(ROOT, "slurm", "vcluster.sh")
STATE = os.environ.get("MPIDL_VCLUSTER_STATE", "/run/mpidl-vcluster")
RUNS = {
    "dense": [],
    "dgc 0.1%": ["--compression", "dgc", "--ratio", "0.001"],
    "onebit": ["--compression", "onebit"],
}
RATES_GBIT = [0.05 * 2 ** (k / 2) for k in range(21)]  # 0.05 .. 51 Gbit/s


def gbit(rate):
    """``1gbit`` -> 1.0, ``100mbit`` -> 0.1."""
    r = rate.lower()
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if r.endswith(unit):
            return float(r[:-len(unit)]) * scale
    raise SystemExit(f"rate {rate!r}: give a tbf rate such as 1gbit or 100mbit")


def env():
    from mpidl.benchmarks.machine import bench_env

    return bench_env(ROOT, "mpidl-bench-no-tuning")


def run(cmd, timeout=1800):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout,
                       cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}"
                         f"{r.stderr[-3000:]}")
    return r.stdout


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def across_nodes(cmd):
    return ["bash", VCLUSTER, "mpiexec", "-n", "2", "-ppn", "1"] + cmd


MPIDL = [sys.executable, "-m", "mpidl.cli.main"]


def common(a):
    return ["--model", "mlp", "--batch-size", str(a.batch), "--overlap", "off",
            "--seed", "0"]


def time_to(curve, target):
    """(training seconds, steps) when the accuracy curve first reaches ``target``,
    linearly between epochs; None if it never does."""
    prev = (0.0, 0, 0.0)
    for t, steps, acc in curve:
        if acc >= target:
            t0, s0, a0 = prev
            f = 1.0 if acc == a0 else (target - a0) / (acc - a0)
            return t0 + f * (t - t0), s0 + f * (steps - s0)
        prev = (t, steps, acc)
    return None


def train(a, flags, out_dir):
    cmd = across_nodes(MPIDL + ["train", *common(a), "--epochs", str(a.epochs),
                                "--limit-train", str(a.limit_train), "--no-progress",
                                "--out-dir", out_dir, *flags])
    t = time.time()
    lines = [r for r in json_lines(run(cmd)) if "test_acc" in r]
    curve, total, steps = [], 0.0, 0
    for r in lines:
        total += r["epoch_time"]
        steps = r["step"]
        curve.append((total, steps, r["test_acc"]))
    reached = time_to(curve, a.target)
    return {"command": " ".join(["mpidl", "train", *common(a), *flags]),
            "curve": curve, "final_acc": curve[-1][2], "train_s": total,
            "step_s": total / max(steps, 1), "steps": steps,
            "bytes_sent_per_step": lines[-1].get("bytes_sent_per_step"),
            "time_to_target_s": reached and reached[0],
            "steps_to_target": reached and reached[1], "launch_s": time.time() - t}


def predict(a, machine, flags, beta_inter=None):
    cmd = MPIDL + ["simulate", *common(a), "--machine", machine, "--ranks", "2",
                   "--ranks-per-node", "1", "--limit-train", str(a.limit_train), "--json",
                   *flags]
    if beta_inter is not None:
        cmd += ["--beta-inter", repr(beta_inter)]
    row = json_lines(run(cmd))[-1]["predictions"][-1]
    return {"step_s": row["step_s"], "time_s": row["time_s"],
            "bytes_per_step": row["bytes_per_step"]}


def crossover(rates, dense, other):
    """The link rate (Gbit/s) below which ``other`` is faster than ``dense``: where the
    difference changes sign, interpolated on the log of the rate; None if it never does
    in the sweep."""
    diff = [o - d for d, o in zip(dense, other)]
    for (r0, d0), (r1, d1) in zip(zip(rates, diff), zip(rates[1:], diff[1:])):
        if d0 < 0 <= d1:
            f = -d0 / (d1 - d0)
            return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    return None


def one_rate(a, rate, work):
    made = not os.path.exists(os.path.join(STATE, "nodes"))
    if made:
        subprocess.run(["bash", VCLUSTER, "up", "2", rate], check=True)
    else:
        with open(os.path.join(STATE, "rate")) as f:
            if f.read().strip() != rate:
                raise SystemExit(f"a virtual cluster with other links is up: take it down "
                                 f"(bash {VCLUSTER} down) first")
    try:
        machine = os.path.join(work, f"machine-{rate}.json")
        print(f"{rate}: calibrating", flush=True)
        calib = json_lines(run(across_nodes(MPIDL + [
            "simulate", "--calibrate", *common(a), "--limit-train", "1024",
            "--fused-optimizer", "off", "--machine", machine, "--json"])))[-1]
        out = {"rate": rate, "rate_gbit": gbit(rate), "calibrated": calib, "runs": {}}
        for name, flags in RUNS.items():
            print(f"{rate}: training {name}", flush=True)
            out["runs"][name] = train(a, flags, os.path.join(work, f"{rate}-{name.split()[0]}"))
        return predict_rate(a, out, machine)
    finally:
        if made:
            subprocess.run(["bash", VCLUSTER, "down"], check=True)


def predict_rate(a, out, machine):
    """The predictions of one rate's entry ``out`` (its runs measured): each run's step,
    the sweep over link rates and the crossovers, on the calibrated ``machine`` file."""
    for name, flags in RUNS.items():
        r = out["runs"][name]
        r["predicted"] = predict(a, machine, flags)
        print(f"  {out['rate']} {name}: step {1e3 * r['step_s']:.1f} ms (predicted "
              f"{1e3 * r['predicted']['step_s']:.1f}), final acc {r['final_acc']:.4f}, "
              f"to {a.target:.0%}: {r['time_to_target_s']} s", flush=True)
    sweep = {name: [predict(a, machine, flags, 8e-9 / g)["step_s"] for g in RATES_GBIT]
             for name, flags in RUNS.items()}
    out["sweep"] = {"rates_gbit": RATES_GBIT, "step_s": sweep}
    dense = out["runs"]["dense"]
    for name in RUNS:
        if name == "dense":
            continue
        r = out["runs"][name]
        r["crossover_gbit"] = crossover(RATES_GBIT, sweep["dense"], sweep[name])
        if r["steps_to_target"] and dense["steps_to_target"]:
            ratio = r["steps_to_target"] / dense["steps_to_target"]
            r["steps_ratio_to_dense"] = ratio
            r["crossover_to_target_gbit"] = crossover(
                RATES_GBIT, sweep["dense"], [ratio * s for s in sweep[name]])
        if r["time_to_target_s"] and dense["time_to_target_s"]:
            r["speedup_to_target"] = dense["time_to_target_s"] / r["time_to_target_s"]
    return out


def plot(result, path):
    from mpidl.benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"dense": "C0", "dgc 0.1%": "C1", "onebit": "C2"}
    first = min(result["rates"], key=lambda r: r["rate_gbit"])
    for name, ys in first["sweep"]["step_s"].items():
        ax.plot(first["sweep"]["rates_gbit"], [1e3 * y for y in ys], color=colors[name],
                label=f"{name}, predicted")
    for r in result["rates"]:
        for name, run_ in r["runs"].items():
            ax.plot([r["rate_gbit"]], [1e3 * run_["step_s"]], "o", color=colors[name])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link between the nodes (Gbit/s)")
    ax.set_ylabel("step time (ms); points: measured")
    ax.set_title("mlp, 2 nodes x 1 rank: dense against compressed exchange")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--limit-train", type=int, default=20000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--out", default=os.path.join(HERE, "results", "compression_link.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "results", "compression_link.png"))
    p.add_argument("--append", action="store_true",
                   help="add these rates to the rates of --out (same settings)")
    p.add_argument("--repredict", action="store_true",
                   help="predict the runs of --out again with today's model, from the "
                   "calibrations stored in it (nothing is measured; no root needed)")
    a = p.parse_args()
    if a.repredict:
        return repredict(a)
    if os.geteuid() != 0:
        raise SystemExit("the virtual cluster needs root: sudo python bench/compression_link.py")
    from mpidl.benchmarks.machine import describe

    result = {"what": "dense all-reduce against DGC 0.1 % and 1-bit on the virtual cluster "
                      "(2 nodes x 1 rank), measured and predicted; see the script's doc",
              "machine": describe(), "epochs": a.epochs, "limit_train": a.limit_train,
              "batch_per_rank": a.batch, "target": a.target, "rates": []}
    if a.append and os.path.exists(a.out):
        with open(a.out) as f:
            before = json.load(f)
        keys = ("epochs", "limit_train", "batch_per_rank", "target")
        if any(before[k] != result[k] for k in keys):
            raise SystemExit(f"--append: {a.out} was made with other settings "
                             f"({', '.join(f'{k} {before[k]}' for k in keys)})")
        result["rates"] = before["rates"]
    with tempfile.TemporaryDirectory(prefix="mpidl-compression-link-") as work:
        for rate in a.rates.split(","):
            result["rates"].append(one_rate(a, rate, work))
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
    summarize(a, result)
    print(f"wrote {a.out}", flush=True)


def repredict(a):
    """``--repredict``: the stored runs of ``--out`` predicted again; rewritten in place,
    ``repredicted`` saying when."""
    with open(a.out) as f:
        result = json.load(f)
    a.batch, a.limit_train, a.target = (result["batch_per_rank"], result["limit_train"],
                                        result["target"])
    with tempfile.TemporaryDirectory(prefix="mpidl-compression-link-") as work:
        for entry in result["rates"]:
            machine = os.path.join(work, f"machine-{entry['rate']}.json")
            with open(machine, "w") as f:
                json.dump(entry["calibrated"], f)
            predict_rate(a, entry, machine)
    result["repredicted"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    summarize(a, result)
    print(f"rewrote {a.out}", flush=True)


def summarize(a, result):
    plot(result, a.plot)
    for r in result["rates"]:
        for name, run_ in r["runs"].items():
            print(f"{r['rate']:>7} {name:>9}: {1e3 * run_['step_s']:6.1f} ms/step (predicted "
                  f"{1e3 * run_['predicted']['step_s']:6.1f}), to {a.target:.0%} "
                  f"{run_['time_to_target_s']} s"
                  + ("" if name == "dense" else
                     f", {run_.get('speedup_to_target')}x dense; predicted to win per step "
                     f"below {run_.get('crossover_gbit')} Gbit/s, to the target below "
                     f"{run_.get('crossover_to_target_gbit')} Gbit/s"), flush=True)


if __name__ == "__main__":
    main()

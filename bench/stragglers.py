"""Stragglers handled without losing synchrony: time to 85 % test accuracy.

    python bench/stragglers.py        # -> bench/results/stragglers.json + stragglers.png

Two questions, on the MLP and Fashion-MNIST with 3 workers of batch 128 (a global batch
of 384), SGD lr 0.05 momentum 0.9:

1. One persistent straggler (the last worker 2x, then 4x slower): how much sooner does
   ``--deal portions`` (the global batch cut into 32-sample portions dealt to whichever
   worker is free; synchronous updates, the same mean gradient) reach the target than
   plain synchronous PS and all-reduce, which wait for the straggler every step?
2. Transient stragglers (every step, each worker 4x slower with probability 0.1,
   seeded): how much sooner does SSP (s = 1 and 4; async's settings: momentum 0, lr
   0.15 with 3 workers, a quarter-epoch warm-up) reach it than synchronous PS?

``--workers W`` changes the number of workers (W + 1 ranks with the server); keep the
global batch ``W * --batch`` near 384 to compare with the 3-worker run. SSP's rate then
follows the README's recipe for async (the same step per sample as sync's): 0.15 * 3 / W
unless ``--ssp-lr`` is given. The JSON also holds the bounds that the emulated
speeds alone set (``bounds``): dealt against sync with one F-times straggler,
(F (W - 1) + 1) / W, and SSP against sync under transient stragglers, sync's mean
step (the slowest of W) over one worker's mean step.

Compute is emulated: 4 ranks share this machine's 2 cores, so real compute times would
measure the contention, not the method. Each step (or portion) still computes its real
gradients, then sleeps until it has taken ``--pace`` seconds per sample times its
straggler factor (``compute_pace``, ``mpidl/runtime/schedule.py``); the pace is set well
above the contended real compute, so every worker's compute time is what it would be
on its own core. Communication and the servers' updates are real. Whether the real
compute did stay under the pace is checked, not assumed: each run's ``pace`` entry
counts the computations (steps, or dealt portions) whose real compute took longer than
their paced time (``over_pace``, of ``paced``, over all workers) and the largest real
compute over the pace (``worst_ratio``); a run with any overrun gets a note in
``notes`` (printed too), as its times are then partly those of the contended machine.

Each configuration runs ``bench/ps.py _run`` (the trainer, the server keeping a copy of
the parameters every ``--every`` seconds, evaluated on the test set afterwards; all-reduce:
the first worker keeps them). The figures to quote are ratios of times to target
measured in the same run.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from ps import fmt, run_one  # noqa: E402

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402

DEALT = {"mode": "sync", "deal": "portions", "poll_max_ms": 0.1}  # portion_size from --portion-size
SSP_MOMENTUM = ["--momentum", "0"]  # plus --ssp-lr and a quarter-epoch warm-up

# key, ps options (None: all-reduce), persistent factor, transient spec
RUNS = [(f"{name}{'' if f == 1 else f'+{f:g}x'}", opts, f, None)
        for f in (1.0, 2.0, 4.0)
        for name, opts in (("allreduce", None), ("ps-sync", {"mode": "sync"}),
                           ("ps-dealt", DEALT))]
RUNS += [(f"{name}+transient", opts, 1.0, "transient:4:0.1:1")
         for name, opts in (("ps-sync", {"mode": "sync"}), ("ssp-1", {"mode": "ssp",
                                                                      "staleness": 1}),
                            ("ssp-4", {"mode": "ssp", "staleness": 4}))]


def run(a, key, opts, factor, transient):
    out = os.path.join(a.work, f"{key}.json")
    n = a.workers + (0 if opts is None else 1)
    epochs = a.transient_epochs if transient and a.transient_epochs else a.epochs
    args = [os.path.join(HERE, "ps.py"), "_run", "--out", out, "--epochs", epochs,
            "--batch", a.batch, "--lr", a.lr, "--every", a.every, "--seed", a.seed,
            "--model", "mlp", "--straggler", factor, "--pace", a.pace,
            "--test-limit", a.test_limit, "--limit-train", a.limit_train]
    if transient:
        args += ["--transient", transient]
    if opts is not None:
        if opts.get("mode") == "ssp":
            steps = (a.limit_train or 60000) // (a.batch * a.workers)
            args += SSP_MOMENTUM + ["--lr", ssp_lr(a), "--warmup-steps", steps // 4]
        if opts.get("deal"):
            opts = dict(opts, portion_size=a.portion_size)
        args += ["--ps", json.dumps(opts)]
    if a.data_dir:
        args += ["--data-dir", a.data_dir]
    load = os.getloadavg()[0]
    r = run_one(n, args, out, os.path.join(a.work, f"{key}.log"), a.target, a.timeout)
    r.pop("ranks", None)
    r["load_before"] = round(load, 2)  # 1-minute load average before the launch
    r["epochs"] = epochs
    return r


def ssp_lr(a):
    """SSP's rate: ``--ssp-lr``, else the 3-worker setting 0.15 scaled to the same step
    per sample with W workers (each push is one worker's batch: README, async's recipe)."""
    return a.ssp_lr if a.ssp_lr else round(0.15 * 3 / a.workers, 4)


def pace_note(key, r):
    """A line for a run whose real compute overran the emulated pace, else None."""
    p = r.get("pace")
    if not p or p["kept"]:
        return None
    return (f"{key}: the pace was not kept: {p['over_pace']} of {p['paced']} computations "
            f"took longer than their paced time (real compute up to "
            f"{p['worst_ratio']:.2f}x the pace); its times are partly the contended "
            "machine's")


def bounds(workers, factors=(2.0, 4.0), transient=(4.0, 0.1)):
    """What the emulated compute alone allows (no communication, perfect sharing):
    dealt / sync with one F-times straggler, and SSP (unbounded slack) / sync under
    transient stragglers F with probability q (sync waits for the slowest of W)."""
    w = workers
    out = {f"dealt vs sync, {f:g}x straggler": (f * (w - 1) + 1) / w for f in factors}
    f, q = transient
    sync_step = 1 + (f - 1) * (1 - (1 - q) ** w)  # E[max of W factors]
    out["sync's mean step, transient (units of one step)"] = sync_step
    out["ssp vs sync, transient, unbounded slack"] = sync_step / (1 + (f - 1) * q)
    return out


def ratios(runs):
    """time to target of the slower method / the faster one, in each comparison."""
    out = {}

    def ratio(slow, fast):
        ts, tf = (runs.get(k, {}).get("time_to_target_s") for k in (slow, fast))
        if ts and tf:
            out[f"{slow} / {fast}"] = ts / tf
        ws, wf = (runs.get(k, {}).get("wall_s") for k in (slow, fast))
        if ws and wf:  # the whole run's wall time: less noisy than a crossing time
            out[f"{slow} / {fast}, all epochs"] = ws / wf

    for tag in ("+2x", "+4x"):
        ratio(f"ps-sync{tag}", f"ps-dealt{tag}")
        ratio(f"allreduce{tag}", f"ps-dealt{tag}")
    ratio("ps-sync", "ps-dealt")
    for s in ("ssp-1", "ssp-4"):
        ratio("ps-sync+transient", f"{s}+transient")
    return out


def plot(results, path, target):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    runs = results["runs"]
    panels = [("no straggler", ""), ("last worker 2x slower", "+2x"),
              ("last worker 4x slower", "+4x"), ("transient: 4x with p = 0.1", "+transient")]
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 4.6), sharey=True)
    for ax, (title, tag) in zip(axes, panels):
        for key, r in runs.items():
            if (key.endswith(tag) if tag else "+" not in key):
                t, acc = zip(*r["curve"])
                ax.plot(t, acc, marker=".", ms=3, label=key.split("+")[0])
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(f"{title} ({results['settings']['workers']} workers)")
        ax.set_xlabel("seconds (emulated compute)")
        ax.set_ylim(max(0.5, target - 0.15), None)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("test accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--transient-epochs", type=int, default=None, help="epochs of the "
                    "transient-straggler runs (default: --epochs; SSP needs more samples "
                    "than sync to reach the target)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--pace", type=float, default=4e-4, help="emulated compute, seconds "
                    "per sample (real compute here: about 1.5e-4 on an idle core)")
    ap.add_argument("--portion-size", type=int, default=32, help="--deal portions: "
                    "samples per portion")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between snapshots")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N "
                    "test images (0: all 10000)")
    ap.add_argument("--limit-train", type=int, default=0, help="train on the first N "
                    "training images (0: all 60000; for quick checks)")
    ap.add_argument("--ssp-lr", type=float, default=None, help="SSP's learning rate "
                    "(default: 0.15 * 3 / workers, the 3-worker rate at the same step per "
                    "sample)")
    ap.add_argument("--only", default=None, help="comma-separated run keys")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-stragglers"))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "stragglers.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "results", "stragglers.png"))
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    only = set(a.only.split(",")) if a.only else None
    results = {"machine": describe_machine(), "settings": dict(vars(a), ssp_lr=ssp_lr(a)),
               "runs": {}}
    if only and os.path.exists(a.out):
        with open(a.out) as f:
            results["runs"] = json.load(f).get("runs", {})
    for key, opts, factor, transient in RUNS:
        if only and key not in only:
            continue
        r = results["runs"][key] = run(a, key, opts, factor, transient)
        print(f"{key:22s} final acc {r['final_acc']:.4f}  to {a.target:.2f}: "
              f"{fmt(r['time_to_target_s'])}  ({r['launch_s']:.0f} s)", flush=True)
        if pace_note(key, r):
            print(f"  note: {pace_note(key, r)}", flush=True)
    results["ratios"] = ratios(results["runs"])
    results["bounds"] = bounds(a.workers)
    results["notes"] = [n for n in (pace_note(k, r) for k, r in results["runs"].items())
                        if n]
    for k, v in results["ratios"].items():
        print(f"  {k}: {v:.2f}x")
    for k, v in results["bounds"].items():
        print(f"  bound, {k}: {v:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot, a.target)


if __name__ == "__main__":
    main()

"""Mixed precision: test accuracy of fp32, bf16 and fp16 after the models' 10-epoch
recipes, and the CPU cost of emulating the low precisions.

    python bench/precision.py                        # -> bench/results/precision.json
    python bench/precision.py --models mlp --out F   # some models only (merged into F)
    python bench/precision.py --cost-only            # only the step-time comparison

Accuracy: one process per (model, format), ``mpidl train --model M --precision F`` with
the model's recipe and seed 0 on Fashion-MNIST; the final epoch's line is kept (test
accuracy, loss scale and skipped steps for fp16), under ``runs_<epochs>_epochs`` with
the machine it ran on. Runs of other models or epoch counts already in the output file
are kept, so models can be run as separate jobs, on other days.

Cost: forward + backward + update of one batch (128) on one process, the formats
interleaved step by step (fp32, bf16, fp16, fp32, ...) so that a shared machine's drift
hits them alike; the median step time of each and its ratio to fp32's. On CPU the low
precisions compute in float32 and add the rounding passes (bfloat16: integer operations
on the float32 bits; float16: NumPy's casts), so they are slower, never faster: the
speed of mixed precision is a GPU's tensor cores, which this machine does not have.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env  # noqa: E402

FORMATS = ("fp32", "bf16", "fp16")


def train(model, fmt, out_dir, epochs):
    cmd = [sys.executable, "-m", "mpidl", "train", "--no-progress", "--model", model,
           "--precision", fmt, "--epochs", str(epochs), "--out-dir", out_dir]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=launch_env(ROOT), cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    last = lines[-1]
    keep = ("epoch", "test_acc", "test_loss", "train_loss", "images_per_sec",
            "loss_scale", "skipped_steps", "skipped_steps_total")
    return {"model": model, "precision": fmt, **{k: last[k] for k in keep if k in last},
            "test_acc_per_epoch": [r["test_acc"] for r in lines], "wall_s": wall,
            "command": " ".join(["mpidl"] + cmd[3:-2])}


def step_cost(model_name, steps):
    """Median ms per step of each format, interleaved (module doc)."""
    import numpy as np  # noqa: PLC0415

    from mpidl.engine import SGD, SoftmaxCrossEntropy, build_model  # noqa: PLC0415
    from mpidl.runtime import build  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 128)
    rts = {}
    for fmt in FORMATS:
        model = build_model(model_name)
        rt = build("local", None, precision=fmt)
        rt.setup(model, SGD(model.named_parameters(), lr=0.01, momentum=0.9),
                 SoftmaxCrossEntropy())
        rt.train_step(x, y)  # warm-up
        rts[fmt] = rt
    times = {fmt: [] for fmt in FORMATS}
    for _ in range(steps):
        for fmt in FORMATS:
            t = time.perf_counter()
            rts[fmt].train_step(x, y)
            times[fmt].append(time.perf_counter() - t)
    med = {fmt: 1e3 * float(np.median(v)) for fmt, v in times.items()}
    return {"model": model_name, "batch": 128, "steps": steps,
            "median_step_ms": med,
            "ratio_to_fp32": {fmt: med[fmt] / med["fp32"] for fmt in FORMATS}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--cost-steps", type=int, default=30)
    ap.add_argument("--cost-only", action="store_true")
    ap.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "precision"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "precision.json"))
    args = ap.parse_args()
    models = args.models.split(",")
    report = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            report = json.load(f)
    key = f"runs_{args.epochs}_epochs"
    report.setdefault(key, [])
    report.setdefault("cost", [])
    machine = describe_machine()
    for model in models:
        if not args.cost_only:
            for fmt in FORMATS:
                run = train(model, fmt, os.path.join(args.runs_dir, f"{model}-{fmt}"),
                            args.epochs)
                run["machine"] = machine
                print(json.dumps({k: run[k] for k in ("model", "precision", "test_acc")}),
                      flush=True)
                report[key] = [r for r in report[key]
                               if (r["model"], r["precision"]) != (model, fmt)] + [run]
        cost = step_cost(model, args.cost_steps)
        cost["machine"] = machine
        print(json.dumps(cost), flush=True)
        report["cost"] = [c for c in report["cost"] if c["model"] != model] + [cost]
    for name, runs in report.items():
        if name.startswith("runs_"):
            fp32 = {r["model"]: r["test_acc"] for r in runs if r["precision"] == "fp32"}
            for r in runs:
                if r["model"] in fp32:
                    r["points_vs_fp32"] = 100 * (r["test_acc"] - fp32[r["model"]])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

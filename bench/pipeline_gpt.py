"""gpt-tiny trained as a 2-stage pipeline against data parallelism, at equal samples.

    python bench/pipeline_gpt.py                 # -> bench/results/pipeline_gpt.json + .png
    python bench/pipeline_gpt.py --epochs 1 --limit-train 4096 --out /tmp/pp_gpt.json

Three runs of ``mpidl train --model gpt-tiny --dataset text`` on 2 ranks (the model's
recipe: AdamW, warm-up, cosine schedule; Debian's fortunes), each taking global batches
of 32 windows for the same steps:

* data parallelism, seed 0 and seed 1 (16 windows per rank): the spread between the two
  seeds is the noise a validation loss has at this budget;
* ``--pipeline-stages 2 --micro-batches 4 --batch-size 8`` (1F1B), seed 0: the same
  global batch per step as one replica of two stages;
* the same with ``--schedule async`` (PipeDream-2BW: no flush, each step's gradient
  applied a step later): what the staleness costs in loss, and what the flush costs in
  time.

The pipeline "reaches the same validation loss" when its final validation loss is within
the two seeds' spread (at least 0.01 nats, the noise floor of a shorter run) of data
parallelism's seed-0 run. The JSON holds the per-epoch validation losses, the training
seconds per step of each layout (evaluation excluded), the commands and the machine;
the PNG the validation curves and the time per step side by side. Both layouts share the
2 cores, so seconds per step compare the layouts on this machine only.
"""

import argparse
import json
import os
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpt import shown, train  # noqa: E402

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402

GLOBAL_BATCH = 32
LAYOUTS = {
    "dp_seed0": (0, ["--batch-size", str(GLOBAL_BATCH // 2)]),
    "dp_seed1": (1, ["--batch-size", str(GLOBAL_BATCH // 2)]),
    "pp2_seed0": (0, ["--pipeline-stages", "2", "--schedule", "1f1b", "--micro-batches", "4",
                      "--batch-size", str(GLOBAL_BATCH // 4)]),
    "pp2_async_seed0": (0, ["--pipeline-stages", "2", "--schedule", "async",
                            "--micro-batches", "4", "--batch-size", str(GLOBAL_BATCH // 4)]),
}


def seconds_per_step(recs):
    return sum(r["epoch_time"] for r in recs) / recs[-1]["step"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit-train", type=int, default=8192, help="training windows")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results", "pipeline_gpt.json"))
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="extra flags for the model (e.g. --layers 2)")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-pipeline-gpt-")
    runs = {}
    for name, (seed, flags) in LAYOUTS.items():
        args = SimpleNamespace(ranks=2, seed=seed, data_dir=a.data_dir,
                               model_args=a.model_args)
        extra = ["--epochs", str(a.epochs), "--limit-train", str(a.limit_train), *flags]
        cmd, recs, wall, _ = train(args, work, name, extra, timeout=7200)
        runs[name] = {"command": shown(cmd, 2), "wall_seconds": round(wall, 1),
                      "steps": recs[-1]["step"], "seconds_per_step": seconds_per_step(recs),
                      "valid_nats_per_char": [r["test_nats_per_char"] for r in recs],
                      "train_loss": [r["train_loss"] for r in recs]}
        print(f"{name}: {recs[-1]['step']} steps, valid {recs[-1]['test_nats_per_char']:.4f} "
              f"nats/char, {runs[name]['seconds_per_step'] * 1e3:.1f} ms/step", flush=True)
    dp, dp1, pp, pp_async = (runs[k]["valid_nats_per_char"][-1] for k in LAYOUTS)
    noise = max(abs(dp - dp1), 0.01)
    result = {
        "benchmark": "gpt-tiny: 2-stage pipeline (1F1B, 4 micro-batches of 8) against data "
                     "parallelism (2 x 16) at a global batch of 32, equal samples",
        "epochs": a.epochs, "limit_train": a.limit_train, "global_batch": GLOBAL_BATCH,
        "runs": runs,
        "valid_dp_seed0": dp, "valid_dp_seed1": dp1, "valid_pipeline": pp,
        "seed_spread": abs(dp - dp1), "noise": noise, "pipeline_minus_dp": pp - dp,
        "same_within_noise": abs(pp - dp) <= noise,
        "pipeline_step_over_dp_step": runs["pp2_seed0"]["seconds_per_step"]
        / runs["dp_seed0"]["seconds_per_step"],
        "valid_async": pp_async, "async_minus_dp": pp_async - dp,
        "async_step_over_1f1b_step": runs["pp2_async_seed0"]["seconds_per_step"]
        / runs["pp2_seed0"]["seconds_per_step"],
        "note": "2 ranks on 2 cores; seconds per step exclude evaluation",
        "machine": describe_machine(),
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(a.out)[0] + ".png")
    print(f"pipeline {pp:.4f} vs data parallel {dp:.4f} nats/char (seed spread "
          f"{abs(dp - dp1):.4f}): {'same' if result['same_within_noise'] else 'DIFFERENT'} "
          f"within noise {noise:.4f}; time per step pipeline / data parallel "
          f"{result['pipeline_step_over_dp_step']:.2f}")
    print(f"async (PipeDream-2BW) {pp_async:.4f} nats/char ({pp_async - dp:+.4f} from data "
          f"parallel); time per step async / 1f1b {result['async_step_over_1f1b_step']:.2f}")
    print(f"wrote {a.out}")


def plot(result, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    labels = {"dp_seed0": "data parallel 2 (seed 0)", "dp_seed1": "data parallel 2 (seed 1)",
              "pp2_seed0": "pipeline 2 stages, 1F1B (seed 0)",
              "pp2_async_seed0": "pipeline 2 stages, async (seed 0)"}
    for name, run in result["runs"].items():
        ys = run["valid_nats_per_char"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=labels[name])
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation nats per character")
    ax.set_title(f"gpt-tiny, global batch {result['global_batch']}, equal samples")
    ax.legend()
    names = list(result["runs"])
    bx.bar([labels[n].split(" (")[0] + ("" if n != "dp_seed1" else " s1") for n in names],
           [result["runs"][n]["seconds_per_step"] * 1e3 for n in names],
           color=["C0", "C1", "C2", "C3"][:len(names)])
    bx.set_ylabel("training ms per step (2 ranks, 2 cores)")
    bx.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

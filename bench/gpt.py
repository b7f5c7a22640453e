"""gpt-tiny learns English: validation nats/bits per character against a character bigram.

    python bench/gpt.py                      # 15 minutes on 2 ranks -> bench/results/gpt_tiny.json
    python bench/gpt.py --minutes 5 --ranks 2 --out /tmp/gpt.json
    python bench/gpt.py --quick --data-dir FILE   # a tiny model for a few seconds (the test's)

Trains ``mpidl train --model gpt-tiny --dataset text`` (the model's recipe: AdamW, warm-up
and cosine schedule; the default corpus is Debian's fortunes) with ``mpiexec -n RANKS``
for a budget of wall-clock time. The budget becomes a number of steps, so the learning
rate schedule ends where the budget does: a short calibration run measures the seconds
per step (evaluation included), then the full run takes ``epochs`` passes over the first
``limit_train`` training windows, as many windows as fit (the whole training text when
the budget allows). It then scores the add-alpha character bigram (``mpidl.data.text``:
alpha picked on held-out training text) on exactly the validation characters the model
is scored on, and asks ``mpidl sample`` for text. The JSON holds both losses, the
improvement over the bigram, the sample, the commands and the machine; the PNG the
validation loss per epoch beside the bigram's.
"""

import argparse
import json
import math
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

MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
QUICK_MODEL = ["--layers", "1", "--heads", "2", "--width", "16", "--context", "32"]


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train(a, work, name, extra, timeout):
    """Run mpidl train on ``a.ranks`` ranks; returns (command, metrics records, seconds)."""
    out_dir = os.path.join(work, name)
    cmd = ([mpiexec(), "-n", str(a.ranks)] if a.ranks > 1 else []) + MPIDL + [
        "train", "--model", "gpt-tiny", "--dataset", "text", "--no-progress",
        "--seed", str(a.seed), "--out-dir", out_dir] + a.model_args + extra
    if a.data_dir:
        cmd += ["--data-dir", a.data_dir]
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=launch_env(ROOT), timeout=timeout)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"bench/gpt.py: {' '.join(cmd)} failed:\n{proc.stdout[-4000:]}")
    return cmd, records(os.path.join(out_dir, "metrics.jsonl")), seconds, out_dir


def plan(budget_s, sec_per_step, start_s, eval_s, windows, global_batch):
    """(epochs, limit_train): about ``budget_s`` of training at ``sec_per_step`` (plus
    ``start_s`` once and ``eval_s`` per epoch), over as many of the ``windows`` training
    windows as fit."""
    full = math.ceil(windows / global_batch)
    epochs = 1
    for _ in range(3):  # the evaluations' time depends on the epochs, and back
        steps = max(1, int((budget_s - start_s - epochs * eval_s) / sec_per_step))
        epochs = max(1, math.ceil(steps / full))
    limit = min(windows, max(global_batch, (steps // epochs) * global_batch))
    return epochs, limit


def shown(cmd, ranks):
    """The command as a user types it (mpiexec and mpidl from the venv's PATH)."""
    i = cmd.index("train")
    return shlex.join((["mpiexec", "-n", str(ranks)] if ranks > 1 else []) + ["mpidl"] + cmd[i:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget (default 15)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--data-dir", default=None, help="text file or folder (default: fortunes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="The ")
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--quick", action="store_true", help="tiny model, a few seconds (tests)")
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-gpt"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpt_tiny.json"))
    p.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    a, rest = p.parse_known_args()
    a.model_args = (QUICK_MODEL if a.quick else []) + rest  # e.g. --width 192 --layers 6
    if a.quick:
        a.minutes = min(a.minutes, 0.3)
    from mpidl.cli.train import dataset_options  # noqa: PLC0415
    from mpidl.config import resolve  # noqa: PLC0415
    from mpidl.data import load_dataset  # noqa: PLC0415
    from mpidl.data.text import bigram_baseline  # noqa: PLC0415

    cfg = resolve({"model": "gpt-tiny", **_flag_values(a.model_args)})
    dataset = load_dataset("text", a.data_dir, **dataset_options(cfg))
    global_batch = cfg.batch_size * a.ranks
    windows = len(dataset.train_y)

    # calibration: seconds per step, evaluation and start-up included
    cal_steps = 8 if a.quick else 40
    _, cal, cal_s, _ = train(a, a.work, "calibrate", [
        "--epochs", "1", "--limit-train", str(cal_steps * global_batch)], timeout=1800)
    rec = cal[-1]
    sec_per_step = rec["epoch_time"] / rec["step"]
    eval_s = max(0.0, rec["elapsed"] - rec["epoch_wall"])  # one evaluation
    start_s = max(0.0, cal_s - rec["elapsed"])  # launch, loading, set-up
    epochs, limit = plan(a.minutes * 60, sec_per_step, start_s, eval_s, windows, global_batch)
    cmd, recs, seconds, out_dir = train(a, a.work, "run", [
        "--epochs", str(epochs), "--limit-train", str(limit)],
        timeout=int(a.minutes * 60 * 3) + 600)
    final = recs[-1]
    base = bigram_baseline(dataset)
    model_path = os.path.join(out_dir, "model.npz")
    sample_cmd = MPIDL + ["sample", "--model", model_path, "--prompt", a.prompt, "--tokens",
                          str(a.tokens), "--temperature", str(a.temperature), "--seed",
                          str(a.seed)]
    sample = subprocess.run(sample_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=launch_env(ROOT), timeout=600)
    if sample.returncode != 0:
        raise SystemExit(f"bench/gpt.py: mpidl sample failed:\n{sample.stdout}")
    improvement = 1.0 - final["test_nats_per_char"] / base["nats_per_char"]
    result = {
        "benchmark": "gpt-tiny on character-level text against a character bigram",
        "command": shown(cmd, a.ranks),
        "corpus": dataset.source, "vocabulary": len(dataset.vocab),
        "train_chars": int(dataset.train_x.size), "valid_chars": int(dataset.test_y.size),
        "ranks": a.ranks, "budget_minutes": a.minutes, "wall_seconds": round(seconds, 1),
        "epochs": epochs, "limit_train": limit, "steps": final["step"],
        "global_batch": final["global_batch"], "seconds_per_step": sec_per_step,
        "parameters": _parameters(model_path),
        "model_options": _meta(model_path)["model_options"],
        "valid_nats_per_char": final["test_nats_per_char"],
        "valid_bits_per_char": final["test_bits_per_char"],
        "valid_next_char_accuracy": final["test_acc"],
        "bigram_alpha": base["alpha"], "bigram_nats_per_char": base["nats_per_char"],
        "bigram_bits_per_char": base["bits_per_char"],
        "improvement_over_bigram": improvement, "beats_bigram_by_25_percent": improvement >= 0.25,
        "per_epoch": [{k: r[k] for k in ("epoch", "step", "train_loss", "test_nats_per_char",
                                         "test_bits_per_char", "elapsed")} for r in recs],
        "sample_command": shlex.join(["mpidl"] + sample_cmd[3:]),
        "sample": sample.stdout,
        "machine": describe_machine(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    plot(result, a.plot or os.path.splitext(a.out)[0] + ".png")
    print(f"validation {result['valid_nats_per_char']:.3f} nats/char "
          f"({result['valid_bits_per_char']:.3f} bits/char) vs bigram "
          f"{base['nats_per_char']:.3f} ({base['bits_per_char']:.3f}): "
          f"{100 * improvement:.1f} % lower, {final['step']} steps in {seconds / 60:.1f} min")
    print(sample.stdout)
    print(f"wrote {a.out}")


def _flag_values(args):
    out, i = {}, 0
    while i < len(args):
        if args[i].startswith("--") and i + 1 < len(args):
            name = args[i][2:].replace("-", "_")
            out[name] = int(args[i + 1]) if args[i + 1].lstrip("-").isdigit() else args[i + 1]
            i += 2
        else:
            i += 1
    return out


def _meta(path):
    from mpidl.training.checkpoint import load_model_arrays  # noqa: PLC0415

    return load_model_arrays(path)[1]


def _parameters(path):
    import numpy as np  # noqa: PLC0415

    with np.load(path) as z:
        return int(sum(z[k].size for k in z.files if k != "__meta__" and z[k].dtype.kind == "f"))


def plot(result, path):
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return
    ep = result["per_epoch"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["elapsed"] / 60 for r in ep], [r["test_bits_per_char"] for r in ep], "o-",
            label=f"gpt-tiny, {result['ranks']} ranks")
    ax.axhline(result["bigram_bits_per_char"], color="gray", ls="--", label="character bigram")
    ax.axhline(0.75 * result["bigram_bits_per_char"], color="gray", ls=":",
               label="25 % below the bigram")
    ax.set_xlabel("minutes")
    ax.set_ylabel("validation bits per character")
    ax.set_title("gpt-tiny on " + os.path.basename(result["corpus"]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()

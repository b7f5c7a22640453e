"""Large freed blocks kept in the heap (``mpidl.allocator``) against glibc's defaults: the
one-process training step of a model with large weights, in alternating processes.

``python bench/allocator.py [--pairs 6] [--hidden 4096,4096]``: each pair runs the step
once with ``MPIDL_MALLOC_KEEP=0`` and once with ``1`` (the order alternating between
pairs, so that the machine's drift hits both alike), each in a fresh process that times
``--steps`` steps after ``--warmup``; the ratio of each pair's medians (kept / glibc's)
is the figure, its median over the pairs the summary. JSON in
``bench/results/allocator.json``.
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
from mpidl.benchmarks.machine import launch_env  # noqa: E402


def one_process(a):
    """The timed steps in this process; prints a JSON line."""
    import numpy as np

    from mpidl.allocator import keep_freed_blocks
    from mpidl.engine import SoftmaxCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_optimizer

    kept = keep_freed_blocks()
    hidden = tuple(int(h) for h in a.hidden.split(","))
    model = build_model("mlp", (1, 28, 28), 10, seed=0, hidden=hidden)
    opt = make_optimizer(a.optimizer, model.named_parameters(), lr=1e-4)
    loss = SoftmaxCrossEntropy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, a.batch)
    times = []
    for step in range(a.warmup + a.steps):
        t = time.perf_counter()
        for _, p in model.named_parameters():
            p.grad = None
        loss(model(x), y)
        model.backprop(loss.backward())
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t)
    print(json.dumps({"kept": kept, "median_ms": 1e3 * statistics.median(times),
                      "min_ms": 1e3 * min(times)}), flush=True)


def run(a, keep):
    env = launch_env(ROOT)
    env["MPIDL_MALLOC_KEEP"] = keep
    cmd = [sys.executable, __file__, "--one", "--hidden", a.hidden, "--batch", str(a.batch),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--optimizer", a.optimizer]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--hidden", default="4096,4096")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "allocator.json"))
    a = ap.parse_args()
    if a.one:
        return one_process(a)
    pairs = []
    for k in range(a.pairs):
        order = ("0", "1") if k % 2 == 0 else ("1", "0")
        got = {keep: run(a, keep) for keep in order}
        pair = {"glibc": got["0"], "kept": got["1"],
                "median_ratio": got["1"]["median_ms"] / got["0"]["median_ms"],
                "min_ratio": got["1"]["min_ms"] / got["0"]["min_ms"]}
        pairs.append(pair)
        print(f"pair {k + 1}: glibc {got['0']['median_ms']:.1f} ms, kept "
              f"{got['1']['median_ms']:.1f} ms (median step; {pair['median_ratio']:.3f}x), "
              f"min {pair['min_ratio']:.3f}x", flush=True)
    summary = {key: statistics.median(p[key] for p in pairs)
               for key in ("median_ratio", "min_ratio")}
    summary["kept_faster_in"] = sum(p["median_ratio"] < 1 for p in pairs)
    print(f"kept / glibc, median over {a.pairs} pairs: median step "
          f"{summary['median_ratio']:.3f}x, fastest step {summary['min_ratio']:.3f}x; kept "
          f"faster in {summary['kept_faster_in']} of {a.pairs} pairs")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"machine": describe_machine(), "settings": vars(a), "pairs": pairs,
                   "summary": summary}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Hogwild! over MPI one-sided calls: lock-free against locked, staleness, and the dense
``mlp`` against the parameter server.

    python bench/hogwild.py            # -> bench/results/hogwild.json + hogwild.png
    python bench/hogwild.py --quick    # small sizes (the benchmark test's)

Part 1, the sparse problem Hogwild's theory is about (``tests/ranks/hogwild_sparse.py``:
seeded logistic regression, ``--nnz`` features of ``--dim`` per sample, one pass over
the samples, per-sample updates): 1 owner rank holds the weights, W = 1 and 2 workers
update them lock-free, then with ``--locks`` (each worker holds every owner exclusively
from its read to its write). Reported: total updates per second, final loss against
serial SGD over the same order, and the histogram of staleness (updates by others
between a worker's read and its write) beside the prediction W − 1 (each of the other
workers writes once during a step when all run at the same speed and the read-to-write
interval is the whole step).

Part 2, the dense ``mlp`` on Fashion-MNIST: ``--strategy hogwild`` (lock-free, plain SGD)
against ``--strategy ps --mode sync`` and ``--mode async`` with the same plain SGD, 1
server + 2 workers, equal epochs: test accuracy per epoch.

Timing honesty: 3 processes on this 2-core machine. The owner rank computes nothing (it
sleeps between polls), so 2 workers run on 2 cores; the rates are still those of a
shared machine and are reported as a ratio measured in the same run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402

SPARSE = os.path.join(ROOT, "tests", "ranks", "hogwild_sparse.py")


def sparse_run(workers, locks, a):
    cmd = [mpiexec(), "-n", str(workers + 1), sys.executable, "-m", "mpi4py", SPARSE,
           "--samples", str(a.samples), "--dim", str(a.dim), "--nnz", str(a.nnz)]
    if locks:
        cmd.append("--locks")
    out = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(ROOT),
                         timeout=1800, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("HOGWILD "))
    r = json.loads(line[len("HOGWILD "):])
    r["staleness_predicted"] = workers - 1
    return r


def dense_run(strategy, a, tmp):
    metrics = os.path.join(tmp, f"{strategy.replace(' ', '_')}.jsonl")
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "mpidl", "train", "--model", "mlp",
           "--epochs", str(a.epochs), "--momentum", "0", "--lr", str(a.lr),
           "--no-progress", "--metrics", metrics, "--out-dir", tmp, *strategy.split()]
    if a.limit_train:
        cmd += ["--limit-train", str(a.limit_train)]
    subprocess.run(cmd, capture_output=True, text=True, env=launch_env(ROOT), timeout=3600,
                   check=True)
    with open(metrics) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    return {"strategy": strategy, "test_acc": [r["test_acc"] for r in rows],
            "epoch_wall": [r["epoch_wall"] for r in rows],
            "staleness": [r.get("hogwild_mean_staleness", r.get("ps_mean_staleness"))
                          for r in rows]}


def plot(result, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in result["sparse"]:
        if r["locks"] or r["workers"] < 2:
            continue
        hist = r["staleness_hist"]
        total = sum(hist)
        ax1.bar(range(len(hist)), [h / total for h in hist], alpha=0.7,
                label=f"{r['workers']} workers, lock-free (mean {r['staleness_mean']:.2f})")
        ax1.axvline(r["staleness_predicted"], color="k", ls="--",
                    label=f"prediction W-1 = {r['staleness_predicted']}")
    ax1.set_xlabel("staleness (updates by others between read and write)")
    ax1.set_ylabel("fraction of updates")
    ax1.set_xlim(-0.5, 10.5)
    ax1.legend(fontsize=8)
    ax1.set_title("sparse logistic regression")
    for r in result["dense"]:
        ax2.plot(range(1, len(r["test_acc"]) + 1), r["test_acc"], marker="o",
                 label=r["strategy"])
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("test accuracy")
    ax2.set_title("mlp, Fashion-MNIST, 2 workers + 1 server, plain SGD")
    if result["dense"]:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, no dense part")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=100000)
    ap.add_argument("--nnz", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--limit-train", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "hogwild.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    a = ap.parse_args()
    if a.quick:
        a.samples, a.dim = 2000, 20000
    result = {"machine": describe_machine(), "settings": vars(a).copy(),
              "sparse": [], "dense": []}
    for workers in (1, 2):
        for locks in (False, True):
            r = sparse_run(workers, locks, a)
            result["sparse"].append(r)
            print(f"sparse: {workers} worker(s), {'locked' if locks else 'lock-free'}: "
                  f"{r['updates_per_s']:.0f} updates/s, loss {r['loss_hogwild']:.5f} "
                  f"(serial {r['loss_serial']:.5f}), staleness mean "
                  f"{r['staleness_mean']:.2f} (predicted {r['staleness_predicted']})",
                  flush=True)
    free = next(r for r in result["sparse"] if r["workers"] == 2 and not r["locks"])
    locked = next(r for r in result["sparse"] if r["workers"] == 2 and r["locks"])
    result["lockfree_over_locked_p2"] = free["updates_per_s"] / locked["updates_per_s"]
    print(f"lock-free / locked update rate at 2 workers: "
          f"{result['lockfree_over_locked_p2']:.2f}x", flush=True)
    if not a.quick:
        with tempfile.TemporaryDirectory() as tmp:
            for strategy in ("--strategy hogwild", "--strategy ps --mode sync",
                             "--strategy ps --mode async"):
                r = dense_run(strategy, a, tmp)
                result["dense"].append(r)
                print(f"dense mlp, {strategy}: test accuracy by epoch {r['test_acc']}",
                      flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.plot or os.path.splitext(a.out)[0] + ".png")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

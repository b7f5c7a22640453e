"""Local SGD and DiLoCo against all-reduce: bytes sent against accuracy.

    python bench/local_sgd.py             # -> bench/results/local_sgd.json + local_sgd.png
    python bench/local_sgd.py --model cnn --optimizer adamw --lr 0.001 --epochs 8 \
        --out bench/results/local_sgd_cnn_adamw.json \
        --plot bench/results/local_sgd_cnn_adamw.png
    python bench/local_sgd.py --quick     # tiny run on synthetic data (the test's)

Every configuration trains the same model from the same seed on the same batches with
mpidl's ``Trainer`` on ``--ranks`` ranks (``mpiexec``; batch ``--batch`` per rank, cosine
schedule over the run, the same inner optimizer in every run: the model's SGD recipe,
or ``--optimizer adamw``, DiLoCo's paper's): all-reduce data parallelism (``--sync
allreduce``), then local SGD and DiLoCo (outer Nesterov, ``--outer-lr`` 0.7 and
``--outer-momentum`` 0.9 by default, the paper's) for every H in ``--periods``
(``--only`` picks some). All use the ring all-reduce with one layout of buckets, so an
averaging moves exactly the bytes of one all-reduce step. The bytes are the
communicator's counters (``comm.counters()``: payload this rank sent), summed between
each step's start and end, so evaluation is not counted; every run asserts replicas
bitwise equal after each averaging (``verify_averaging``). ``--limit-train`` is chosen so
that the steps of the whole run are a multiple of every H (with ``--epochs`` 4 or 8): the
bytes are then exactly 1/H of all-reduce's (checked here: ``exact``); the final test
accuracy is that of the averaged model.

Reading it: points of test accuracy lost against bytes saved. Timings are not reported
(4 ranks on 2 cores oversubscribe; see the README's benchmark notes).
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
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402
from mpidl.training.callbacks import Callback  # noqa: E402


class StepBytes(Callback):
    """Payload bytes this rank's data-parallel group sent during training steps (from the
    communicator's counters), per epoch."""

    def __init__(self):
        self.epoch_bytes = []
        self.current = 0
        self.start = 0

    def _now(self, trainer):
        return trainer.runtime.group.counters()["total"]["bytes"]

    def on_step_start(self, trainer):
        self.start = self._now(trainer)

    def on_step_end(self, trainer, loss):
        self.current += self._now(trainer) - self.start

    def on_epoch_end(self, trainer, record):
        self.epoch_bytes.append(self.current)
        self.current = 0


def run_rank(a):
    """One configuration on every rank of this launch; rank 0 writes ``a.out``."""
    from mpi4py import MPI

    from mpidl import backend
    from mpidl.comm import Communicator
    from mpidl.data import load_dataset
    from mpidl.engine.models import MODEL_DEFAULTS, build_model
    from mpidl.engine.optim import SGD, AdamW
    from mpidl.runtime import build
    from mpidl.training.trainer import Trainer

    backend.use("cpu")
    world = MPI.COMM_WORLD
    ds = load_dataset(a.dataset, a.data_dir)
    ds = ds.limit(a.limit_train or None, a.limit_test or None)
    recipe = MODEL_DEFAULTS.get(a.model, MODEL_DEFAULTS["mlp"])
    model = build_model(a.model, input_shape=ds.input_shape, num_classes=ds.num_classes,
                        seed=a.seed, dtype=a.dtype)
    lr = a.lr if a.lr is not None else recipe["lr"]
    if a.optimizer == "adamw":
        opt = AdamW(model.named_parameters(), lr=lr, weight_decay=a.weight_decay)
    else:
        opt = SGD(model.named_parameters(), lr=lr, momentum=recipe["momentum"],
                  weight_decay=recipe["weight_decay"])
    options = {}
    if a.sync != "allreduce":
        options = {"sync": a.sync, "period": a.period, "verify_averaging": True}
    if a.sync == "diloco":
        options.update(outer_lr=a.outer_lr, outer_momentum=a.outer_momentum)
    runtime = build("allreduce", Communicator(world), algorithm="ring", overlap="off",
                    **options)
    counter = StepBytes()
    epochs = []

    class Record(Callback):
        def on_epoch_end(self, trainer, record):
            epochs.append({k: record.get(k) for k in ("epoch", "step", "train_loss",
                                                      "test_loss", "test_acc")})

    trainer = Trainer(model, opt, ds, runtime=runtime, callbacks=[counter, Record()],
                      epochs=a.epochs, batch_size=a.batch, lr=lr,
                      schedule="cosine", seed=a.seed, dtype=a.dtype, progress=False,
                      quiet=True)
    t = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t
    per_rank = world.gather(counter.epoch_bytes)
    if world.rank != 0:
        return
    out = {"sync": a.sync, "period": a.period, "steps": trainer.step,
           "steps_per_epoch": trainer.steps_per_epoch, "epochs": epochs,
           "test_acc": epochs[-1]["test_acc"], "bytes_per_epoch_rank0": per_rank[0],
           "bytes_rank0": sum(per_rank[0]), "bytes_all_ranks": sum(map(sum, per_rank)),
           "averagings": getattr(runtime.averaging, "averagings", 0), "wall_s": wall}
    with open(a.out, "w") as f:
        json.dump(out, f)


def configurations(periods, only=None):
    """(name, --sync, H) of every run; ``only``: the names to keep (all-reduce, the
    anchor, always runs)."""
    yield "allreduce", "allreduce", 1
    for sync in ("local-sgd", "diloco"):
        for h in periods:
            name = f"{sync} H={h}"
            if only is None or name in only:
                yield name, sync, h


def main_run(a):
    os.makedirs(a.work, exist_ok=True)
    periods = [int(h) for h in a.periods.split(",")]
    results = {"machine": describe_machine(), "settings": vars(a), "runs": {}}
    only = None if not a.only else {n.strip() for n in a.only.split(",")}
    for name, sync, h in configurations(periods, only):
        out = os.path.join(a.work, f"{name.replace(' ', '_').replace('=', '')}.json")
        cmd = [mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "mpi4py",
               os.path.abspath(__file__), "_run", "--sync", sync, "--period", str(h),
               "--out", out, "--model", a.model, "--dataset", a.dataset, "--epochs",
               str(a.epochs), "--batch", str(a.batch), "--seed", str(a.seed),
               "--limit-train", str(a.limit_train), "--limit-test", str(a.limit_test),
               "--dtype", a.dtype, "--optimizer", a.optimizer, "--weight-decay",
               str(a.weight_decay), "--outer-lr", str(a.outer_lr), "--outer-momentum",
               str(a.outer_momentum)]
        if a.lr is not None:
            cmd += ["--lr", str(a.lr)]
        if a.data_dir:
            cmd += ["--data-dir", a.data_dir]
        t = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=launch_env(ROOT), timeout=a.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}")
        with open(out) as f:
            run = json.load(f)
        results["runs"][name] = run
        print(f"{name:18s} test_acc {run['test_acc']:.4f}  bytes/rank {run['bytes_rank0']:>12d}"
              f"  averagings {run['averagings']:4d}  ({time.time() - t:.0f} s)", flush=True)
    summarize(results)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, a.plot)
    print("| run | test acc | vs all-reduce (points) | bytes per epoch (rank 0) | "
          "fraction of all-reduce | exact 1/H |")
    print("|---|---|---|---|---|---|")
    for name, r in results["runs"].items():
        print(f"| {name} | {r['test_acc']:.4f} | {r['minus_allreduce_points']:+.2f} | "
              f"{r['bytes_per_epoch']:.0f} | {r['bytes_fraction']:.6f} | "
              f"{r.get('exact', '-')} |")
    return results


def summarize(results):
    """Accuracy and bytes against all-reduce; ``exact``: the bytes are exactly
    floor(steps / H) all-reduce steps' bytes."""
    runs = results["runs"]
    ref = runs["allreduce"]
    steps = ref["steps"]
    per_step, rest = divmod(ref["bytes_rank0"], steps)
    if rest:
        raise AssertionError(f"all-reduce sent {ref['bytes_rank0']} bytes in {steps} steps: "
                             "not the same bytes every step")
    for name, r in runs.items():
        r["bytes_per_epoch"] = r["bytes_rank0"] / len(r["epochs"])
        r["bytes_fraction"] = r["bytes_rank0"] / ref["bytes_rank0"]
        r["minus_allreduce_points"] = round(100 * (r["test_acc"] - ref["test_acc"]), 2)
        if name != "allreduce":
            h = r["period"]
            r["expected_bytes"] = per_step * (steps // h)
            r["exact"] = r["bytes_rank0"] == r["expected_bytes"]
            r["fraction_is_1_over_H"] = r["bytes_rank0"] * h == ref["bytes_rank0"]
    results["allreduce_bytes_per_step"] = per_step


def plot(results, path):
    from mpidl.benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ref = results["runs"]["allreduce"]
    ax.scatter([ref["bytes_per_epoch"]], [100 * ref["test_acc"]], color="black",
               label="all-reduce", zorder=3)
    for sync, color in (("local-sgd", "tab:blue"), ("diloco", "tab:orange")):
        rows = [r for r in results["runs"].values() if r["sync"] == sync]
        rows.sort(key=lambda r: r["period"])
        xs = [r["bytes_per_epoch"] for r in rows]
        ys = [100 * r["test_acc"] for r in rows]
        ax.plot(xs, ys, "o-", color=color, label=sync)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(f"H={r['period']}", (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per epoch per rank (communicator counters)")
    ax.set_ylabel("final test accuracy (%)")
    s = results["settings"]
    ax.set_title(f"{s['model']} on {s['dataset']}, {s['ranks']} ranks, {s['epochs']} epochs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", default="run", choices=("run", "_run"))
    ap.add_argument("--quick", action="store_true", help="tiny run on synthetic data")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit-train", type=int, default=32768, help="training images: "
                    "4 ranks x 128 x 64 steps, so 4 epochs are 256 steps, a multiple of "
                    "every H")
    ap.add_argument("--limit-test", type=int, default=0)
    ap.add_argument("--periods", default="1,4,16,64,256")
    ap.add_argument("--only", default=None, help="comma-separated run names to run "
                    "besides all-reduce, e.g. 'local-sgd H=16,diloco H=16'")
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                    help="the inner optimizer of every run (all-reduce's too): the "
                    "model's SGD recipe, or AdamW (DiLoCo's paper)")
    ap.add_argument("--lr", type=float, default=None, help="default: the model's recipe")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr")
    ap.add_argument("--outer-momentum", type=float, default=0.9,
                    help="DiLoCo's outer Nesterov momentum")
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-local-sgd"))
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "local_sgd.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "results", "local_sgd.png"))
    # one configuration (inside mpiexec)
    ap.add_argument("--sync", default="allreduce")
    ap.add_argument("--period", type=int, default=1)
    a = ap.parse_args(argv)
    if a.cmd == "_run":
        return run_rank(a)
    if a.quick:
        a.ranks, a.dataset, a.epochs, a.batch = 2, "synthetic", 2, 16
        a.limit_train, a.limit_test, a.periods = 512, 64, "1,4"  # 16 steps per epoch
    return main_run(a)


if __name__ == "__main__":
    main()

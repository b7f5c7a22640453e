"""What stale gradients alone cost: one process, no MPI, gradients delayed by tau steps.

    python bench/staleness.py        # -> bench/results/staleness.json + staleness.png

Async and SSP parameter servers apply gradients computed from parameters a few updates
old (with W workers, about W - 1 on average). This benchmark isolates that effect from
everything else a real run has (communication, the server, stragglers, the machine's
load): one process trains with the gradient of step t computed at the parameters of
step t - tau and applied to the newest ones — the schedule Downpour follows with tau + 1
workers in round robin — for each tau in ``--taus``, from the same initial parameters
on the same batches with the same learning rate (linear warm-up over ``--warmup``
images, then constant). It reports test accuracy against images seen and the images
needed to reach ``--target``, as a ratio to tau = 0. Speeds do not enter, so the
figures do not move with the machine's load.

It runs mpidl's ``Trainer`` on a one-process runtime whose gradient sync is
``DelayedGradients`` (it swaps the old parameters in for forward and backward and the
newest back in for the update); a callback evaluates the curve.

Reading it: a PS mode that computes ``s`` times as many images per second as sync
(with a straggler) is faster to the target only if its staleness costs less than
``s`` times the images.
"""

import argparse
import json
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before NumPy is imported

from mpidl.runtime.sync.base import GradSync  # noqa: E402
from mpidl.training.callbacks import Callback  # noqa: E402


class DelayedGradients(GradSync):
    """A gradient sync that makes every gradient ``tau`` steps stale (one process).

    Before the step's forward the model takes the parameters of ``tau`` updates ago; after
    backward it takes the newest ones back, and the optimizer applies the stale gradient
    to them; then the new parameters join the ``tau + 1`` versions kept (oldest first)."""

    name = "delayed"

    def __init__(self, tau):
        super().__init__()
        self.tau = int(tau)
        self.versions = []
        self._newest = None

    def setup(self, ctx, named_params):
        super().setup(ctx, named_params)
        self.versions = [self._snapshot()]

    def _snapshot(self):
        return {n: p.data.copy() for n, p in self.params.items()}

    def _load(self, params):
        for n, p in self.params.items():
            p.data[...] = params[n]

    def begin_step(self):
        self._newest = self.versions[-1]
        self._load(self.versions[0])  # the gradient at the version tau updates old

    def finish(self):
        self._load(self._newest)  # applied to the newest parameters
        yield self.names  # (the optimizer steps them here)
        self.versions = (self.versions + [self._snapshot()])[-(self.tau + 1):]

    def describe(self):
        return [f"gradients {self.tau} step(s) stale"]


def delayed_runtime(tau):
    """A one-process runtime (one pass per step, optimizer here) whose gradients are
    ``tau`` steps stale."""
    from mpidl.runtime import Runtime
    from mpidl.runtime.placement import Replicated
    from mpidl.runtime.schedule import MicroBatches

    return Runtime(None, f"delayed gradients, tau {tau}", MicroBatches(1),
                   [(lambda name: True, DelayedGradients(tau))], Replicated)


class Curve(Callback):
    """``accuracy()`` before the first step and after each step that completes another
    ``eval_every`` images: ``points`` = [(images seen, accuracy)]."""

    def __init__(self, accuracy, batch, eval_every):
        self.accuracy, self.batch, self.eval_every = accuracy, batch, eval_every
        self.points = []
        self.next_eval = eval_every

    def on_fit_start(self, trainer):
        self.points.append((0, self.accuracy()))

    def on_step_end(self, trainer, loss):
        seen = trainer.step * self.batch
        if seen >= self.next_eval:
            self.points.append((seen, self.accuracy()))
            self.next_eval += self.eval_every


def train(a, tau):
    """One run with gradients tau steps stale; returns [(images seen, test accuracy)]."""
    from mpidl import backend
    from mpidl.benchmarks.callbacks import batches_as_one_epoch
    from mpidl.data import BatchLoader, eval_batches, load_dataset
    from mpidl.engine.models import build_model
    from mpidl.engine.normalization import recalibrate_batchnorm
    from mpidl.engine.optim import SGD, Adam
    from mpidl.training.trainer import Trainer

    backend.use("cpu")
    ds = load_dataset("fashion-mnist", a.data_dir)
    model = build_model(a.model, input_shape=ds.input_shape, num_classes=ds.num_classes,
                        seed=a.seed)
    model.needs_input_grad = False
    named = model.named_parameters()
    if a.optimizer == "adam":
        opt = Adam(named, lr=a.lr, betas=(a.momentum, 0.999))
    else:
        opt = SGD(named, lr=a.lr, momentum=a.momentum)
    x_test, y_test = ds.test_x[:a.test_limit or None], ds.test_y[:a.test_limit or None]

    def accuracy():
        recalibrate_batchnorm(model, ds.train_x[:a.calibrate])  # leaves eval mode
        correct = sum(int((model.forward(xb).argmax(axis=1) == yb).sum())
                      for xb, yb in eval_batches(x_test, y_test, 1000))
        model.train()
        return correct / len(y_test)

    # the batches: the shuffled epochs of the training set, one after the other, until
    # --images are seen; the trainer walks them as one epoch (it evaluates nothing of
    # its own: the curve is the callback's, BatchNorm recalibrated at each point)
    steps = -(-a.images // a.batch)
    order = BatchLoader(ds.train_x, ds.train_y, a.batch, seed=a.seed)
    per_epoch = len(order)
    batches = [order.global_indices(i // per_epoch, i % per_epoch) for i in range(steps)]
    train_x, train_y = batches_as_one_epoch(ds.train_x, ds.train_y, batches, a.seed)
    data = SimpleNamespace(train_x=train_x, train_y=train_y, test_x=ds.test_x[:0],
                           test_y=ds.test_y[:0])

    def warmup(base_lr, total_steps, warmup_steps):  # linear over --warmup images
        def lr(step):
            return a.lr * min(1.0, (step + 1) * a.batch / a.warmup) if a.warmup else a.lr
        return lr

    runtime = delayed_runtime(tau)
    curve = Curve(accuracy, a.batch, a.eval_every)
    trainer = Trainer(model, opt, data, runtime=runtime, callbacks=[curve],
                      lr_schedule=warmup, epochs=1, batch_size=a.batch, lr=a.lr,
                      seed=a.seed, progress=False)
    trainer.fit()
    return curve.points


def images_to(curve, target):
    """Images seen at the first evaluation at or above ``target`` (None: never)."""
    return next((n for n, acc in curve if acc >= target), None)


def plot(results, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    s = results["settings"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for tau, r in results["runs"].items():
        n, acc = zip(*r["curve"])
        ax.plot([k / 1000 for k in n], acc, marker=".", label=f"tau = {tau}")
    ax.axhline(s["target"], color="grey", ls=":", lw=1)
    ax.set_ylim(max(0.5, s["target"] - 0.2), None)
    ax.set_xlabel("thousands of training images")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{s['model']}, {s['optimizer']} lr {s['lr']} (momentum/beta1 "
                 f"{s['momentum']}, warm-up {s['warmup']} images), batch {s['batch']}: "
                 "gradients tau steps stale")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=0.15)
    ap.add_argument("--momentum", type=float, default=0.0,
                    help="SGD momentum, or Adam's beta1 (default 0: bench/ps.py's "
                    "async recipe, SGD lr 0.15 without momentum)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=15000, help="linear lr warm-up over this "
                    "many images (default: bench/ps.py's async warm-up, a quarter of a "
                    "worker's epoch with 3 workers)")
    ap.add_argument("--taus", default="0,1,2,4", help="comma-separated delays, in steps")
    ap.add_argument("--images", type=int, default=60000, help="training images per run")
    ap.add_argument("--eval-every", type=int, default=2560, help="images between evaluations")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N test "
                    "images (0: all 10000)")
    ap.add_argument("--calibrate", type=int, default=2000,
                    help="training images for the BatchNorm statistics at each evaluation")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "staleness.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "results", "staleness.png"))
    a = ap.parse_args(argv)
    results = {"settings": vars(a), "runs": {}}
    base = None
    for tau in (int(t) for t in a.taus.split(",")):
        curve = train(a, tau)
        n = images_to(curve, a.target)
        base = n if tau == 0 else base
        ratio = n / base if n and base else None
        results["runs"][str(tau)] = {"curve": curve, "images_to_target": n,
                                     "vs_tau0": ratio, "final_acc": curve[-1][1]}
        print(f"tau {tau}: to {a.target:.2f} in {n if n else '-'} images"
              + (f" ({ratio:.2f}x tau 0's)" if ratio else "")
              + f", final accuracy {curve[-1][1]:.4f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)
    return results


if __name__ == "__main__":
    main()

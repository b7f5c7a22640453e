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

Reading it: a PS mode that computes ``s`` times as many images per second as sync
(with a straggler) is faster to the target only if its staleness costs less than
``s`` times the images.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def train(a, tau):
    """One run with gradients tau steps stale; returns [(images seen, test accuracy)]."""
    import numpy as np

    from mpidl import backend
    from mpidl.data import BatchLoader, eval_batches, load_dataset
    from mpidl.engine.losses import SoftmaxCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.engine.normalization import recalibrate_batchnorm
    from mpidl.engine.optim import SGD, Adam

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
    loss = SoftmaxCrossEntropy()
    x_test, y_test = ds.test_x[:a.test_limit or None], ds.test_y[:a.test_limit or None]

    def snapshot():
        return {n: p.data.copy() for n, p in named}

    def load(params):
        for n, p in named:
            p.data[...] = params[n]

    def accuracy():
        recalibrate_batchnorm(model, ds.train_x[:a.calibrate])  # leaves eval mode
        correct = sum(int((model.forward(xb).argmax(axis=1) == yb).sum())
                      for xb, yb in eval_batches(x_test, y_test, 1000))
        model.train()
        return correct / len(y_test)

    versions = [snapshot()]  # the last tau + 1 parameter versions, oldest first
    curve, seen, next_eval = [(0, accuracy())], 0, a.eval_every
    loader = BatchLoader(ds.train_x, ds.train_y, a.batch, seed=a.seed)
    epoch = 0
    while seen < a.images:
        for _, x, y in loader.epoch(epoch):
            newest = versions[-1]
            load(versions[0])  # the gradient at the version tau updates old
            model.zero_grad()
            loss.forward(model.forward(x), y)
            model.backward(loss.backward())
            load(newest)  # applied to the newest parameters
            opt.lr = a.lr * min(1.0, (seen + len(y)) / a.warmup) if a.warmup else a.lr
            opt.step()
            versions = (versions + [snapshot()])[-(tau + 1):]
            seen += len(y)
            if seen >= next_eval:
                curve.append((seen, accuracy()))
                next_eval += a.eval_every
            if seen >= a.images:
                break
        epoch += 1
    return curve


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
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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

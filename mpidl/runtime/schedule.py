"""The schedule: how a step runs forward and backward over its micro-batches.

``MicroBatches(k)`` splits a rank's batch into ``k`` equal micro-batches and runs
forward, loss and backward for each in turn; gradients accumulate in the parameters
(``Parameter.accumulate``), each micro-batch's loss gradient scaled by 1/k, so the
result is the gradient of the mean loss over the whole batch and the syncs send once
per step (``--accumulate K``). ``k = 1`` is the plain single pass. Statistics that a
forward computes over its batch (BatchNorm) are per micro-batch, as in every framework.

The step's final backward pass is the one during which the syncs' grad-ready hooks run
(``arm`` is called just before it): only then is a gradient final.

``straggler`` (experiments): this rank sleeps ``straggler - 1`` times its measured
forward + backward time after each step's backward, so its steps take that factor as
long (``--straggler RANK:FACTOR``).

Pipeline schedules (GPipe, 1F1B, ...) will be other classes with the same ``run``.
"""

import time

from mpidl.errors import ConfigError
from mpidl.options import Option

_clock = time.perf_counter

OPTIONS = [
    Option("accumulate", int, 1, "gradient accumulation: each step runs K micro-batches "
           "of --batch-size per rank and syncs once (the global batch is batch size x K x "
           "ranks)", "parallelism", metavar="K",
           check=lambda k: None if k >= 1 else "must be at least 1"),
    Option("straggler", str, None, "slow training rank RANK's compute by FACTOR "
           "(experiments), e.g. 3:2", "parallelism", metavar="RANK:FACTOR"),
]


def parse_straggler(spec):
    """``"RANK:FACTOR"`` -> (rank, factor); None stays None."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, (tuple, list)):
        rank, factor = spec
    else:
        try:
            rank, factor = str(spec).split(":")
            rank, factor = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"--straggler {spec!r}: expected RANK:FACTOR, e.g. 3:2 "
                              "(rank 3 computes twice as slowly)") from None
    if not factor >= 1.0:
        raise ConfigError(f"--straggler {spec!r}: FACTOR must be >= 1 (a slowdown)")
    return int(rank), float(factor)


def check_accumulate(k):
    k = 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"--accumulate must be a whole number >= 1, got {k!r}")
    return k


class MicroBatches:
    """Forward and backward over ``k`` micro-batches of each batch (module doc)."""

    name = "micro-batches"

    def __init__(self, k=1, straggler=1.0):
        self.k = check_accumulate(k)
        self.straggler = float(straggler)
        self.forward_s = self.backward_s = self.straggle_s = 0.0

    def setup(self, model):
        """The schedule decides whether the model's first layer computes the gradient of
        its input: here the input is data, whose gradient nobody uses (a pipeline stage
        after the first will say yes). Saves the first layer's input-gradient GEMM."""
        model.needs_input_grad = False

    def run(self, model, loss, x, y, arm=None):
        """Run the step's passes; returns the mean loss over the batch (a float)."""
        k = self.k
        n = len(y)
        if n % k:
            raise ValueError(f"a batch of {n} samples does not split into --accumulate {k} "
                             "equal micro-batches")
        m = n // k
        total = 0.0
        fwd = bwd = 0.0
        for i in range(k):
            t0 = _clock()
            xs, ys = (x, y) if k == 1 else (x[i * m:(i + 1) * m], y[i * m:(i + 1) * m])
            out = model(xs)
            total += float(loss.forward(out, ys))
            dy = loss.backward()
            if k > 1:
                dy *= 1.0 / k
            t1 = _clock()
            if arm is not None and i == k - 1:
                arm(True)
            try:
                model.backprop(dy)
            finally:
                if arm is not None and i == k - 1:
                    arm(False)
            t2 = _clock()
            fwd += t1 - t0
            bwd += t2 - t1
        self.forward_s, self.backward_s = fwd, bwd
        if self.straggler > 1.0:
            t = _clock()
            time.sleep((self.straggler - 1.0) * (fwd + bwd))
            self.straggle_s = _clock() - t
        return total / k

    def describe(self):
        return f"{self.k} micro-batch(es) per step" if self.k > 1 else "one pass per step"

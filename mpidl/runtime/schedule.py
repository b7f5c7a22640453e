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
long (``--straggler RANK:FACTOR``, a persistent straggler). ``transient``: every step,
every training rank is slowed by FACTOR with probability Q, independently, from a
generator seeded by (SEED, rank), so a run's slow steps are the same every time
(``--straggler transient:FACTOR:Q[:SEED]``; the transient stragglers of SSP's use case).

``pace`` (benchmarks, Python API ``compute_pace``): seconds per sample. A step then
takes ``pace * samples * straggler factor`` whatever its real compute took (it sleeps
the rest; a real compute already longer is not cut), so timings on a machine with fewer
cores than ranks model ranks that truly run in parallel. The gradients are still computed
for real. A compute that took longer than its paced time ran slower than the emulation
claims, so the schedule counts those (``over_pace`` of ``paced``) and keeps the largest
real compute over ``pace * samples`` (``worst_pace_ratio``): a benchmark reports them, so
a run that could not keep its pace is marked, not quoted as emulated.

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
           "(experiments), e.g. 3:2; or transient:FACTOR:Q[:SEED]: every step each training "
           "rank is slowed by FACTOR with probability Q (seeded, the same every run)",
           "parallelism", metavar="RANK:FACTOR"),
]


class Transient:
    """``--straggler transient:FACTOR:Q[:SEED]``: each step, each rank slowed by
    ``factor`` with probability ``prob`` (seeded by ``seed`` and the rank)."""

    def __init__(self, factor, prob, seed=0):
        self.factor, self.prob, self.seed = float(factor), float(prob), int(seed)

    def __eq__(self, other):
        return isinstance(other, Transient) and (self.factor, self.prob, self.seed) == (
            other.factor, other.prob, other.seed)

    def __repr__(self):
        return f"transient:{self.factor:g}:{self.prob:g}:{self.seed}"


def _parse_transient(spec):
    parts = str(spec).split(":")[1:]
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        factor, prob = float(parts[0]), float(parts[1])
        seed = int(parts[2]) if len(parts) == 3 else 0
    except ValueError:
        raise ConfigError(f"--straggler {spec!r}: expected transient:FACTOR:Q[:SEED], e.g. "
                          "transient:4:0.1 (each step, each rank 4x slower with "
                          "probability 0.1)") from None
    if not 1.0 <= factor < float("inf"):
        raise ConfigError(f"--straggler {spec!r}: FACTOR must be >= 1 (a slowdown)")
    if not 0.0 <= prob <= 1.0:
        raise ConfigError(f"--straggler {spec!r}: Q must be a probability in [0, 1]")
    if seed < 0:
        raise ConfigError(f"--straggler {spec!r}: SEED must be >= 0")
    return Transient(factor, prob, seed)


def parse_straggler(spec):
    """``"RANK:FACTOR"`` -> (rank, factor); ``"transient:FACTOR:Q[:SEED]"`` -> a
    ``Transient``; None stays None."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, Transient):
        return spec
    if isinstance(spec, str) and spec.startswith("transient:"):
        return _parse_transient(spec)
    if isinstance(spec, (tuple, list)):
        rank, factor = spec
    else:
        try:
            rank, factor = str(spec).split(":")
            rank, factor = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"--straggler {spec!r}: expected RANK:FACTOR, e.g. 3:2 "
                              "(rank 3 computes twice as slowly)") from None
    if not 1.0 <= factor < float("inf"):
        raise ConfigError(f"--straggler {spec!r}: FACTOR must be >= 1 (a slowdown)")
    return int(rank), float(factor)


def check_accumulate(k):
    k = 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"--accumulate must be a whole number >= 1, got {k!r}")
    return k


def slow_down(computed, samples, factor, pace=None):
    """Sleep so that a compute of ``computed`` seconds over ``samples`` samples takes
    ``factor`` times as long (or, with ``pace``, ``factor * pace * samples`` seconds);
    returns the seconds slept."""
    target = factor * (computed if pace is None else pace * samples)
    if target <= computed:
        return 0.0
    t = _clock()
    time.sleep(target - computed)
    return _clock() - t


class MicroBatches:
    """Forward and backward over ``k`` micro-batches of each batch (module doc)."""

    name = "micro-batches"

    def __init__(self, k=1, straggler=1.0, transient=None, rank=0, pace=None):
        self.k = check_accumulate(k)
        self.straggler = float(straggler)
        self.pace = pace
        self.transient = transient
        self._rng = None
        if transient is not None:
            import numpy as np  # noqa: PLC0415

            self._rng = np.random.default_rng([transient.seed, rank])
        self.slowed_steps = 0  # steps this rank was slowed in (transient stragglers)
        # set by the runtime for one step: the most bytes a forward pass keeps for
        # backward (the memory ledger's mem_activations); measuring walks the model
        self.measure_activations = False
        self.activation_bytes = 0
        self.forward_s = self.backward_s = self.straggle_s = 0.0
        # this rank's share of the global batch over the mean share (set by the trainer
        # when a run keeps its global batch on a number of ranks that does not divide it)
        self.grad_weight = 1.0
        # with a pace: computations paced, those whose real compute exceeded their paced
        # time, and the largest real compute / (pace * samples) (module doc)
        self.paced = self.over_pace = 0
        self.worst_pace_ratio = 0.0

    def step_factor(self):
        """How many times slower than its compute this step runs on this rank (the
        persistent straggler factor, or a transient one drawn for this step)."""
        slow = self.straggler
        if self._rng is not None and self._rng.random() < self.transient.prob:
            slow = max(slow, self.transient.factor)
            self.slowed_steps += 1
        return slow

    def slow_down(self, computed, samples, factor):
        """``slow_down`` with this schedule's pace, counting a compute that overran it."""
        if self.pace is not None:
            self.paced += 1
            self.over_pace += computed > factor * self.pace * samples
            self.worst_pace_ratio = max(self.worst_pace_ratio,
                                        computed / (self.pace * samples))
        return slow_down(computed, samples, factor, self.pace)

    def describe_transient(self):
        if self.transient is None:
            return ""
        return (f"; transient stragglers: {self.transient.factor:g}x slower with "
                f"probability {self.transient.prob:g} per step (seed {self.transient.seed})")

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
            if self.measure_activations:
                self.activation_bytes = max(self.activation_bytes, model.activation_nbytes())
            dy = loss.backward()
            if k > 1:
                dy *= 1.0 / k
            if self.grad_weight != 1.0:
                dy *= self.grad_weight
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
        self.straggle_s = self.slow_down(fwd + bwd, n, self.step_factor())
        return total / k

    def describe(self):
        text = f"{self.k} micro-batch(es) per step" if self.k > 1 else "one pass per step"
        return text + self.describe_transient()

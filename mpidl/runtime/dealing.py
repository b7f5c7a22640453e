"""Dynamic work dealing (``--strategy ps --deal portions``), after Sandblaster (Dean et al.,
NIPS 2012): a slow worker simply computes less.

Every worker loads the same global batch (``--batch-size`` times the workers) and cuts it
into portions of ``--portion-size`` samples (default: a quarter of ``--batch-size``). It
asks the dealer (the first server) for a portion, computes that portion's gradient
scaled by its share of the batch, pushes it to the servers and asks for the next, until
the dealer has none left; the servers apply the sum of all portions in portion order
(``mpidl.ps.modes.DealMode``). So:

- the update is the global batch's mean gradient, summed in an order fixed by the data:
  bitwise the same whichever worker computed which portion, so a run with a straggler
  equals its run without one;
- every sample is used once per epoch, as in sync training;
- a worker k times slower takes about 1/k as many portions, instead of making every
  other worker wait for it each step; near the end of a step, a worker that asks gets a
  backup copy of a portion still out that was dealt before its own (so is overdue), so
  the last portion held by the straggler need not hold up the step either.

Each portion is a full gradient push, so a step moves ``--batch-size / --portion-size``
times the bytes of synchronous PS into the servers: dealing pays when stragglers cost
more than that (README, "Stragglers without losing synchrony").

Full-batch L-BFGS (``--optimizer lbfgs``, ``mpidl.ps.lbfgs``) computes each evaluation
with this schedule too, the whole training set being the batch; ``sum_of_portions`` is
the same sum on one process.

The portion gradients are exact (no compression) and per portion, so gradient
accumulation, compression, worker groups and other modes than sync are refused, and so
is Dropout with p > 0 (its masks would depend on who computed what).
"""

from time import perf_counter

from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.schedule import MicroBatches

DEAL_MODES = ("batches", "portions")

OPTIONS = [
    Option("deal", str, None, "--strategy ps: batches (each worker its own piece of every "
           "global batch; default) or portions (the global batch cut into portions dealt to "
           "whichever worker is free: a straggler takes fewer, the update is unchanged)",
           "parallelism", choices=(None,) + DEAL_MODES),
    Option("portion_size", int, None, "--deal portions: samples per portion (default: a "
           "quarter of --batch-size); --optimizer lbfgs: samples per portion of the "
           "training set (default: a sixteenth of it)", "parallelism", metavar="N",
           check=lambda v: None if v >= 1 else "must be at least 1"),
]


def check_deal(deal, portion_size, compressor, group_size, accumulate):
    """True for ``--deal portions`` (checked); ConfigError for what it cannot serve."""
    if deal not in (None, "batches", "portions"):
        raise ConfigError(f"--deal {deal!r}: choose one of {', '.join(DEAL_MODES)}")
    if deal != "portions":
        if portion_size is not None:
            raise ConfigError("--portion-size applies to --deal portions")
        return False
    for given, what in ((compressor is not None, "--compression"),
                        (group_size > 1, "--group-size"),
                        ((accumulate or 1) > 1, "--accumulate")):
        if given:
            raise ConfigError(f"--deal portions pushes each portion's exact gradient on its "
                              f"own: drop {what}")
    return True


def check_model(model):
    """ConfigError for a model whose gradient would depend on who computed a portion."""
    from mpidl.engine.dropout import Dropout  # noqa: PLC0415

    for name, layer in model.modules():
        if isinstance(layer, Dropout) and layer.p > 0:
            raise ConfigError(f"--deal portions: layer {name or 'model'} is Dropout with p "
                              f"{layer.p:g}, whose masks would depend on which worker "
                              "computed a portion; use a model without dropout")


def portion_gradient(model, loss, x, y, lo, hi, measure=None):
    """Forward and backward of samples ``lo:hi`` of the batch ``(x, y)``, the loss
    gradient scaled by the portion's share ``(hi - lo) / len(y)`` of the batch: the
    parameters' ``grad`` is then this portion's term of the batch's mean gradient, and
    ``value * (hi - lo) / len(y)`` its term of the mean loss. Returns ``(value, forward
    seconds, backward seconds)``, ``value`` the portion's mean loss. ``measure()``, when
    given, runs after the forward (the memory ledger reads the activations there).

    Dealt portions and their one-process form (``sum_of_portions``) both run this, so a
    portion's gradient is the same bits whoever computes it."""
    model.zero_grad()
    t0 = perf_counter()
    out = model(x[lo:hi])
    value = float(loss.forward(out, y[lo:hi]))
    if measure is not None:
        measure()
    dy = loss.backward()
    dy *= (hi - lo) / len(y)  # its share of the batch's mean
    t1 = perf_counter()
    model.backprop(dy)
    return value, t1 - t0, perf_counter() - t1


def sum_of_portions(model, loss, x, y, size):
    """The mean loss and gradient of the batch ``(x, y)`` on one process, as dealt portions
    of ``size`` samples give them: each portion's terms (``portion_gradient``) summed in
    portion order, the loss from 0.0 and each gradient from a copy of the first portion's,
    as the servers sum them (dense gradients). Returns ``(loss, {name: gradient})``."""
    n = len(y)
    total, sums = 0.0, {}
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        value, _, _ = portion_gradient(model, loss, x, y, lo, hi)
        total += value * ((hi - lo) / n)
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if name in sums:
                sums[name] += p.grad
            else:
                sums[name] = p.grad.copy()
    return total, sums


class DealtPortions(MicroBatches):
    """The step's schedule: compute the portions the dealer hands this worker.

    ``workers``: how many workers share a global batch (the trainer loads ``workers``
    times ``--batch-size`` samples per step, ``k`` below); ``portion_size``: samples per
    portion (None: a quarter of the batch each worker would have had); ``straggler``,
    ``transient``, ``pace``: as ``MicroBatches`` (each portion takes ``F`` times its
    compute, or ``F * pace`` per sample).
    The runtime hands it the worker (``dealer``) after set-up.
    """

    name = "dealt portions"

    def __init__(self, workers, portion_size=None, straggler=1.0, transient=None, rank=0,
                 pace=None):
        super().__init__(workers, straggler, transient, rank, pace)
        self.portion_size = portion_size
        self.dealer = None  # (PushPull) set by the runtime
        self.wait_s = 0.0
        self.portions_done = 0  # portions this worker computed (all steps)
        self._last_loss = 0.0

    def size(self, n):
        return self.portion_size or max(1, n // (4 * self.k))

    def run(self, model, loss, x, y, arm=None):
        """Compute dealt portions of this global batch until the dealer has none left
        (the update is then taken); returns the mean loss over this worker's portions
        (the last step's when it computed none)."""
        n = len(y)
        size = self.size(n)
        count = -(-n // size)
        slow = self.step_factor()
        fwd = bwd = straggle = 0.0
        total, samples = 0.0, 0
        t = perf_counter()
        portion = self.dealer.deal(count)
        wait = perf_counter() - t
        while portion is not None:
            lo, hi = portion * size, min(n, (portion + 1) * size)
            measure = (lambda: self._measure(model)) if self.measure_activations else None
            value, f_s, b_s = portion_gradient(model, loss, x, y, lo, hi, measure)
            fwd += f_s
            bwd += b_s
            straggle += self.slow_down(f_s + b_s, hi - lo, slow)
            total += value * (hi - lo)
            samples += hi - lo
            self.portions_done += 1
            t = perf_counter()
            portion = self.dealer.push_portion(portion, count,
                                               loss=value * ((hi - lo) / n))
            wait += perf_counter() - t
        self.forward_s, self.backward_s, self.straggle_s = fwd, bwd, straggle
        self.wait_s = wait  # asking, pushing, and waiting for the others and the update
        if samples:
            self._last_loss = total / samples
        return self._last_loss

    def _measure(self, model):
        self.activation_bytes = max(self.activation_bytes, model.activation_nbytes())

    def describe(self):
        size = f"{self.portion_size}-sample" if self.portion_size else "quarter-batch"
        return f"{size} portions of the global batch dealt on demand" + \
            self.describe_transient()


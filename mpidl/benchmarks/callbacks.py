"""What benchmarks plug into the ``Trainer`` instead of copying its loop.

* ``StepTimer``: every step's wall time after ``warmup`` untimed steps, and the
  runtime's time split (forward, backward, wait, update) over the timed steps only.
* ``Snapshots``: copies of the parameters every few seconds of training (after each step
  on a training rank, after each update on a parameter server), evaluated afterwards so
  that evaluation never disturbs the timing.
* ``IndexedView`` and ``batches_as_one_epoch``: a training set the trainer's loader walks
  in an order chosen beforehand (given global batches, one epoch), so a benchmark decides
  exactly which samples each step sees, without an end-of-epoch pause between them.
"""

import time

import numpy as np

from mpidl.data import epoch_permutation
from mpidl.training.callbacks import Callback

_clock = time.perf_counter


class StepTimer(Callback):
    """Times ``steps`` steps after ``warmup`` untimed ones (on every training rank).

    A step's time is the trainer's loop iteration: from the end of the previous step to
    the end of this one (fetching the batch included, as ``mpidl train`` runs it). When
    timing starts, the runtime's counters are zeroed and, with ``barrier=True``, the
    training ranks meet, so every rank's first timed step starts together. When the last
    timed step ends, ``stats`` keeps a copy of the runtime's counters (seconds summed
    over the timed steps): the trainer's end of epoch resets them (``Runtime.metrics``).
    """

    def __init__(self, warmup, steps, barrier=True):
        self.warmup, self.steps, self.barrier = int(warmup), int(steps), barrier
        self.times = []
        self.stats = {}
        self.t_first = self.t_last = None
        self._last = None

    def _start(self, trainer):
        rt = trainer.runtime
        rt.reset_stats()
        if self.barrier:
            rt.barrier()
        self.t_first = self._last = _clock()

    def on_fit_start(self, trainer):
        if trainer.runtime.trains_on_data and self.warmup == 0:
            self._start(trainer)

    def on_step_end(self, trainer, loss):
        step = trainer.step
        if step <= self.warmup:
            if step == self.warmup:
                self._start(trainer)
            return
        if step > self.warmup + self.steps:
            return
        now = _clock()
        self.times.append(now - self._last)
        self._last = now
        if step == self.warmup + self.steps:
            self.t_last = now
            self.stats = dict(trainer.runtime.stats)


class Snapshots(Callback):
    """Copies of the parameters every ``every`` seconds, plus one when training ends.

    On a training rank a copy may be taken after each step, on a parameter server after
    each update (``ParameterServer.on_update``). Times are seconds since ``on_fit_start``
    (put a callback that lines the ranks up before this one). ``items``: [(seconds,
    {name: array})]. Only ranks with ``active`` true take copies.
    """

    def __init__(self, every, active=True):
        self.every, self.active = float(every), bool(active)
        self.items = []
        self.named = None
        self.t0 = None
        self.next = 0.0

    def on_fit_start(self, trainer):
        if not self.active:
            return
        self.named = trainer.model.named_parameters()
        self.t0 = _clock()
        rt = trainer.runtime
        if not rt.trains_on_data:
            rt.server.server.on_update = self.maybe

    def on_step_end(self, trainer, loss):
        if self.active:
            self.maybe()

    def on_fit_end(self, trainer):
        if self.active:
            self.take()

    def maybe(self, *_):
        t = _clock() - self.t0
        if t >= self.next:
            self.take(t)
            self.next = t + self.every

    def take(self, t=None):
        t = _clock() - self.t0 if t is None else t
        self.items.append((t, {n: p.data.copy() for n, p in self.named}))


class IndexedView:
    """``base[index[i]]`` for every ``i``, without copying ``base``: enough of an array
    for ``mpidl.data.BatchLoader`` (``len`` and indexing by an integer array)."""

    def __init__(self, base, index):
        self.base = base
        self.index = np.asarray(index, dtype=np.int64)

    def __len__(self):
        return len(self.index)

    @property
    def shape(self):
        return (len(self.index),) + tuple(self.base.shape[1:])

    @property
    def dtype(self):
        return self.base.dtype

    def __getitem__(self, i):
        return self.base[self.index[i]]


def batches_as_one_epoch(x, y, global_batches, seed):
    """(x', y'): a training set on which the trainer's loader (``seed``, one epoch, global
    batch ``G``) yields exactly ``global_batches`` (a (steps, G) array of indices into
    ``x``, ``y``) in order, each rank its piece of each.

    The loader takes step ``i``'s global batch at positions ``[i*G, (i+1)*G)`` of the
    epoch's permutation ``P`` of the ``steps*G`` samples; so sample ``P[k]`` of the view
    is ``want[k]``, the ``k``-th index of the flattened batches."""
    want = np.asarray(global_batches, dtype=np.int64).reshape(-1)
    order = epoch_permutation(len(want), seed, 0)
    index = np.empty_like(want)
    index[order] = want
    return IndexedView(x, index), IndexedView(y, index)

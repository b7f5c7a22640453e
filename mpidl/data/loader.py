"""Shuffled, sharded mini-batches that every rank agrees on.

Each epoch's order is a permutation drawn from ``(seed, epoch)`` alone, so every rank
computes the same one without communicating, and a resumed run gets the same order as
an uninterrupted one. Step ``i`` of an epoch takes global batch ``i`` — the positions
``[i*G, (i+1)*G)`` of the permutation, ``G = batch_size * count`` — and cuts it into
``count`` contiguous pieces of ``batch_size``; shard ``index`` takes piece ``index``.
So N ranks with batch b see exactly the samples that one rank with batch N*b sees, which
is what makes data-parallel training equal to large-batch training on one process.

Positions: a step starts at a *position* in the epoch's permutation (the samples the
epoch has consumed so far), so a run can change its number of ranks mid-epoch (an
elastic run that lost a rank, a resume on another rank count): the remaining positions
``[P, n)`` are dealt in global batches of the new size, and every sample is still seen
once that epoch. With a fixed rank count, step ``i`` starts at position ``i*G``.

Uneven data: every rank runs the same number of steps, always.
``drop_last=False`` (default) pads the last global batch by wrapping around to the start
of the same epoch's permutation (a few samples are seen twice that epoch, every batch is
full); ``drop_last=True`` drops the incomplete last global batch (those samples are
skipped that epoch; the next epoch's reshuffle skips others).
"""

import numpy as np

from mpidl.backend import to_device
from mpidl.errors import ConfigError


def epoch_permutation(n, seed, epoch):
    """The order of ``n`` samples in ``epoch``: a function of (seed, epoch) only."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
    return rng.permutation(n)


class BatchLoader:
    """Mini-batches of (x, y) for one shard, moved to the device just before use
    (floating-point x in ``dtype``; integer x, such as token ids, keeps its type).

    ``shard=(index, count)``: this loader's piece of every global batch (see the module
    docstring). ``shuffle=False`` keeps the data's order (evaluation, tests).
    ``global_batch``: a global batch of that many samples instead of ``batch_size x
    count``, cut into ``count`` pieces as evenly as possible (``shard_range``; a run that
    keeps its global batch on another number of ranks); ``batch_size`` is then this
    shard's piece.
    """

    def __init__(self, x, y, batch_size, shard=(0, 1), shuffle=True, seed=0,
                 drop_last=False, dtype=None, device=True, global_batch=None):
        index, count = shard
        if batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {batch_size}")
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} out of range for {count} shards")
        if len(x) != len(y):
            raise ValueError(f"{len(x)} inputs but {len(y)} labels")
        self.x, self.y = x, y
        self.index, self.count = int(index), int(count)
        self.global_batch = None if global_batch is None else int(global_batch)
        if self.global_batch is not None:
            if self.global_batch < count:
                raise ConfigError(f"a global batch of {global_batch} cannot be shared by "
                                  f"{count} ranks: give every rank at least one sample")
            lo, hi = shard_range(self.global_batch, self.index, self.count)
            self.piece = (lo, hi)
            batch_size = hi - lo
        else:
            self.piece = (self.index * int(batch_size), (self.index + 1) * int(batch_size))
        self.batch_size = int(batch_size)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.dtype, self.device = dtype, device
        if len(y) == 0:
            raise ConfigError("the training set is empty")
        if drop_last and self.steps_per_epoch == 0:
            raise ConfigError(
                f"global batch {self.global_batch_size} (batch size {batch_size} x "
                f"{count} ranks) is larger than the {len(y)} training samples, and "
                "drop_last drops it: use a smaller --batch-size or turn drop_last off")

    @property
    def num_samples(self):
        return len(self.y)

    @property
    def global_batch_size(self):
        return self.global_batch if self.global_batch is not None else \
            self.batch_size * self.count

    @property
    def steps_per_epoch(self):
        """Steps per epoch, identical on every shard (see the module docstring)."""
        n, g = self.num_samples, self.global_batch_size
        return n // g if self.drop_last else -(-n // g)

    def __len__(self):
        return self.steps_per_epoch

    def order(self, epoch):
        if self.shuffle:
            return epoch_permutation(self.num_samples, self.seed, epoch)
        return np.arange(self.num_samples)

    def steps_from(self, position):
        """Steps left in an epoch whose first ``position`` samples are consumed."""
        left, g = self.num_samples - int(position), self.global_batch_size
        if left <= 0:
            return 0
        return left // g if self.drop_last else -(-left // g)

    def global_indices(self, epoch, step, order=None, position=None):
        """Sample indices of global batch ``step`` of ``epoch`` (all shards together), or
        of the global batch starting at ``position`` when one is given."""
        if position is None:
            if not 0 <= step < self.steps_per_epoch:
                raise IndexError(f"step {step} out of range (epoch has "
                                 f"{self.steps_per_epoch})")
            position = step * self.global_batch_size
        elif not 0 <= position < self.num_samples or self.steps_from(position) == 0:
            raise IndexError(f"position {position} starts no global batch of "
                             f"{self.global_batch_size} in an epoch of {self.num_samples}")
        order = self.order(epoch) if order is None else order
        positions = (np.arange(position, position + self.global_batch_size)
                     % self.num_samples)
        return order[positions]

    def indices(self, epoch, step, order=None, position=None):
        """This shard's sample indices for global batch ``step`` of ``epoch`` (or the one
        at ``position``)."""
        g = self.global_indices(epoch, step, order, position)
        lo, hi = self.piece
        return g[lo:hi]

    def host_batch(self, epoch, step, order=None, position=None):
        idx = self.indices(epoch, step, order, position)
        return self.x[idx], self.y[idx]

    def epoch(self, epoch, start=0):
        """Yield (step, x, y) for steps ``start`` .. end of ``epoch`` (resume mid-epoch)."""
        for i, (_, x, y) in enumerate(self.from_position(epoch, start
                                                         * self.global_batch_size)):
            yield start + i, x, y

    def from_position(self, epoch, position=0):
        """Yield (position, x, y) for the global batches of ``epoch`` that start at
        ``position``, ``position + G``, ... (``position``: samples already consumed)."""
        order = self.order(epoch)
        g = self.global_batch_size
        for i in range(self.steps_from(position)):
            at = position + i * g
            x, y = self.host_batch(epoch, None, order, at)
            if self.device:
                x, y = to_device(x, dtype=input_dtype(x, self.dtype)), to_device(y)
            yield at, x, y


def shard_range(n, index, count):
    """The contiguous ``[lo, hi)`` piece ``index`` of ``count`` nearly equal pieces of ``n``.

    Used for evaluation, where pieces may differ by one and results are summed, not
    averaged per step, so no padding is needed.
    """
    base, extra = divmod(n, count)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def eval_batches(x, y, batch_size, shard=(0, 1), dtype=None, device=True):
    """Yield (x, y) batches of this shard's contiguous piece of an evaluation set."""
    lo, hi = shard_range(len(y), *shard)
    for s in range(lo, hi, batch_size):
        e = min(s + batch_size, hi)
        bx, by = x[s:e], y[s:e]
        if device:
            bx, by = to_device(bx, dtype=input_dtype(bx, dtype)), to_device(by)
        yield bx, by


def lockstep_batches(batches, x, y, batch_size, count, dtype=None):
    """``batches`` (one shard's of ``count``, from ``eval_batches``), then empty batches
    until it has given as many as the shard with the most: for an evaluation whose
    forward is collective over the shards' ranks (every rank must run every forward)."""
    import math  # noqa: PLC0415

    most = max(math.ceil((hi - lo) / batch_size)
               for lo, hi in (shard_range(len(y), i, count) for i in range(count)))
    done = 0
    for batch in batches:
        done += 1
        yield batch
    for _ in range(most - done):
        yield to_device(x[:0], dtype=input_dtype(x[:0], dtype)), to_device(y[:0])


def input_dtype(x, dtype):
    """The dtype a batch of inputs goes to the device in: ``dtype`` (the model's) for
    floating-point inputs, their own for integer ones (token ids stay ids)."""
    return dtype if np.asarray(x).dtype.kind == "f" else None

"""Replay memory: one shard (FIFO ring + sum-tree), and exact sampling over many shards.

A *shard* keeps transitions in a ring of fixed capacity (the oldest is overwritten first:
FIFO eviction) and their priorities ``p_i^alpha`` in a ``SumTree``. Uniform replay is the
same shard with ``alpha = 0`` (every stored transition has priority 1), so one code path
serves DQN, Gorila (uniform) and Ape-X (prioritised).

Sampling over shards is exact and global: with shard totals ``T_s`` and ``T = sum T_s``,
the sampler (the learner) draws ``u ~ U[0, T)``, finds the shard whose cumulative interval
holds ``u`` (shard ``s`` with probability ``T_s / T``) and sends the shard the remainder
``u - sum_{r<s} T_r``, with which the shard walks its own tree (item ``i`` with probability
``p_i / T_s``). The product is ``p_i / T``: the distribution of one big memory holding every
shard's items. Importance weights are PER's ``w_i = (N P(i))^-beta / max_j w_j``, with
``N`` the number of stored transitions over all shards and the max over the sampled batch
(Schaul et al. 2016, Algorithm 1), so the largest weight in a batch is 1.
"""

import numpy as np

from mpidl.rl.sumtree import SumTree

#: the fields of a transition batch (n-step): s_t, a_t, sum_k gamma^k r_{t+k}, s_{t+n}, and
#: the bootstrap discount gamma^n (0 when the episode terminated inside the n steps)
FIELDS = ("obs", "action", "reward", "next_obs", "discount")


def empty_batch(obs_shape):
    return {"obs": np.zeros((0,) + tuple(obs_shape)), "action": np.zeros(0, np.int64),
            "reward": np.zeros(0), "next_obs": np.zeros((0,) + tuple(obs_shape)),
            "discount": np.zeros(0)}


def batch_size(batch):
    return len(batch["action"])


def concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in FIELDS}


def take(batch, idx):
    return {k: batch[k][idx] for k in FIELDS}


class ReplayShard:
    """One shard of the replay memory (a whole memory when there is one shard).

    ``alpha``: priority exponent (0: uniform). ``eps``: added to |TD error| so that no
    transition's priority is 0. New transitions without a priority get the largest
    priority seen so far (PER), so each is likely to be sampled at least once.
    """

    def __init__(self, capacity, obs_shape, alpha=0.6, eps=1e-6):
        self.capacity = int(capacity)
        self.obs_shape = tuple(obs_shape)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.tree = SumTree(self.capacity)
        self.data = {"obs": np.zeros((self.capacity,) + self.obs_shape),
                     "action": np.zeros(self.capacity, np.int64),
                     "reward": np.zeros(self.capacity),
                     "next_obs": np.zeros((self.capacity,) + self.obs_shape),
                     "discount": np.zeros(self.capacity)}
        self.next = 0
        self.size = 0
        self.inserted = 0
        self.sampled = 0
        self.max_priority = 1.0

    @property
    def total(self):
        return self.tree.total

    def _to_tree(self, priorities):
        """|delta| (or a given priority) -> the tree's value p^alpha."""
        if self.alpha == 0.0:
            return np.ones(len(priorities))
        return (np.abs(np.asarray(priorities, dtype=np.float64)) + self.eps) ** self.alpha

    def insert(self, batch, priorities=None):
        """Append a batch (FIFO: overwrite the oldest when full); returns the slots used."""
        n = batch_size(batch)
        if n == 0:
            return np.zeros(0, np.int64)
        got = tuple(batch["obs"].shape[1:])
        if got != self.obs_shape:
            raise ValueError(f"replay shard holds observations of shape {self.obs_shape}, "
                             f"got a batch of shape {got}")
        if priorities is None:
            priorities = np.full(n, self.max_priority)
        priorities = np.abs(np.asarray(priorities, dtype=np.float64))
        self.max_priority = max(self.max_priority, float(priorities.max()))
        if n > self.capacity:  # only the newest `capacity` survive anyway
            batch = {k: v[n - self.capacity:] for k, v in batch.items()}
            priorities = priorities[n - self.capacity:]
            self.inserted += n - self.capacity
            n = self.capacity
        slots = (self.next + np.arange(n)) % self.capacity
        for k in FIELDS:
            self.data[k][slots] = batch[k]
        values = self._to_tree(priorities)
        wrap = self.capacity - self.next  # the slots before the end: one run, then another
        self.tree.update(slots[:wrap], values[:wrap])
        self.tree.update(slots[wrap:], values[wrap:])
        self.next = int((self.next + n) % self.capacity)
        self.size = min(self.size + n, self.capacity)
        self.inserted += n
        return slots

    def sample(self, prefixes):
        """Items at the prefix values ``prefixes`` (each in ``[0, total)``): their slots,
        their tree values ``p^alpha`` and the transitions."""
        slots = self.tree.find(prefixes)
        self.sampled += len(slots)
        return slots, self.tree.get(slots).copy(), take(self.data, slots)

    def update_priorities(self, slots, priorities):
        """New |TD errors| for sampled slots (from the learner)."""
        priorities = np.abs(np.asarray(priorities, dtype=np.float64))
        if len(priorities):
            self.max_priority = max(self.max_priority, float(priorities.max()))
        self.tree.update(slots, self._to_tree(priorities))


def plan(totals, batch, rng):
    """Draw ``batch`` samples over shards with totals ``totals``: returns the shard of each
    draw and its prefix value inside that shard (see the module docstring)."""
    totals = np.asarray(totals, dtype=np.float64)
    T = float(totals.sum())
    if not T > 0:
        raise ValueError("cannot sample: the replay memory is empty")
    u = rng.random(batch) * T
    cum = np.cumsum(totals)
    shard = np.searchsorted(cum, u, side="right")
    # rounding can put u at the very end: give it to the last shard with mass
    last = int(np.flatnonzero(totals > 0)[-1])
    shard = np.minimum(shard, last)
    before = np.concatenate([[0.0], cum[:-1]])
    return shard, u - before[shard]


def importance_weights(tree_values, total, n_stored, beta):
    """PER's weights ``(N P(i))^-beta`` normalised by the batch maximum."""
    p = np.asarray(tree_values, dtype=np.float64) / float(total)
    w = (n_stored * p) ** (-float(beta))
    return w / w.max()


class ShardedReplay:
    """Several shards in one process, sampled exactly as the learner samples remote ones.

    The distributed learner does the same three steps over messages (``apex``): read the
    totals, ``plan``, ask each shard for its share.
    """

    def __init__(self, shards):
        self.shards = list(shards)

    @property
    def size(self):
        return sum(s.size for s in self.shards)

    def sample(self, batch, rng, beta):
        """``(shard, slot, weight, transitions)`` of ``batch`` draws, in draw order."""
        totals = [s.total for s in self.shards]
        shard, prefix = plan(totals, batch, rng)
        slots = np.zeros(batch, np.int64)
        values = np.zeros(batch)
        parts = [None] * len(self.shards)
        for s, sh in enumerate(self.shards):
            mine = np.flatnonzero(shard == s)
            if mine.size:
                slots[mine], values[mine], parts[s] = sh.sample(prefix[mine])
        data = {k: np.zeros((batch,) + self.shards[0].data[k].shape[1:],
                            self.shards[0].data[k].dtype) for k in FIELDS}
        for s, part in enumerate(parts):
            if part is not None:
                mine = np.flatnonzero(shard == s)
                for k in FIELDS:
                    data[k][mine] = part[k]
        w = importance_weights(values, sum(totals), self.size, beta)
        return shard, slots, w, data

    def update_priorities(self, shard, slots, priorities):
        for s, sh in enumerate(self.shards):
            mine = np.flatnonzero(shard == s)
            if mine.size:
                sh.update_priorities(slots[mine], np.asarray(priorities)[mine])


def linear(start, end, fraction):
    """``start`` moved linearly to ``end`` as ``fraction`` goes 0 -> 1 (then held): beta's
    annealing to 1 and epsilon's decay."""
    f = min(max(float(fraction), 0.0), 1.0)
    return start + f * (end - start)

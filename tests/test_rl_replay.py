"""Replay memory: the sum-tree, FIFO eviction, and exact global proportional sampling over
1, 2 and 4 shards (chi-squared over 10^6 draws) with PER's importance weights."""

import numpy as np
import pytest

from mpidl.rl.replay import (ReplayShard, ShardedReplay, importance_weights, linear, plan)
from mpidl.rl.sumtree import SumTree

scipy_stats = pytest.importorskip("scipy.stats", reason="scipy gives the chi-squared p-value")


def transitions(ids, obs_dim=3):
    """Transitions whose reward is their global id (to count draws per item)."""
    ids = np.asarray(ids, dtype=np.float64)
    obs = np.repeat(ids[:, None], obs_dim, axis=1)
    return {"obs": obs, "action": np.zeros(len(ids), np.int64), "reward": ids,
            "next_obs": obs + 1, "discount": np.full(len(ids), 0.99)}


def test_sumtree_total_find_and_update():
    t = SumTree(5)
    t.update([0, 1, 2, 3, 4], [1.0, 0.0, 2.0, 3.0, 4.0])
    assert t.total == 10.0
    # prefix intervals: [0,1) -> 0, [1,3) -> 2, [3,6) -> 3, [6,10) -> 4; leaf 1 has no mass
    got = t.find([0.0, 0.999, 1.0, 2.5, 3.0, 5.99, 6.0, 9.999, 10.0, 50.0, -1.0])
    assert got.tolist() == [0, 0, 2, 2, 3, 3, 4, 4, 4, 4, 0]
    t.update([4], [0.0])
    assert t.total == 6.0 and t.find([5.9999999])[0] == 3
    with pytest.raises(ValueError):
        t.update([0], [-1.0])
    with pytest.raises(IndexError):
        t.update([5], [1.0])


def test_sumtree_runs_of_leaves_hold_the_bits_of_leaf_by_leaf_updates():
    """A run of consecutive leaves (a replay insert) takes the slice path; the same leaves
    in another order take the generic one: every node of the two trees is bitwise equal,
    on trees of odd, power-of-two and replay-sized capacities, runs wrapping the end
    through ReplayShard.insert included."""
    rng = np.random.default_rng(3)
    for cap in (1, 2, 3, 7, 64, 1000):
        runs, generic = SumTree(cap), SumTree(cap)
        for _ in range(200):
            n = int(rng.integers(1, min(cap, 40) + 1))
            first = int(rng.integers(0, cap - n + 1))
            pr = rng.exponential(1.0, n) * rng.choice([1e-8, 1.0, 1e6], n)
            runs.update(np.arange(first, first + n), pr)
            order = rng.permutation(n)  # not a run (unless n == 1): the generic path
            generic.update(first + order, pr[order])
            assert np.array_equal(runs.tree, generic.tree), (cap, first, n)
    a, b = ReplayShard(10, (3,), alpha=0.6), ReplayShard(10, (3,), alpha=0.6)
    for start in (0, 7, 14, 19):  # 7 + 7 wraps at 10, so do the later ones
        p = rng.exponential(1.0, 7)
        slots = a.insert(transitions(range(start, start + 7)), priorities=p)
        b.data = {k: v.copy() for k, v in a.data.items()}
        order = rng.permutation(7)
        b.tree.update(slots[order], b._to_tree(p)[order])
        assert np.array_equal(a.tree.tree, b.tree.tree)


def test_fifo_eviction_keeps_the_newest():
    sh = ReplayShard(4, (3,), alpha=0.0)
    sh.insert(transitions([0, 1, 2]))
    sh.insert(transitions([3, 4]))            # overwrites 0
    assert sh.size == 4 and sh.inserted == 5
    assert sorted(sh.data["reward"].tolist()) == [1.0, 2.0, 3.0, 4.0]
    sh.insert(transitions(range(10, 17)))     # bigger than the shard: newest 4 survive
    assert sorted(sh.data["reward"].tolist()) == [13.0, 14.0, 15.0, 16.0]
    assert sh.total == 4.0                    # uniform: priority 1 each


def build(n_shards, n_items, rng, alpha=0.6):
    """Shards of uneven sizes, with random priorities (a few tiny, a few large)."""
    cuts = np.sort(rng.choice(np.arange(1, n_items), n_shards - 1, replace=False))
    groups = np.split(np.arange(n_items), cuts)
    shards, prio = [], {}
    for g in groups:
        sh = ReplayShard(len(g) + 3, (3,), alpha=alpha)
        p = rng.exponential(1.0, len(g)) * rng.choice([0.01, 1.0, 10.0], len(g))
        sh.insert(transitions(g), priorities=p)
        shards.append(sh)
        for i, pi in zip(g, p):
            prio[int(i)] = (abs(pi) + sh.eps) ** alpha
    return shards, prio


@pytest.mark.parametrize("n_shards", [1, 2, 4])
def test_sharded_sampling_is_global_proportional(n_shards):
    rng = np.random.default_rng(100 + n_shards)
    n_items = 120
    shards, prio = build(n_shards, n_items, rng)
    replay = ShardedReplay(shards)
    expected = np.array([prio[i] for i in range(n_items)])
    expected /= expected.sum()
    counts = np.zeros(n_items)
    draws, batch = 10**6, 50_000
    for _ in range(draws // batch):
        _, _, _, data = replay.sample(batch, rng, beta=0.4)
        counts += np.bincount(data["reward"].astype(np.int64), minlength=n_items)
    assert counts.sum() == draws
    stat, p = scipy_stats.chisquare(counts, expected * draws)
    assert p > 0.01, (stat, p)
    # and the test can fail: the same draws against per-shard-uniform shard choice
    if n_shards > 1:
        wrong = np.zeros(n_items)
        for sh in shards:
            ids = sh.data["reward"][:sh.size].astype(np.int64)
            wrong[ids] = np.array([prio[i] for i in ids]) / sh.total / n_shards
        assert scipy_stats.chisquare(counts, wrong * draws)[1] < 1e-6


def test_importance_weights_equal_the_formula():
    rng = np.random.default_rng(7)
    shards, prio = build(3, 40, rng)
    replay = ShardedReplay(shards)
    total = sum(prio.values())
    beta = 0.55
    shard, slots, w, data = replay.sample(256, rng, beta)
    ids = data["reward"].astype(np.int64)
    P = np.array([prio[i] for i in ids]) / total
    want = (40 * P) ** -beta
    want /= want.max()
    np.testing.assert_allclose(w, want, rtol=1e-12)
    assert w.max() == 1.0
    # the shard and slot returned are where that transition lives
    for s, k, i in zip(shard, slots, ids):
        assert shards[s].data["reward"][k] == i


def test_priority_updates_reach_the_owning_shard():
    rng = np.random.default_rng(3)
    shards, _ = build(2, 10, rng, alpha=1.0)
    replay = ShardedReplay(shards)
    shard, slots, _, data = replay.sample(8, rng, 0.4)
    replay.update_priorities(shard, slots, np.full(8, 5.0))
    for s, k in zip(shard, slots):
        assert shards[s].tree.get([k])[0] == 5.0 + shards[s].eps
    # after the update the sampled items dominate the totals
    assert sum(sh.total for sh in shards) >= 5.0 * len(set(zip(shard, slots)))


def test_plan_and_linear():
    rng = np.random.default_rng(0)
    shard, prefix = plan([0.0, 2.0, 0.0, 1.0], 1000, rng)
    assert set(shard.tolist()) <= {1, 3}
    assert np.all(prefix[shard == 1] < 2.0) and np.all(prefix[shard == 3] < 1.0)
    with pytest.raises(ValueError):
        plan([0.0, 0.0], 3, rng)
    assert linear(0.4, 1.0, 0.5) == pytest.approx(0.7) and linear(0.4, 1.0, 2) == 1.0
    assert importance_weights([1.0, 1.0], 2.0, 2, 0.5).tolist() == [1.0, 1.0]

"""A sum-tree over priorities: O(log n) update and proportional sampling, vectorised.

Leaf ``i`` holds priority ``p_i`` (>= 0); every inner node holds the sum of its two
children, so the root is the total. ``find(v)`` walks down from the root to the leaf whose
prefix interval ``[sum_{j<i} p_j, sum_{j<=i} p_j)`` contains ``v``: a uniform ``v`` in
``[0, total)`` picks leaf ``i`` with probability ``p_i / total``. Parents are recomputed
from their children (never updated by differences), so the tree holds the same bits
whatever the order of earlier updates to other leaves, and no rounding drift builds up.
"""

import numpy as np


class SumTree:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError(f"a sum-tree needs capacity >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.leaves = 1 << max(0, (self.capacity - 1).bit_length())
        self.depth = self.leaves.bit_length() - 1
        self.tree = np.zeros(2 * self.leaves, dtype=np.float64)

    @property
    def total(self):
        return float(self.tree[1])

    def get(self, idx):
        return self.tree[self.leaves + np.asarray(idx, dtype=np.int64)]

    def update(self, idx, priorities):
        """Set the priorities of leaves ``idx`` (a later duplicate index wins)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        pr = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self.capacity:
            raise IndexError(f"sum-tree index out of range [0, {self.capacity})")
        if not np.all(np.isfinite(pr)) or pr.min() < 0:
            raise ValueError("priorities must be finite and >= 0")
        first = int(idx[0])
        if idx.size > 1 and int(idx[-1]) - first == idx.size - 1 \
                and np.array_equal(idx, np.arange(first, first + idx.size)):
            self._update_run(first, pr)
            return
        node = idx + self.leaves
        self.tree[node] = pr
        for _ in range(self.depth):
            node = node >> 1
            if node.size > 1:
                node = np.unique(node)
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]

    def _update_run(self, first, pr):
        """``update`` of the consecutive leaves ``first, first + 1, ...`` (a replay insert):
        the parents of a run of nodes are a run too, so each level is two strided slices
        instead of a sort; the same sums of the same children, so the same bits."""
        t = self.tree
        lo = first + self.leaves
        hi = lo + pr.size  # one past the last
        t[lo:hi] = pr
        for _ in range(self.depth):
            lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
            np.add(t[2 * lo:2 * hi:2], t[2 * lo + 1:2 * hi:2], out=t[lo:hi])

    def find(self, values):
        """Leaf index for each prefix value (clamped into ``[0, total)``)."""
        v = np.array(values, dtype=np.float64).reshape(-1)
        total = self.tree[1]
        if total <= 0:
            raise ValueError("cannot sample from a sum-tree whose total priority is 0")
        np.clip(v, 0.0, np.nextafter(total, 0.0), out=v)
        node = np.ones(v.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = 2 * node
            lsum = self.tree[left]
            # right only when v is past the left sum and the right side has mass (rounding
            # can leave v a hair above a subtree's total)
            right = (v >= lsum) & (self.tree[left + 1] > 0)
            v = np.where(right, v - lsum, v)
            node = np.where(right, left + 1, left)
        return node - self.leaves

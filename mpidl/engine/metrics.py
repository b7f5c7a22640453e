"""Evaluation metrics over a batch; they return counts so ranks can sum them."""

from mpidl.backend import array_module


def accuracy(logits, labels):
    """Number of rows whose arg-max class equals the label (an int)."""
    xp = array_module(logits)
    return int((logits.argmax(axis=1) == xp.asarray(labels)).sum())


def top_k_correct(logits, labels, k=5):
    """Number of rows whose label is among the ``k`` largest logits (an int)."""
    xp = array_module(logits)
    k = min(int(k), logits.shape[1])
    top = xp.argpartition(-logits, k - 1, axis=1)[:, :k]
    return int((top == xp.asarray(labels)[:, None]).any(axis=1).sum())

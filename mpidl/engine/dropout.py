"""Inverted dropout with reproducible masks."""

import numpy as np

from mpidl.backend import array_module, to_numpy
from mpidl.engine.module import Layer


class Dropout(Layer):
    """Zero each element with probability ``p`` in training, scale the rest by
    ``1 / (1 - p)``; identity in eval mode.

    The mask of the k-th training forward is drawn on the host from
    ``numpy.random.default_rng((seed, stream, k))`` and moved to the input's device, so
    masks are the same on CPU and GPU and a run resumed from a checkpoint draws the same
    masks: k is the buffer ``calls``, saved with the model's state. ``stream`` is the
    rank's share of the data (the strategy sets it): replicas built from the same seed
    must not drop the same units on every rank.
    """

    def __init__(self, p=0.5, seed=0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout p must be in [0, 1), got {p}")
        self.p = float(p)
        self.seed = int(seed)
        self.stream = 0
        self.add_buffer("calls", np.zeros((), dtype=np.int64))

    def forward(self, x):
        if not self.training or self.p == 0.0:
            self.save_for_backward(None)
            return x
        xp = array_module(x)
        calls = int(to_numpy(self._buffers["calls"]))
        rng = np.random.default_rng((self.seed, self.stream, calls))
        self._buffers["calls"] = xp.asarray(np.int64(calls + 1))
        mask = self._draw(x.shape, rng).astype(x.dtype)
        mask *= 1.0 / (1.0 - self.p)
        mask = xp.asarray(mask)
        self.save_for_backward(mask)
        return x * mask

    def _draw(self, shape, rng):
        """The boolean keep-mask of one forward (tensor parallelism draws a wider one)."""
        return rng.random(shape, dtype=np.float32) >= self.p

    def backward(self, dy):
        (mask,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        if mask is not None:
            dy *= mask
        return dy

    def __repr__(self):
        return f"Dropout(p={self.p})"

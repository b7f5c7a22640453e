"""Shape-only layers."""

import math

from mpidl.engine._util import shape_str
from mpidl.engine.module import Layer, ShapeError


class Flatten(Layer):
    """``(N, d1, d2, ...) -> (N, d1 * d2 * ...)``, in C (NCHW) order."""

    def forward(self, x):
        if x.ndim < 1:
            raise ShapeError(f"Flatten needs a batch axis, got a scalar (shape {shape_str(x)})")
        self.save_for_backward(x.shape)
        # the width spelled out: -1 is ambiguous for an empty batch (the hybrid's
        # evaluation runs some on ranks with fewer test samples)
        return x.reshape(x.shape[0], math.prod(x.shape[1:]))

    def backward(self, dy):
        (shape,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        return dy.reshape(shape)

    def __repr__(self):
        return "Flatten()"


class Reshape(Layer):
    """Reshape every sample to ``shape`` (the batch axis is kept)."""

    def __init__(self, *shape):
        super().__init__()
        self.shape = tuple(int(d) for d in (shape[0] if len(shape) == 1 and
                                            isinstance(shape[0], (tuple, list)) else shape))

    def forward(self, x):
        try:
            y = x.reshape((x.shape[0],) + self.shape)
        except ValueError:
            raise ShapeError(f"Reshape cannot turn samples of shape {shape_str(x)[1:]} into "
                             f"{self.shape} (input shape {shape_str(x)})") from None
        self.save_for_backward(x.shape)
        return y

    def backward(self, dy):
        (shape,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        return dy.reshape(shape)

    def __repr__(self):
        return f"Reshape{self.shape}"

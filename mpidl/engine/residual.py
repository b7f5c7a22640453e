"""Residual connections: ``y = relu(body(x) + shortcut(x))``."""

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu
from mpidl.engine.activations import ReLU  # noqa: F401 - re-exported for block builders
from mpidl.engine.conv import Conv2d
from mpidl.engine.init import as_generator
from mpidl.engine.module import Layer, Sequential, ShapeError
from mpidl.engine.normalization import BatchNorm2d


class Residual(Layer):
    """``y = relu(body(x) + shortcut(x))``; the shortcut is the identity when None.

    The children are named ``body`` and ``shortcut``, so parameter names read like
    ``"2.body.0.weight"`` and ``"2.shortcut.0.weight"`` and stay stable. Set
    ``activation=False`` for ``y = body(x) + shortcut(x)`` (pre-activation designs).
    """

    def __init__(self, body, shortcut=None, activation=True):
        super().__init__()
        self.body = body
        self.shortcut = shortcut
        self.activation = bool(activation)

    def children(self):
        kids = [("body", self.body)]
        if self.shortcut is not None:
            kids.append(("shortcut", self.shortcut))
        return kids

    def forward(self, x):
        xp = array_module(x)
        for _, child in self.children():
            child.needs_input_grad = self.needs_input_grad
        main = self.body(x)
        side = x if self.shortcut is None else self.shortcut(x)
        if main.shape != side.shape:
            raise ShapeError(f"Residual body gives shape {tuple(main.shape)} but the shortcut "
                             f"gives {tuple(side.shape)}; give the block a shortcut that "
                             f"matches (e.g. a strided 1x1 Conv2d)")
        y = _fused_gpu.add(main, side) if is_gpu_array(main) else main + side
        if self.activation:
            if is_gpu_array(y):
                _fused_gpu.relu_inplace(y)
            else:
                xp.maximum(y, 0, out=y)
            self.save_for_backward(y)
        else:
            self.save_for_backward()
        return y

    def backward(self, dy):
        saved = self.saved_for_backward()
        if self.activation:
            if is_gpu_array(dy):
                _fused_gpu.relu_backward(dy, saved[0])
            else:
                array_module(dy).multiply(dy, saved[0] > 0, out=dy)
        # Both branches get dy; each may overwrite what it is given, so one gets a copy.
        # The shortcut goes first: its parameters come after the body's in
        # named_parameters(), so its gradients are due first in backward order (data
        # parallelism's buckets fill in that order).
        copy = _fused_gpu.copy if is_gpu_array(dy) else (lambda a: a.copy())
        dy_body = copy(dy) if self.needs_input_grad or self.shortcut is not None else dy
        if self.shortcut is None:
            dx_side = dy
        else:
            dx_side = self.shortcut.backprop(dy)
        dx_body = self.body.backprop(dy_body)
        if not self.needs_input_grad:
            return None
        dx_body += dx_side
        return dx_body

    def __repr__(self):
        def describe(layer):
            n = len(getattr(layer, "layers", ()))
            return f"{type(layer).__name__}[{n}]" if n else repr(layer)

        side = "identity" if self.shortcut is None else describe(self.shortcut)
        return f"Residual(body={describe(self.body)}, shortcut={side})"


def basic_block(in_channels, out_channels, stride=1, rng=None, dtype="float32"):
    """The ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN plus a shortcut (identity, or
    a strided 1x1 conv + BN when the shape changes), then ReLU."""
    rng = as_generator(rng)
    body = Sequential(
        Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False, rng=rng,
               dtype=dtype),
        BatchNorm2d(out_channels, dtype=dtype),
        ReLU(),
        Conv2d(out_channels, out_channels, 3, padding=1, bias=False, rng=rng, dtype=dtype),
        BatchNorm2d(out_channels, dtype=dtype),
    )
    shortcut = None
    if stride != 1 or in_channels != out_channels:
        shortcut = Sequential(
            Conv2d(in_channels, out_channels, 1, stride=stride, bias=False, rng=rng,
                   dtype=dtype),
            BatchNorm2d(out_channels, dtype=dtype),
        )
    return Residual(body, shortcut)

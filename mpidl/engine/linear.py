"""Fully connected layer: ``y = x @ weight + bias``."""

from functools import partial

from mpidl.backend import is_gpu_array
from mpidl.engine._util import as_input, colsum, float_dtype, shape_str
from mpidl.engine.gemm import matmul
from mpidl.engine.init import initialize
from mpidl.engine.module import Layer, ShapeError


class Linear(Layer):
    """``y = x @ weight + bias`` over the last axis of ``x``.

    ``weight`` has shape ``(in_features, out_features)`` (the transpose of PyTorch's), so
    forward is one GEMM without a transposed operand. Leading axes of ``x`` are batch axes.
    """

    def __init__(self, in_features, out_features, bias=True, init="he_uniform", rng=None,
                 dtype="float32"):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear needs positive sizes, got in_features={in_features}, "
                             f"out_features={out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.dtype = float_dtype(dtype)
        self.weight = self.add_param("weight", initialize(
            init, (in_features, out_features), in_features, out_features, rng, self.dtype))
        self.bias = None
        if bias:
            self.bias = self.add_param("bias", initialize(
                "zeros", (out_features,), in_features, out_features, rng, self.dtype))

    def forward(self, x):
        x, xp = as_input(x, self.dtype, self.weight.data)
        if x.ndim < 2 or x.shape[-1] != self.in_features:
            got = x.shape[-1] if x.ndim else 0
            hint = "; add a Flatten before it" if x.ndim > 2 else ""
            raise ShapeError(f"Linear expects {self.in_features} input features, got {got} "
                             f"(input shape {shape_str(x)}){hint}")
        self.save_for_backward(x)
        x2 = x.reshape(-1, self.in_features)
        y = matmul(x2, self.weight.data)
        if self.bias is not None:
            y += self.bias.data
        return y.reshape(x.shape[:-1] + (self.out_features,))

    def backward(self, dy):
        (x,) = self.saved_for_backward()
        x2 = x.reshape(-1, self.in_features)
        dy2 = dy.reshape(-1, self.out_features)
        if self.deferred_grads is None:
            self._weight_grads(x2, dy2)
        else:  # for a later pass; dy is this layer's to keep (Layer's conventions)
            self.deferred_grads.append(partial(self._weight_grads, x2, dy2))
        if not self.needs_input_grad:
            return None
        return matmul(dy2, self.weight.data.T).reshape(x.shape)

    def _weight_grads(self, x2, dy2):
        self.weight.accumulate(matmul(x2.T, dy2))
        if self.bias is not None:
            self.bias.accumulate(colsum(dy2) if is_gpu_array(dy2) else dy2.sum(axis=0))

    def __repr__(self):
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}"
                f"{'' if self.bias is not None else ', bias=False'})")

"""Element-wise activations. Backward works in place on ``dy`` (see Layer)."""

import math

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu
from mpidl.engine.module import Layer


class ReLU(Layer):
    """``max(x, 0)``; the gradient at 0 is taken as 0."""

    def forward(self, x):
        xp = array_module(x)
        y = _fused_gpu.relu_forward(x) if is_gpu_array(x) else xp.maximum(x, 0)
        self.save_for_backward(y)
        return y

    def backward(self, dy):
        (y,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        if is_gpu_array(dy):
            return _fused_gpu.relu_backward(dy, y)
        xp = array_module(dy)
        # One fused pass, no float temporary: dy *= (y > 0).
        return xp.multiply(dy, y > 0, out=dy)

    def __repr__(self):
        return "ReLU()"


class LeakyReLU(Layer):
    """``x`` for ``x > 0``, ``negative_slope * x`` otherwise."""

    def __init__(self, negative_slope=0.01):
        super().__init__()
        if negative_slope < 0:
            raise ValueError(f"negative_slope must be >= 0, got {negative_slope}")
        self.negative_slope = float(negative_slope)

    def forward(self, x):
        xp = array_module(x)
        pos = x > 0
        self.save_for_backward(pos)
        return xp.where(pos, x, x * self.negative_slope)

    def backward(self, dy):
        (pos,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        dy[~pos] *= self.negative_slope
        return dy

    def __repr__(self):
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class Tanh(Layer):
    def forward(self, x):
        y = array_module(x).tanh(x)
        self.save_for_backward(y)
        return y

    def backward(self, dy):
        (y,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        dy *= 1.0 - y * y
        return dy

    def __repr__(self):
        return "Tanh()"


class Sigmoid(Layer):
    """``1 / (1 + exp(-x))``, computed as ``0.5 * (1 + tanh(x / 2))`` (no overflow)."""

    def forward(self, x):
        xp = array_module(x)
        y = xp.tanh(x * 0.5)
        y += 1.0
        y *= 0.5
        self.save_for_backward(y)
        return y

    def backward(self, dy):
        (y,) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        dy *= y * (1.0 - y)
        return dy

    def __repr__(self):
        return "Sigmoid()"


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


class GELU(Layer):
    """GELU, tanh approximation (PyTorch's ``approximate="tanh"``, GPT-2/BERT's form):
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. Chosen over the erf form
    because NumPy has no ``erf``; the two differ by < 1e-3."""

    def forward(self, x):
        xp = array_module(x)
        inner = x * x
        inner *= _GELU_C
        inner += 1.0
        inner *= x
        inner *= _SQRT_2_OVER_PI
        t = xp.tanh(inner)
        self.save_for_backward(x, t)
        y = t + 1.0
        y *= x
        y *= 0.5
        return y

    def backward(self, dy):
        x, t = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3c x^2)
        inner_d = x * x
        inner_d *= 3.0 * _GELU_C
        inner_d += 1.0
        inner_d *= _SQRT_2_OVER_PI
        sech2 = 1.0 - t * t
        sech2 *= inner_d
        sech2 *= x
        sech2 += t
        sech2 += 1.0
        sech2 *= 0.5
        dy *= sech2
        return dy

    def __repr__(self):
        return "GELU(approximate='tanh')"

"""Batch and layer normalization."""

from mpidl.backend import array_module
from mpidl.engine._util import as_input, float_dtype, shape_str
from mpidl.engine.init import initialize
from mpidl.engine.module import Layer, ShapeError


class _BatchNorm(Layer):
    """Normalize each channel (axis 1) over the batch and the remaining axes.

    Training: batch mean and biased variance normalize; the running statistics move by
    ``running = (1 - momentum) * running + momentum * batch`` with the *unbiased*
    variance (PyTorch's convention). Eval: the running statistics normalize.
    ``weight`` (gamma) starts at 1, ``bias`` (beta) at 0; the buffers are
    ``running_mean`` and ``running_var``.
    """

    kind = "BatchNorm"
    ndims = ()

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, dtype="float32"):
        super().__init__()
        if num_features < 1:
            raise ValueError(f"{self.kind} needs num_features >= 1, got {num_features}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{self.kind} momentum must be in [0, 1], got {momentum}")
        if eps <= 0:
            raise ValueError(f"{self.kind} eps must be > 0, got {eps}")
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), float(momentum)
        self.dtype = float_dtype(dtype)
        c = self.num_features
        self.weight = self.bias = None
        if affine:
            self.weight = self.add_param("weight", initialize("ones", (c,), dtype=self.dtype))
            self.bias = self.add_param("bias", initialize("zeros", (c,), dtype=self.dtype))
        self.add_buffer("running_mean", initialize("zeros", (c,), dtype=self.dtype))
        self.add_buffer("running_var", initialize("ones", (c,), dtype=self.dtype))

    def _check(self, x):
        if x.ndim not in self.ndims or x.shape[1] != self.num_features:
            dims = " or ".join(f"{d}-D" for d in self.ndims)
            raise ShapeError(f"{self.kind} expects {dims} input with {self.num_features} "
                             f"channels on axis 1, got shape {shape_str(x)}")

    def forward(self, x):
        x, xp = as_input(x, self.dtype)
        self._check(x)
        axes = (0,) + tuple(range(2, x.ndim))
        bshape = (1, -1) + (1,) * (x.ndim - 2)
        count = x.size // self.num_features
        if self.training:
            if count < 2:
                raise ShapeError(f"{self.kind} in training mode needs more than one value "
                                 f"per channel, got input shape {shape_str(x)}")
            mean = x.mean(axis=axes)
            xhat = x - mean.reshape(bshape)
            var = (xhat * xhat).mean(axis=axes)  # two passes: no cancellation
            inv_std = 1.0 / xp.sqrt(var + self.eps)
            xhat *= inv_std.reshape(bshape)
            m = self.momentum
            self._buffers["running_mean"] = (1.0 - m) * self._buffers["running_mean"] + m * mean
            self._buffers["running_var"] = ((1.0 - m) * self._buffers["running_var"]
                                            + (m * count / (count - 1)) * var)
        else:
            inv_std = 1.0 / xp.sqrt(self._buffers["running_var"] + self.eps)
            xhat = x - self._buffers["running_mean"].reshape(bshape)
            xhat *= inv_std.reshape(bshape)
        self._xhat, self._inv_std, self._axes, self._bshape = xhat, inv_std, axes, bshape
        if self.weight is None:
            return xhat.copy()  # backward reuses xhat's memory
        y = xhat * self.weight.data.reshape(bshape)
        y += self.bias.data.reshape(bshape)
        return y

    def backward(self, dy):
        xhat, inv_std, axes, bshape = self._xhat, self._inv_std, self._axes, self._bshape
        self._xhat = None
        dbeta = dy.sum(axis=axes)
        dgamma = (dy * xhat).sum(axis=axes)
        if self.weight is not None:
            self.weight.grad, self.bias.grad = dgamma, dbeta
        if not self.needs_input_grad:
            return None
        gamma = self.weight.data if self.weight is not None else 1.0
        if not self.training:  # the statistics are constants
            dy *= (gamma * inv_std).reshape(bshape)
            return dy
        # dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat))
        scale = 1.0 / (dy.size // self.num_features)
        xhat *= (dgamma * scale).reshape(bshape)
        dy -= (dbeta * scale).reshape(bshape)
        dy -= xhat
        dy *= (gamma * inv_std).reshape(bshape)
        return dy

    def __repr__(self):
        return f"{self.kind}({self.num_features})"


class BatchNorm1d(_BatchNorm):
    """Batch normalization of ``(N, C)`` or ``(N, C, L)`` inputs."""

    kind = "BatchNorm1d"
    ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalization of ``(N, C, H, W)`` inputs, per channel over N, H and W."""

    kind = "BatchNorm2d"
    ndims = (4,)


class LayerNorm(Layer):
    """Normalize each sample over its last ``len(normalized_shape)`` axes, then scale by
    ``weight`` and shift by ``bias`` (both of ``normalized_shape``)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, dtype="float32"):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        if not self.normalized_shape or min(self.normalized_shape) < 1:
            raise ValueError(f"LayerNorm needs a non-empty positive normalized_shape, got "
                             f"{normalized_shape}")
        if eps <= 0:
            raise ValueError(f"LayerNorm eps must be > 0, got {eps}")
        self.eps = float(eps)
        self.dtype = float_dtype(dtype)
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = self.add_param("weight", initialize("ones", self.normalized_shape,
                                                              dtype=self.dtype))
            self.bias = self.add_param("bias", initialize("zeros", self.normalized_shape,
                                                          dtype=self.dtype))

    def forward(self, x):
        x, xp = as_input(x, self.dtype)
        k = len(self.normalized_shape)
        if x.ndim <= k or tuple(x.shape[-k:]) != self.normalized_shape:
            raise ShapeError(f"LayerNorm expects inputs ending in {self.normalized_shape} "
                             f"after a batch axis, got shape {shape_str(x)}")
        axes = tuple(range(x.ndim - k, x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        xhat = x - mean
        var = (xhat * xhat).mean(axis=axes, keepdims=True)
        inv_std = 1.0 / xp.sqrt(var + self.eps)
        xhat *= inv_std
        self._xhat, self._inv_std, self._axes = xhat, inv_std, axes
        if self.weight is None:
            return xhat.copy()
        y = xhat * self.weight.data
        y += self.bias.data
        return y

    def backward(self, dy):
        xhat, inv_std, axes = self._xhat, self._inv_std, self._axes
        self._xhat = None
        if self.weight is not None:
            batch_axes = tuple(range(dy.ndim - len(axes)))
            self.weight.grad = (dy * xhat).sum(axis=batch_axes)
            self.bias.grad = dy.sum(axis=batch_axes)
            dy *= self.weight.data  # dy now is d(loss)/d(xhat)
        if not self.needs_input_grad:
            return None
        # dx = inv_std * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        proj = (dy * xhat).mean(axis=axes, keepdims=True)
        avg = dy.mean(axis=axes, keepdims=True)
        xhat *= proj
        dy -= avg
        dy -= xhat
        dy *= inv_std
        return dy

    def __repr__(self):
        return f"LayerNorm({self.normalized_shape})"

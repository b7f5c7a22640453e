"""Batch and layer normalization."""

from mpidl.backend import array_module
from mpidl.engine._util import as_input, colsum, float_dtype, shape_str
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

    def _rows(self, a):
        """``a`` as a ``(rows, C)`` matrix over channels-last memory: a free view for the
        NHWC memory the conv layers produce (one transposing copy otherwise)."""
        xp = array_module(a)
        at = xp.moveaxis(a, 1, -1) if a.ndim > 2 else a
        if not at.flags.c_contiguous:
            at = xp.ascontiguousarray(at)
        return at.reshape(-1, self.num_features), at.shape

    def forward(self, x):
        x, xp = as_input(x, self.dtype, self._buffers["running_mean"])
        self._check(x)
        x2, tshape = self._rows(x)
        count = x2.shape[0]
        if self.training:
            if count < 2:
                raise ShapeError(f"{self.kind} in training mode needs more than one value "
                                 f"per channel, got input shape {shape_str(x)}")
            mean = colsum(x2) * (1.0 / count)
            xhat = x2 - mean
            var = xp.einsum("ij,ij->j", xhat, xhat) * (1.0 / count)  # two passes: no cancellation
            inv_std = 1.0 / xp.sqrt(var + self.eps)
            m = self.momentum
            self._buffers["running_mean"] = (1.0 - m) * self._buffers["running_mean"] + m * mean
            self._buffers["running_var"] = ((1.0 - m) * self._buffers["running_var"]
                                            + (m * count / (count - 1)) * var)
        else:
            inv_std = 1.0 / xp.sqrt(self._buffers["running_var"] + self.eps)
            xhat = x2 - self._buffers["running_mean"]
        # xhat holds x - mean; the 1/std factor is folded into the per-channel scales
        # (one pass fewer over the activations).
        self._xhat, self._inv_std, self._tshape = xhat, inv_std, tshape
        scale = inv_std if self.weight is None else self.weight.data * inv_std
        y = xhat * scale
        if self.bias is not None:
            y += self.bias.data
        return self._unrows(y)

    def _unrows(self, a2):
        xp = array_module(a2)
        a = a2.reshape(self._tshape)
        return xp.moveaxis(a, -1, 1) if a.ndim > 2 else a

    def backward(self, dy):
        xhat, inv_std = self._xhat, self._inv_std
        self._xhat = None
        xp = array_module(dy)
        dy2, _ = self._rows(dy)
        dbeta = colsum(dy2)
        dgamma = xp.einsum("ij,ij->j", dy2, xhat) * inv_std
        if self.weight is not None:
            self.weight.grad, self.bias.grad = dgamma, dbeta
        if not self.needs_input_grad:
            return None
        gamma = self.weight.data if self.weight is not None else 1.0
        if not self.training:  # the statistics are constants
            dy2 *= gamma * inv_std
            return self._unrows(dy2)
        # dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat))
        scale = 1.0 / dy2.shape[0]
        xhat *= dgamma * (inv_std * scale)  # (x - mean) * inv_std * mean(dy * xhat)
        dy2 -= dbeta * scale
        dy2 -= xhat
        dy2 *= gamma * inv_std
        return self._unrows(dy2)

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
        x, xp = as_input(x, self.dtype, self.weight.data if self.weight is not None else None)
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


def recalibrate_batchnorm(model, x, batch=250):
    """Recompute every BatchNorm's running statistics for the current parameters as the
    plain average over the batches of ``x`` ("precise BN"); leaves the model in eval mode.

    For parameters that no training forward produced statistics for: a parameter
    server's copy (the workers hold the statistics) or a benchmark's snapshot."""
    layers = [m for _, m in model.modules() if isinstance(m, _BatchNorm)]
    if not layers:
        return
    saved = [bn.momentum for bn in layers]
    for bn in layers:
        bn.set_buffer("running_mean", bn._buffers["running_mean"] * 0)
        bn.set_buffer("running_var", bn._buffers["running_var"] * 0 + 1)
    model.train()
    for k, start in enumerate(range(0, len(x), batch)):
        for bn in layers:
            bn.momentum = 1.0 / (k + 1)
        model.forward(x[start:start + batch])
    for bn, m in zip(layers, saved):
        bn.momentum = m
    model.eval()

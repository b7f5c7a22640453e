"""Batch and layer normalization, and synchronized batch normalization."""

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu
from mpidl.engine._util import as_input, colsum, column_dot, float_dtype, shape_str
from mpidl.engine.init import initialize
from mpidl.engine.module import Layer, ShapeError


class _BatchNorm(Layer):
    """Normalize each channel (axis 1) over the batch and the remaining axes.

    Training: batch mean and biased variance normalize; the running statistics move by
    ``running = (1 - momentum) * running + momentum * batch`` with the *unbiased*
    variance (PyTorch's convention). Eval: the running statistics normalize.
    ``weight`` (gamma) starts at 1, ``bias`` (beta) at 0; the buffers are
    ``running_mean`` and ``running_var``.

    ``sync_group`` (an mpidl ``Communicator``; None: off): in training, the statistics
    are those of the batch of every rank of the group together, as if one process held
    the concatenation (SyncBatchNorm). Forward all-reduces the per-channel sums with the
    value count, then the per-channel sums of squared deviations (two passes, as without
    the group: no cancellation); backward all-reduces the per-channel sums of ``dy`` and
    ``dy * xhat``. Three blocking all-reduces of ``2C + 1`` values at most, every rank of
    the group must take part; eval mode communicates nothing. Weight and bias gradients
    stay local (the rank's own samples), to be averaged by data parallelism like every
    other gradient. Counts travel in the data's dtype: exact up to 2**24 values per
    channel over the group in float32 (2**53 in float64).
    """

    kind = "BatchNorm"
    ndims = ()

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, dtype="float32",
                 sync_group=None):
        super().__init__()
        if num_features < 1:
            raise ValueError(f"{self.kind} needs num_features >= 1, got {num_features}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{self.kind} momentum must be in [0, 1], got {momentum}")
        if eps <= 0:
            raise ValueError(f"{self.kind} eps must be > 0, got {eps}")
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), float(momentum)
        self.dtype = float_dtype(dtype)
        self.sync_group = sync_group
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

    def _allreduce(self, buf):
        """Sum ``buf`` over the sync group in place (every rank of it must call too)."""
        self.sync_group.allreduce(buf, out=buf, op="sum")
        return buf

    def _batch_stats(self, x, x2, xp, group):
        """Mean, x - mean, biased variance and value count of the batch (over ``group``
        when there is one)."""
        c = self.num_features
        if group is None:
            count = sums = x2.shape[0]
            if count >= 2:
                sums = colsum(x2)
        else:
            buf = xp.empty(c + 1, dtype=x2.dtype)
            buf[:c] = colsum(x2)
            buf[c] = x2.shape[0]
            self._allreduce(buf)
            sums, count = buf[:c], int(buf[c])
        if count < 2:  # with a group, every rank sees the same count: all raise
            where = "" if group is None else f" over the sync group ({count} in all)"
            raise ShapeError(f"{self.kind} in training mode needs more than one value "
                             f"per channel{where}, got input shape {shape_str(x)}")
        mean = sums * (1.0 / count)
        xhat = x2 - mean
        sq = column_dot(xhat, xhat)  # two passes: no cancellation
        if group is not None:
            sq = self._allreduce(xp.ascontiguousarray(sq))
        var = sq * (1.0 / count)
        return mean, xhat, var, count

    def forward(self, x):
        x, xp = as_input(x, self.dtype, self._buffers["running_mean"])
        self._check(x)
        x2, tshape = self._rows(x)
        batch_stats = self.training
        group = self.sync_group if batch_stats else None
        if batch_stats and is_gpu_array(x) and _fused_gpu.enabled:
            mean, xhat, var, count = self._batch_stats(x, x2, xp, group)
            y, inv_std = _fused_gpu.batchnorm_forward(
                xhat, mean, var, None if self.weight is None else self.weight.data,
                None if self.bias is None else self.bias.data, self._buffers["running_mean"],
                self._buffers["running_var"], self.eps, self.momentum, count)
            self.save_for_backward(xhat, inv_std, tshape, batch_stats, group, count)
            return self._unrows(y, tshape)
        if batch_stats:
            mean, xhat, var, count = self._batch_stats(x, x2, xp, group)
            inv_std = 1.0 / xp.sqrt(var + self.eps)
            # in place (the same roundings as (1 - m) * old + m * new): a captured CUDA
            # graph replays writes into the arrays it saw, never a rebinding
            m = self.momentum
            running_mean, running_var = self._buffers["running_mean"], self._buffers["running_var"]
            running_mean *= 1.0 - m
            running_mean += m * mean
            running_var *= 1.0 - m
            running_var += (m * count / (count - 1)) * var
        else:
            count = x2.shape[0]
            inv_std = 1.0 / xp.sqrt(self._buffers["running_var"] + self.eps)
            xhat = x2 - self._buffers["running_mean"]
        # xhat holds x - mean; the 1/std factor is folded into the per-channel scales
        # (one pass fewer over the activations).
        self.save_for_backward(xhat, inv_std, tshape, batch_stats, group, count)
        scale = inv_std if self.weight is None else self.weight.data * inv_std
        y = xhat * scale
        if self.bias is not None:
            y += self.bias.data
        return self._unrows(y, tshape)

    @staticmethod
    def _unrows(a2, tshape):
        xp = array_module(a2)
        a = a2.reshape(tshape)
        return xp.moveaxis(a, -1, 1) if a.ndim > 2 else a

    def backward(self, dy):
        xhat, inv_std, tshape, batch_stats, group, count = self.saved_for_backward()
        xp = array_module(dy)
        dy2, _ = self._rows(dy)
        dbeta = colsum(dy2)
        dxhat_sum = column_dot(dy2, xhat)
        dgamma = dxhat_sum * inv_std
        if self.weight is not None:
            self.weight.accumulate(dgamma)
            self.bias.accumulate(dbeta)
        if not self.needs_input_grad:
            return None
        gamma = self.weight.data if self.weight is not None else 1.0
        if not batch_stats:  # the statistics are constants
            dy2 *= gamma * inv_std
            return self._unrows(dy2, tshape)
        if group is not None:
            # the mean and variance depend on every rank's batch: so does dx (the group
            # the forward used, even if sync_group changed since)
            c = self.num_features
            buf = xp.empty(2 * c, dtype=dy2.dtype)
            buf[:c] = dbeta
            buf[c:] = dxhat_sum
            group.allreduce(buf, out=buf, op="sum")
            dbeta, dgamma = buf[:c], buf[c:] * inv_std
        # dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat))
        if is_gpu_array(dy2) and _fused_gpu.enabled:
            _fused_gpu.batchnorm_input_grad(
                dy2, xhat, dgamma, dbeta, inv_std,
                None if self.weight is None else self.weight.data, count)
            return self._unrows(dy2, tshape)
        scale = 1.0 / count
        xhat *= dgamma * (inv_std * scale)  # (x - mean) * inv_std * mean(dy * xhat)
        dy2 -= dbeta * scale
        dy2 -= xhat
        dy2 *= gamma * inv_std
        return self._unrows(dy2, tshape)

    def __repr__(self):
        sync = "" if self.sync_group is None else f", sync over {self.sync_group.size} rank(s)"
        return f"{self.kind}({self.num_features}{sync})"


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
        self.save_for_backward(xhat, inv_std, axes)
        if self.weight is None:
            return xhat.copy()
        y = xhat * self.weight.data
        y += self.bias.data
        return y

    def backward(self, dy):
        xhat, inv_std, axes = self.saved_for_backward()
        if self.weight is not None:
            batch_axes = tuple(range(dy.ndim - len(axes)))
            self.weight.accumulate((dy * xhat).sum(axis=batch_axes))
            self.bias.accumulate(dy.sum(axis=batch_axes))
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
    server's copy (the workers hold the statistics) or a benchmark's snapshot. The
    forwards run in training mode: a BatchNorm with a ``sync_group`` communicates, so
    every rank of the group must recalibrate too (or unset it first with
    ``convert_sync_batchnorm(model, None)``)."""
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


def convert_sync_batchnorm(model, group):
    """Make every BatchNorm1d/2d under ``model`` a synchronized one over ``group`` (an
    mpidl ``Communicator``; None turns synchronization off again). Returns how many
    layers it set, so a caller can tell a model without BatchNorm."""
    if group is not None and not (hasattr(group, "allreduce") and hasattr(group, "size")):
        raise TypeError(f"convert_sync_batchnorm needs an mpidl Communicator (with allreduce "
                        f"and size) or None, got {group!r}")
    layers = [m for _, m in model.modules() if isinstance(m, _BatchNorm)]
    for bn in layers:
        bn.sync_group = group
    return len(layers)

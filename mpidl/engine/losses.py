"""Losses: ``value = loss.forward(output, target)`` (a Python float, the batch mean) and
``dy = loss.backward()`` (the gradient of that mean with respect to ``output``)."""

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu
from mpidl.engine._util import shape_str
from mpidl.engine.metrics import accuracy
from mpidl.engine.module import ShapeError


class Loss:
    def __call__(self, output, target):
        return self.forward(output, target)

    @staticmethod
    def correct(output, labels):
        """Number of correctly classified rows (see ``mpidl.engine.metrics.accuracy``)."""
        return accuracy(output, labels)

    def __repr__(self):
        return f"{type(self).__name__}()"


class SoftmaxCrossEntropy(Loss):
    """Softmax followed by cross-entropy against integer class labels, fused: the
    gradient is ``(softmax(logits) - onehot(labels)) / N``. Stable for any logits
    (log-sum-exp after subtracting the row maximum)."""

    def forward(self, logits, labels):
        return float(self.forward_array(logits, labels))

    def forward_array(self, logits, labels, check_labels=True):
        """The loss as a 0-d array on the logits' device, without waiting for its value
        (``forward`` is ``float`` of it). ``check_labels=False`` skips the range check of
        the labels, which waits for the device: for callers that checked them on the
        host (a captured CUDA graph may not wait)."""
        xp = array_module(logits)
        if logits.ndim != 2:
            raise ShapeError(f"SoftmaxCrossEntropy expects logits (N, classes), got shape "
                             f"{shape_str(logits)}")
        n, k = logits.shape
        labels = xp.asarray(labels)
        if labels.shape != (n,):
            raise ShapeError(f"SoftmaxCrossEntropy expects {n} integer labels for logits of "
                             f"shape {shape_str(logits)}, got labels of shape {shape_str(labels)}")
        if labels.dtype.kind not in "iu":
            raise ValueError(f"SoftmaxCrossEntropy labels must be integer class indices, "
                             f"got dtype {labels.dtype}")
        if n == 0:
            raise ShapeError("SoftmaxCrossEntropy got an empty batch")
        if check_labels:
            lo, hi = int(labels.min()), int(labels.max())
            if lo < 0 or hi >= k:
                raise ValueError(f"SoftmaxCrossEntropy labels must be in [0, {k - 1}] for {k} "
                                 f"classes, got label {lo if lo < 0 else hi}")
        if is_gpu_array(logits) and logits.dtype.kind == "f":
            # one launch for the whole forward, one for the backward
            labels = labels.astype(xp.int64, copy=False)
            probs, row_loss = _fused_gpu.softmax_xent_forward(logits, labels)
            self._probs, self._labels, self._rows = probs, labels, None
            return row_loss.mean()
        shifted = logits - logits.max(axis=1, keepdims=True)
        probs = xp.exp(shifted)
        sums = probs.sum(axis=1, keepdims=True)
        rows = xp.arange(n)
        # loss_i = log(sum_j exp(s_ij)) - s_i,label
        value = (xp.log(sums[:, 0]) - shifted[rows, labels]).mean()
        probs /= sums
        self._probs, self._labels, self._rows = probs, labels, rows
        return value

    def backward(self):
        probs = self._probs
        if probs is None:
            raise RuntimeError("SoftmaxCrossEntropy.backward called before forward")
        labels, rows = self._labels, self._rows
        self._probs = None
        if rows is None:  # the fused GPU forward
            return _fused_gpu.softmax_xent_backward(probs, labels)
        n = probs.shape[0]
        probs[rows, labels] -= 1.0
        probs *= 1.0 / n
        return probs

    _probs = None


class TokenCrossEntropy(SoftmaxCrossEntropy):
    """``SoftmaxCrossEntropy`` over the last axis of logits ``(..., classes)`` against
    integer labels of the leading shape (a language model's ``(B, T, vocab)`` logits and
    ``(B, T)`` next-token ids): the mean over every token, and a gradient of the logits'
    shape. 2-D logits work as in ``SoftmaxCrossEntropy``."""

    def forward_array(self, logits, labels, check_labels=True):
        xp = array_module(logits)
        labels = xp.asarray(labels)
        if logits.ndim < 2 or labels.shape != logits.shape[:-1]:
            lead = tuple(int(d) for d in logits.shape[:-1])
            raise ShapeError(f"TokenCrossEntropy expects labels of the logits' leading shape "
                             f"{lead} (logits {shape_str(logits)}), got labels of shape "
                             f"{shape_str(labels)}")
        self._shape = logits.shape
        return super().forward_array(logits.reshape(-1, logits.shape[-1]),
                                     labels.reshape(-1), check_labels)

    def backward(self):
        return super().backward().reshape(self._shape)

    @staticmethod
    def correct(output, labels):
        """Number of tokens whose highest-scoring class is the label."""
        xp = array_module(output)
        return int((output.argmax(axis=-1) == xp.asarray(labels)).sum())


class MSELoss(Loss):
    """Mean squared error over all elements (PyTorch's ``reduction="mean"``)."""

    def forward(self, output, target):
        xp = array_module(output)
        target = xp.asarray(target)
        if output.shape != target.shape:
            raise ShapeError(f"MSELoss expects a target of the output's shape "
                             f"{shape_str(output)}, got {shape_str(target)}")
        diff = output - target.astype(output.dtype, copy=False)
        self._diff = diff
        return float((diff * diff).mean())

    def backward(self):
        diff = self._diff
        if diff is None:
            raise RuntimeError("MSELoss.backward called before forward")
        self._diff = None
        diff *= 2.0 / diff.size
        return diff

    _diff = None


class HuberLoss(Loss):
    """Huber loss ``0.5 d^2`` for ``|d| <= delta``, ``delta (|d| - delta/2)`` beyond, with
    ``d = output - target``, averaged over elements with optional per-element ``weights``
    (prioritised replay's importance weights). DQN uses it so that one large TD error
    cannot produce a large gradient: the gradient is ``clip(d, -delta, delta)``."""

    def __init__(self, delta=1.0):
        if not delta > 0:
            raise ValueError(f"HuberLoss delta must be > 0, got {delta}")
        self.delta = float(delta)

    def forward(self, output, target, weights=None):
        xp = array_module(output)
        target = xp.asarray(target)
        if output.shape != target.shape:
            raise ShapeError(f"HuberLoss expects a target of the output's shape "
                             f"{shape_str(output)}, got {shape_str(target)}")
        d = output - target.astype(output.dtype, copy=False)
        a = xp.abs(d)
        k = self.delta
        per = xp.where(a <= k, 0.5 * d * d, k * (a - 0.5 * k))
        grad = xp.clip(d, -k, k)
        if weights is not None:
            weights = xp.asarray(weights, dtype=output.dtype)
            per = per * weights
            grad = grad * weights
        self._grad = grad / d.size
        return float(per.mean())

    def backward(self):
        grad = self._grad
        if grad is None:
            raise RuntimeError("HuberLoss.backward called before forward")
        self._grad = None
        return grad

    def __repr__(self):
        return f"HuberLoss(delta={self.delta})"

    _grad = None

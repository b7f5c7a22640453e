"""The pieces of a decoder-only transformer that the other layers do not cover.

``CausalAttention`` is the parameter-free core of multi-head causal self-attention: the
qkv and output projections around it are plain ``Linear`` layers, so a model stays a
``Sequential`` that tensor parallelism can walk, splitting the qkv Linear by columns and
the output projection by rows. ``PositionEmbedding`` adds a learned table of position
vectors; ``TiedHead`` projects onto the vocabulary with the token Embedding's own weight
(weight tying).
"""

import math

from mpidl.backend import array_module
from mpidl.engine._util import as_input, float_dtype, shape_str
from mpidl.engine.gemm import matmul
from mpidl.engine.init import initialize
from mpidl.engine.module import Layer, ShapeError


class CausalAttention(Layer):
    """Causal multi-head attention over the output of a qkv projection.

    Input ``(B, T, 3 * H * head_dim)``, output ``(B, T, H * head_dim)``. Columns are
    grouped per head: ``[h * 3 * dh, (h + 1) * 3 * dh)`` hold head h's q, k and v (in
    that order, ``dh`` each), and head h's output is ``[h * dh, (h + 1) * dh)``. The head
    count is read from the input width, so a contiguous column shard of the qkv Linear
    (whole heads) runs through this layer unchanged: splitting heads over ranks needs no
    change here. Position t attends to positions <= t, scores scaled by
    ``1 / sqrt(head_dim)``, softmax after subtracting each row's maximum (stable for any
    scores).
    """

    def __init__(self, head_dim):
        super().__init__()
        if int(head_dim) < 1:
            raise ValueError(f"CausalAttention needs head_dim >= 1, got {head_dim}")
        self.head_dim = int(head_dim)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def _split(self, x):
        """q, k, v as (B, H, T, dh) views of ``x`` (B, T, H * 3 * dh)."""
        dh = self.head_dim
        if x.ndim != 3 or x.shape[-1] == 0 or x.shape[-1] % (3 * dh):
            raise ShapeError(f"CausalAttention(head_dim={dh}) expects (batch, time, "
                             f"3 * heads * {dh}) inputs (q, k, v per head), got shape "
                             f"{shape_str(x)}")
        b, t, w = x.shape
        heads = w // (3 * dh)
        qkv = x.reshape(b, t, heads, 3, dh).transpose(3, 0, 2, 1, 4)  # (3, B, H, T, dh)
        return qkv[0], qkv[1], qkv[2]

    def forward(self, x):
        xp = array_module(x)
        q, k, v = self._split(x)
        t = x.shape[1]
        scores = q @ k.swapaxes(-1, -2)  # (B, H, T, T)
        scores *= self.scale
        scores += xp.triu(xp.full((t, t), -xp.inf, dtype=scores.dtype), k=1)  # the future
        scores -= scores.max(axis=-1, keepdims=True)  # the diagonal is never masked
        probs = xp.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = probs @ v  # (B, H, T, dh)
        self.save_for_backward(q, k, v, probs)
        b, h, _, dh = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b, t, h * dh)

    def backward(self, dy):
        q, k, v, probs = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        xp = array_module(dy)
        b, h, t, dh = q.shape
        dout = dy.reshape(b, t, h, dh).transpose(0, 2, 1, 3)  # (B, H, T, dh)
        dv = probs.swapaxes(-1, -2) @ dout
        dprobs = dout @ v.swapaxes(-1, -2)
        # softmax backward: ds = p * (dp - sum(dp * p)); masked entries have p = 0
        row = (dprobs * probs).sum(axis=-1, keepdims=True)
        dprobs -= row
        dprobs *= probs
        dprobs *= self.scale
        dq = dprobs @ k
        dk = dprobs.swapaxes(-1, -2) @ q
        dx = xp.empty((3, b, h, t, dh), dtype=dy.dtype)
        dx[0], dx[1], dx[2] = dq, dk, dv
        return dx.transpose(1, 3, 2, 0, 4).reshape(b, t, h * 3 * dh)

    def __repr__(self):
        return f"CausalAttention(head_dim={self.head_dim})"


class PositionEmbedding(Layer):
    """``y[:, t, :] = x[:, t, :] + weight[t]`` for inputs ``(B, T, width)``, T <= context.

    ``weight`` is a learned ``(context, width)`` table; a shorter sequence uses its first
    T rows (and only those get a gradient, dense over the table)."""

    def __init__(self, context, width, init="normal", rng=None, dtype="float32"):
        super().__init__()
        if context < 1 or width < 1:
            raise ValueError(f"PositionEmbedding needs positive sizes, got context={context}, "
                             f"width={width}")
        self.context, self.width = int(context), int(width)
        self.dtype = float_dtype(dtype)
        self.weight = self.add_param("weight", initialize(init, (self.context, self.width),
                                                          self.context, self.width, rng,
                                                          self.dtype))

    def forward(self, x):
        x, _ = as_input(x, self.dtype, self.weight.data)
        if x.ndim != 3 or x.shape[-1] != self.width:
            raise ShapeError(f"PositionEmbedding expects (batch, time, {self.width}) inputs, "
                             f"got shape {shape_str(x)}")
        t = x.shape[1]
        if t > self.context:
            raise ShapeError(f"PositionEmbedding has {self.context} positions (the model's "
                             f"context), got a sequence of {t} (input shape {shape_str(x)}); "
                             "feed at most context tokens at a time")
        self.save_for_backward(t)
        return x + self.weight.data[:t]

    def backward(self, dy):
        (t,) = self.saved_for_backward()
        xp = array_module(dy)
        g = xp.zeros_like(self.weight.data)
        g[:t] = dy.sum(axis=0)
        self.weight.accumulate(g)
        return dy if self.needs_input_grad else None

    def __repr__(self):
        return f"PositionEmbedding({self.context}, {self.width})"


class TiedHead(Layer):
    """``logits = x @ embedding.weight.T``: the output projection of a language model
    that shares its weight with the token ``Embedding`` (weight tying).

    The layer holds the Embedding's ``Parameter`` itself, so there is one tensor: its
    gradient accumulates the head's dense part and the Embedding's row-sparse part (the
    result is dense), and ``named_parameters`` lists it once, under the Embedding's name.
    """

    def __init__(self, embedding):
        super().__init__()
        self.embedding_dim = embedding.embedding_dim
        self.num_embeddings = embedding.num_embeddings
        self.weight = embedding.weight
        self._params["weight"] = self.weight

    def forward(self, x):
        w = self.weight.data
        x, _ = as_input(x, w.dtype, w)
        if x.ndim < 2 or x.shape[-1] != self.embedding_dim:
            raise ShapeError(f"TiedHead expects {self.embedding_dim} input features, got "
                             f"shape {shape_str(x)}")
        self.save_for_backward(x)
        y = matmul(x.reshape(-1, self.embedding_dim), w.T)
        return y.reshape(x.shape[:-1] + (self.num_embeddings,))

    def backward(self, dy):
        (x,) = self.saved_for_backward()
        x2 = x.reshape(-1, self.embedding_dim)
        dy2 = dy.reshape(-1, self.num_embeddings)
        self.weight.accumulate(matmul(dy2.T, x2))
        if not self.needs_input_grad:
            return None
        return matmul(dy2, self.weight.data).reshape(x.shape)

    def __repr__(self):
        return f"TiedHead({self.embedding_dim} -> {self.num_embeddings}, tied to the Embedding)"

"""Lookup table from integer ids to vectors, with a row-sparse gradient."""

from mpidl.backend import array_module
from mpidl.engine._util import float_dtype, shape_str
from mpidl.engine.init import initialize
from mpidl.engine.module import Layer, ShapeError, SparseGrad


def check_ids(ids, rows, what="Embedding"):
    """ShapeError unless ``ids`` are integers in [0, rows)."""
    if ids.dtype.kind not in "iu":
        raise ShapeError(f"{what} expects integer ids, got dtype {ids.dtype} "
                         f"(input shape {shape_str(ids)})")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise ShapeError(f"{what} has {rows} rows, got id {bad} "
                             f"(input shape {shape_str(ids)})")


class Embedding(Layer):
    """``y[..., :] = weight[ids[...]]`` for integer ``ids`` of any shape.

    Its gradient is a ``SparseGrad`` holding only the looked-up rows (ids may repeat;
    ``SparseGrad.to_dense``/``coalesce`` sum duplicates), so a large vocabulary costs
    nothing for rows a batch does not touch. Ids have no gradient: backward returns None.
    """

    def __init__(self, num_embeddings, embedding_dim, init="normal", rng=None,
                 dtype="float32"):
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"Embedding needs positive sizes, got num_embeddings="
                             f"{num_embeddings}, embedding_dim={embedding_dim}")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.dtype = float_dtype(dtype)
        self.weight = self.add_param("weight", initialize(
            init, (num_embeddings, embedding_dim), num_embeddings, embedding_dim, rng,
            self.dtype))

    def forward(self, ids):
        ids = array_module(self.weight.data).asarray(ids)
        check_ids(ids, self.num_embeddings)
        self.save_for_backward(ids)
        return self.weight.data[ids]

    def backward(self, dy):
        (ids,) = self.saved_for_backward()
        self.weight.accumulate(SparseGrad(ids.reshape(-1), dy.reshape(-1, self.embedding_dim),
                                          self.weight.data.shape))
        return None

    def __repr__(self):
        return f"Embedding({self.num_embeddings}, {self.embedding_dim})"

"""PowerSGD (Vogels et al. 2019): a rank-r approximation P Q^T of each gradient matrix.

Each tensor is viewed as a matrix M (first dimension x the rest). One step of power
iteration, warm-started from last step's Q, gives P = orth(M Q), Q = M^T P, and
P Q^T ~ M; with error feedback, M - P Q^T is added to the next gradient. Vectors (biases)
and matrices too small to gain are sent whole.

Under all-reduce data parallelism (``reduce``), P and Q are averaged between the two
halves, so every rank ends with the same rank-r approximation of the *mean* gradient:
two all-reduces of (rows + cols) * r floats instead of rows * cols. ``compress`` /
``decompress`` (for the parameter server or all-gather) approximate each rank's own
gradient: payload ``[P, Q]``, or ``[M]`` for a tensor sent whole.
"""

import zlib

import numpy as np

from mpidl.backend import array_module, to_numpy, xp
from mpidl.kernels import PayloadError

from .base import Compressor, check_payload, ctx_of, flat32, restore


def orthogonalize(p, eps=1e-8):
    """Gram-Schmidt on the columns of p, in place (the same on every rank for the same p)."""
    mod = array_module(p)
    for i in range(p.shape[1]):
        col = p[:, i]
        col /= mod.sqrt(mod.sum(col * col)) + eps
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= mod.outer(col, col @ rest)
    return p


class PowerSGDCompressor(Compressor):
    """``rank``: r of the approximation; ``warm_start``: reuse Q from the last step;
    ``error_feedback``: keep M - P Q^T for the next step; ``seed``: the first Q (must match
    on every rank)."""

    name = "powersgd"
    summable = False
    multi_round = True

    def __init__(self, rank=2, warm_start=True, error_feedback=True, seed=0):
        rank = int(rank)
        if rank < 1:
            raise ValueError(f"powersgd: rank must be >= 1, got {rank}")
        self.rank_r = rank
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self._q = {}
        self._err = {}

    # A tensor is compressed when it is a matrix and P, Q are smaller than M.
    def _matrix_shape(self, shape):
        if len(shape) < 2:
            return None
        rows = int(shape[0])
        cols = int(np.prod(shape[1:]))
        r = min(self.rank_r, rows, cols)
        return (rows, cols, r) if (rows + cols) * r < rows * cols else None

    def _start_q(self, name, cols, r, like):
        """Q from the last step (warm start) or a fresh one from the shared seed."""
        q = self._q.get(name) if self.warm_start else None
        if q is None or q.shape != (cols, r):
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            q = array_module(like).asarray(rng.standard_normal((cols, r)), dtype=np.float32)
        return q

    def _with_error(self, tensor, name, rows, cols):
        m = flat32(tensor).reshape(rows, cols)
        if self.error_feedback:
            e = self._err.get(name)
            if e is not None and e.shape == m.shape:
                m = m + e
        return m

    def _finish(self, name, m, p, q):
        self._q[name] = q
        approx = p @ q.T
        if self.error_feedback:
            self._err[name] = m - approx
        return approx

    def reduce(self, tensor, name, allreduce_mean):
        """All-reduce data parallelism: the mean gradient's rank-r approximation, on every
        rank alike, using ``allreduce_mean(array, name)`` twice (or once for a whole tensor)."""
        shape = self._matrix_shape(tensor.shape)
        if shape is None:
            mean = allreduce_mean(flat32(tensor), name)
            return restore(mean, ctx_of(tensor))
        rows, cols, r = shape
        m = self._with_error(tensor, name, rows, cols)
        p = allreduce_mean(m @ self._start_q(name, cols, r, m), name + "/P")
        orthogonalize(p)
        q = allreduce_mean(m.T @ p, name + "/Q")
        return restore(self._finish(name, m, p, q), ctx_of(tensor))

    def compress(self, tensor, name):
        shape = self._matrix_shape(tensor.shape)
        if shape is None:
            return [flat32(tensor)], ctx_of(tensor, 0)
        rows, cols, r = shape
        m = self._with_error(tensor, name, rows, cols)
        p = orthogonalize(m @ self._start_q(name, cols, r, m))
        q = m.T @ p
        self._finish(name, m, p, q)
        return [p, q], ctx_of(tensor, r)

    def decompress(self, payload, ctx):
        (r,) = ctx.info
        if r == 0:
            check_payload(payload, ["float32"], "powersgd")
            if payload[0].size != ctx.n:
                raise PayloadError(f"powersgd payload has {payload[0].size} values, "
                                   f"expected {ctx.n}")
            return restore(payload[0].reshape(-1), ctx)
        check_payload(payload, ["float32", "float32"], "powersgd")
        rows, cols = ctx.shape[0], ctx.n // ctx.shape[0]
        p, q = payload
        if p.size != rows * r or q.size != cols * r:
            raise PayloadError(f"powersgd payload has P of {p.size} and Q of {q.size} values, "
                               f"a rank-{r} approximation of {rows}x{cols} needs "
                               f"{rows * r} and {cols * r}")
        return restore(p.reshape(rows, r) @ q.reshape(cols, r).T, ctx)

    def state_dict(self):
        return {"q": {k: to_numpy(v) for k, v in self._q.items()},
                "error": {k: to_numpy(v) for k, v in self._err.items()}}

    def load_state_dict(self, state):
        mod = xp()
        self._q = {k: mod.asarray(v) for k, v in state.get("q", {}).items()}
        self._err = {k: mod.asarray(v) for k, v in state.get("error", {}).items()}

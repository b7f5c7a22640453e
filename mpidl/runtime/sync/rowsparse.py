"""Row-sparse gradients (Embedding's ``SparseGrad``) averaged by all-gathering the rows.

After backward each gradient is coalesced and every rank's row indices and values are
exchanged with ``allgatherv``; the result — every rank's rows, values multiplied by
1/(rank count) — is a SparseGrad again, so the optimizer still updates touched rows only.
``--sparse-grads dense`` puts these parameters in the fused buckets instead (better when
most rows are touched every step). The epoch line's ``bytes_sent_per_step`` counts the
rows a ring all-gather would send (``bytes_per_step``) beside the buckets' all-reduce.
"""

import time

from mpidl.backend import array_module
from mpidl.engine.module import SparseGrad
from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.sync.base import GradSync

SPARSE_MODES = ("allgather", "dense")

OPTIONS = [
    Option("sparse_grads", str, None, "exchange row-sparse (Embedding) gradients by "
           "allgather of the touched rows, or dense inside the fused buckets (default "
           "allgather)", "parallelism", choices=(None,) + SPARSE_MODES),
]


def check_sparse_mode(mode):
    mode = mode or "allgather"
    if mode not in SPARSE_MODES:
        raise ConfigError(f"--sparse-grads {mode!r}: choose one of {', '.join(SPARSE_MODES)}")
    return mode


def sparse_param_names(model):
    """Names of parameters whose gradients are row-sparse (Embedding weights)."""
    from mpidl.engine.embedding import Embedding  # noqa: PLC0415

    names = set()
    for name, layer in model.modules():
        if isinstance(layer, Embedding) or getattr(layer, "sparse_grad", False):
            names.update(f"{name}.{n}" if name else n for n in layer._params)
    return names


def as_rows(p):
    """Parameter ``p``'s gradient as coalesced rows: a ``SparseGrad`` with sorted, unique
    int64 indices and C-contiguous values in ``p``'s dtype, whatever backward left (no
    gradient: no rows; a dense one, e.g. a tied embedding's: every row; rows that repeat:
    summed). The all-gather and Parallax's pushes send exactly these arrays, so the rows
    reach the optimizer in the same order and with the same bits either way."""
    g = p.grad
    xp = array_module(p.data)
    if g is None:
        dim = p.data.shape[1:]
        g = SparseGrad(xp.zeros(0, dtype=xp.int64), xp.zeros((0,) + dim, dtype=p.data.dtype),
                       p.data.shape)
    elif not isinstance(g, SparseGrad):  # a dense gradient after all
        g = SparseGrad(xp.arange(g.shape[0], dtype=xp.int64), g, g.shape)
    g = g.coalesce()
    return SparseGrad(xp.ascontiguousarray(g.indices, dtype=xp.int64),
                      xp.ascontiguousarray(g.values, dtype=p.data.dtype), p.data.shape)


class RowSparseAllgather(GradSync):
    """Average row-sparse gradients over ``ctx.group`` with allgatherv (module doc)."""

    name = "rowsparse-allgather"

    def __init__(self):
        super().__init__()
        self.comm = None
        self._wait = 0.0
        self._gathered = 0  # bytes of rows gathered (every rank's) since the last metrics
        self._steps = 0

    def setup(self, ctx, named_params):
        super().setup(ctx, named_params)
        self.comm = ctx.group

    def finish(self):
        t = time.perf_counter()
        comm = self.comm
        size = 1 if comm is None else comm.size
        for name, p in self.params.items():
            if comm is None:
                break
            g = as_rows(p)
            all_idx, _ = comm.allgatherv(g.indices)
            all_vals, _ = comm.allgatherv(g.values.reshape(-1))
            all_vals = all_vals.reshape((-1,) + tuple(p.data.shape[1:]))
            all_vals *= 1.0 / size
            p.grad = SparseGrad(all_idx, all_vals, p.data.shape)
            self._gathered += int(all_idx.nbytes) + int(all_vals.nbytes)
        self._steps += 1
        self._wait = time.perf_counter() - t
        if self.names:
            yield self.names

    def wait_seconds(self):
        return self._wait

    def bytes_per_step(self):
        """What a ring all-gather of the rows moves per rank and step, on average over the
        ranks and over the steps since the last ``metrics``: (p - 1)/p of the rows (and
        their int64 indices) gathered from every rank."""
        p = 1 if self.comm is None else self.comm.size
        return self._gathered * (p - 1) / p / max(self._steps, 1)

    def metrics(self):
        """``allgather_bytes_per_step``: ``bytes_per_step`` (the rows' share of the epoch
        line's ``bytes_sent_per_step``)."""
        out = {"allgather_bytes_per_step": self.bytes_per_step()} if self.names else {}
        self._gathered = self._steps = 0
        return out

    def describe(self):
        return [f"{len(self.names)} row-sparse tensor(s) by allgatherv"] if self.names else []

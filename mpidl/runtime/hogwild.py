"""Hogwild! across processes: workers update shared parameters with no lock at all.

Niu, Recht, Ré and Wright (NIPS 2011) let every core run SGD on one shared parameter
vector without locks: when each update touches few coordinates (sparse problems),
collisions are rare and the result matches serial SGD, at near-linear speed-up. Here the
vector lives in MPI windows on *owner* ranks (``mpidl.comm.rma.SharedVector``) and the
workers are other processes: a step reads the coordinates it needs (``read``), computes a
gradient, and adds −η·g to them (``add``), each element atomically, nothing held across
elements. Every owner counts its updates, so each update knows its *staleness*: how many
other updates landed between its read and its write.

This module holds the problem where the theory applies — sparse logistic regression,
generated from a seed — its serial SGD reference, and the worker loop; the trainer's
``--strategy hogwild`` (``HogwildSync``, ``HogwildServer``) runs the same read/add cycle
on a model's dense parameters.
"""

import time
from dataclasses import dataclass

import numpy as np

from mpidl.engine.module import SparseGrad
from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.sync.base import GradSync


# -- the sparse problem ------------------------------------------------------------------

@dataclass
class SparseLogistic:
    """``n`` samples of ``dim`` features, ``nnz`` of them non-zero per sample; labels ±1
    from a hidden weight vector with some label noise."""

    cols: np.ndarray    # (n, nnz) int64: which features a sample has
    vals: np.ndarray    # (n, nnz) float64: their values
    y: np.ndarray       # (n,) float64: +1 or -1
    dim: int

    @classmethod
    def generate(cls, n, dim, nnz, seed=0, noise=0.05):
        rng = np.random.default_rng(seed)
        cols = np.sort(np.stack([rng.choice(dim, nnz, replace=False) for _ in range(n)]),
                       axis=1)
        vals = rng.standard_normal((n, nnz))
        w = rng.standard_normal(dim)
        margin = np.einsum("ij,ij->i", vals, w[cols])
        y = np.where(margin >= 0, 1.0, -1.0)
        flip = rng.random(n) < noise
        y[flip] = -y[flip]
        return cls(cols.astype(np.int64), vals, y, int(dim))

    def loss(self, w):
        """Mean logistic loss log(1 + exp(−y·x·w)) over all samples."""
        margin = self.y * np.einsum("ij,ij->i", self.vals, w[self.cols])
        return float(np.mean(np.logaddexp(0.0, -margin)))

    def step(self, i, w_cols, lr):
        """(coordinates, −lr·gradient) of sample ``i``'s loss, from its weights ``w_cols``."""
        x, y = self.vals[i], self.y[i]
        margin = y * float(x @ w_cols)
        coef = -y / (1.0 + np.exp(margin))  # d loss / d (x·w)
        return self.cols[i], -lr * coef * x


def serial_sgd(problem, order, lr):
    """The reference: one process, the samples of ``order`` one after the other."""
    w = np.zeros(problem.dim)
    for i in order:
        cols, delta = problem.step(i, w[problem.cols[i]], lr)
        w[cols] += delta
    return w


@dataclass
class WorkerStats:
    updates: int = 0
    seconds: float = 0.0
    staleness: list = None

    def rate(self):
        return self.updates / self.seconds if self.seconds else 0.0


def hogwild_worker(shared, problem, samples, lr, locked=False):
    """Run SGD over ``samples`` (this worker's share, in order) against ``shared`` (a
    ``SharedVector`` of ``problem.dim`` float64); returns ``WorkerStats`` with the
    staleness of every update. ``locked``: hold every owner exclusively from the read to
    the write (the comparison Hogwild is measured against)."""
    stats = WorkerStats(staleness=[])
    t0 = time.perf_counter()
    for i in samples:
        cols = problem.cols[i]
        if locked:
            with shared.exclusive():
                seen = shared.versions()
                w_cols = shared.read(idx=cols)
                cols, delta = problem.step(i, w_cols, lr)
                before = shared.add(delta, idx=cols)
        else:
            seen = shared.versions()
            w_cols = shared.read(idx=cols)
            cols, delta = problem.step(i, w_cols, lr)
            before = shared.add(delta, idx=cols)
        stats.staleness.append(_staleness(shared, cols, seen, before))
        stats.updates += 1
    stats.seconds = time.perf_counter() - t0
    return stats


def _staleness(shared, cols, seen, before):
    """Updates other workers made, between this one's read and its write, to the owners
    it touched (the most over those owners)."""
    owners = np.unique(np.searchsorted(np.asarray(shared.displs[1:]), cols, side="right"))
    return int(max(b - seen[o] for b, o in zip(before, owners)))


# -- the trainer's --strategy hogwild -----------------------------------------------------

#: tag of the message a worker sends each owner when it has finished training
DONE_TAG = 7701

OPTIONS = [
    Option("locks", bool, False, "--strategy hogwild: lock the shared weights exclusively "
           "from each read to its write (the locked comparison; default lock-free)",
           "parallelism"),
]


def check_optimizer(optimizer):
    """Hogwild adds −lr·(g + wd·w) to the shared weights: plain SGD only."""
    from mpidl.engine.optim import SGD  # noqa: PLC0415

    if type(optimizer) is not SGD or optimizer.momentum or optimizer.nesterov:
        what = type(optimizer).__name__
        if type(optimizer) is SGD:
            what = f"SGD with momentum {optimizer.momentum:g}"
        raise ConfigError(f"--strategy hogwild adds -lr*g to the shared weights, so it runs "
                          f"plain SGD only, not {what}: use --optimizer sgd --momentum 0")


class HogwildSync(GradSync):
    """A worker's side: read the shared weights before the step, add −lr·g after it."""

    name = "hogwild"
    updates_remotely = True

    def __init__(self, server_ranks, worker_ranks, locks=False):
        super().__init__()
        self.server_ranks, self.worker_ranks = list(server_ranks), list(worker_ranks)
        self.locks = bool(locks)
        self.shared = None
        self.updates = 0
        self.staleness = []  # per update since the last metrics()

    def setup(self, ctx, named_params):
        check_optimizer(ctx.optimizer)
        super().setup(ctx, named_params)
        from mpidl.comm.rma import SharedVector, check_rma  # noqa: PLC0415

        check_rma(ctx.comm.mpi)
        self.ctx = ctx
        params = [p for _, p in named_params]
        dtype = params[0].data.dtype
        self.sizes = [p.data.size for p in params]
        total = sum(self.sizes)
        self.weights = np.empty(total, dtype=dtype)
        self.delta = np.empty(total, dtype=dtype)
        self.shared = SharedVector(ctx.comm.mpi, self.server_ranks, total, dtype,
                                   locks=self.locks, count=ctx.comm.counter("rma"))
        self._started = False
        self._lock = None

    def _views(self, flat):
        out, at = [], 0
        for (_, p), n in zip(self.params.items(), self.sizes):
            out.append((p, flat[at:at + n].reshape(p.data.shape)))
            at += n
        return out

    def _pull(self):
        self.shared.read(out=self.weights)
        for p, view in self._views(self.weights):
            p.data[...] = view

    def begin_step(self):
        if not self._started:
            # the shared weights start at zero: the first worker adds its (resumed or
            # initial) weights once, and every worker starts from them
            if self.ctx.rank == self.worker_ranks[0]:
                for p, view in self._views(self.delta):
                    view[...] = p.data
                self.shared.add(self.delta)
            self.ctx.group.barrier()
            self._started = True
        if self.locks:
            self._lock = self.shared.exclusive()
            self._lock.__enter__()
        self._seen = self.shared.versions()
        self._pull()

    def finish(self):
        opt = self.ctx.optimizer
        lr, wd = opt.lr, opt.weight_decay
        for p, view in self._views(self.delta):
            if p.grad is None:
                view.fill(0)
            elif isinstance(p.grad, SparseGrad):  # (an Embedding's rows: the whole vector)
                view[...] = p.grad.to_dense()
            else:
                view[...] = p.grad
            if wd:
                view += wd * p.data
        self.delta *= -lr
        before = self.shared.add(self.delta)
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None
        self.staleness.append(int(max(b - s for b, s in zip(before, self._seen))))
        self.updates += 1
        return iter(())

    def prepare_eval(self):
        """Every worker evaluates (and saves) the same weights: the shared ones once all
        have finished the epoch."""
        self.ctx.group.barrier()
        self._pull()

    def metrics(self):
        s = self.staleness
        out = {"hogwild_updates": len(s),
               "hogwild_mean_staleness": (sum(s) / len(s)) if s else 0.0,
               "hogwild_max_staleness": max(s, default=0)}
        self.staleness = []
        return out

    def describe(self):
        return [f"hogwild: {sum(self.sizes)} weights in MPI windows on rank(s) "
                f"{self.server_ranks}, {len(self.worker_ranks)} worker(s), "
                + ("exclusive locks from read to write" if self.locks else "lock-free")]

    def finish_training(self):
        comm = self.ctx.comm.mpi
        for s in self.server_ranks:
            comm.send(self.updates, dest=s, tag=DONE_TAG)
        self.shared.close()


class HogwildServer:
    """An owner's role: hold a chunk of the weights; keep MPI progressing until every
    worker is done (the trainer calls ``serve`` instead of running epochs)."""

    final_stats = None

    def __init__(self, server_ranks, worker_ranks, locks=False, poll_s=5e-3):
        self.server_ranks, self.worker_ranks = list(server_ranks), list(worker_ranks)
        self.locks = bool(locks)
        self.poll_s = poll_s

    def setup(self, ctx):
        check_optimizer(ctx.optimizer)
        from mpidl.comm.rma import SharedVector, check_rma  # noqa: PLC0415

        check_rma(ctx.comm.mpi)
        params = [p for _, p in ctx.named_params]
        self.comm = ctx.comm.mpi
        self.shared = SharedVector(self.comm, self.server_ranks,
                                   sum(p.data.size for p in params), params[0].data.dtype,
                                   locks=self.locks)

    def serve(self):
        from mpi4py import MPI  # noqa: PLC0415

        comm, left, updates = self.comm, set(self.worker_ranks), 0
        status = MPI.Status()
        # (no stall mark: an owner waits for the whole training, by design)
        while left:
            if comm.Iprobe(MPI.ANY_SOURCE, DONE_TAG, status):
                updates += comm.recv(source=status.Get_source(), tag=DONE_TAG)
                left.discard(status.Get_source())
            else:
                time.sleep(self.poll_s)
        self.shared.close()
        return updates

    def load_state_dict(self, servers):
        pass

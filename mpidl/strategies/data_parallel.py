"""Synchronous data parallelism: every rank holds the whole model and averages gradients.

Think Horovod's ``DistributedOptimizer``. At ``setup`` rank 0's parameters are broadcast,
so every replica starts identical; each step every rank runs forward and backward on its
own shard of the global batch, the gradients are averaged over the ranks with the
communicator's all-reduce (``algorithm``: ring, tree, recursive_doubling, mpi or auto),
and every rank applies the same averaged update. Replicas therefore stay identical and
N ranks with batch b train like one process with batch N·b.

How a step runs:

* **Fusion** (``mpidl.strategies.fusion``): dense gradients are packed into a few
  preallocated flat buckets of at most ``bucket_mb`` MiB, laid out once at setup in the
  reverse of the parameter order (backward's order). One all-reduce per bucket. Packing
  multiplies by 1/N on the way in, so the all-reduce is a plain sum and the mean costs no
  extra pass; after it the bucket's views become the parameters' ``grad`` (no copy out).
* **Overlap** (``overlap=True``): a grad-ready hook on the model copies each layer's gradients
  into their bucket as soon as backward produced them; a complete bucket's non-blocking
  all-reduce starts right away (buckets strictly in index order, so every rank issues the
  same collectives in the same order) and runs on the communicator's progress thread
  while backward goes on through earlier layers. After backward the optimizer waits for
  bucket 0, updates its parameters (``opt.step(names)``), waits for bucket 1, and so on:
  it waits only for what it needs, and later buckets keep travelling meanwhile.
* **No overlap** (``overlap=False``, ``--overlap off``): backward first, then each bucket
  all-reduced with a blocking call, then one optimizer step.
* **Default** (``overlap="auto"``): overlap where it can pay, i.e. on GPU, or when this
  node has a spare CPU per rank for the progress thread (CPUs this rank may use >= ranks
  on the node x (BLAS threads + 1), or each rank bound to its own CPUs with room for
  one more thread). Between ranks on one node an all-reduce is memory copies done by the
  CPU: with every core already computing, the progress thread can only take time from
  backward (and MPICH's busy-polling makes that worse): bench/scaling.py measured
  overlapped steps 15-35 % slower than blocking ones with 2 ranks on 2 (shared) cores.
  ``describe()`` says what was chosen and why; the epoch line carries ``overlap`` 0/1.
* **Row-sparse gradients** (Embedding's ``SparseGrad``): not fused; after backward each
  is coalesced and exchanged with ``allgatherv`` of its row indices and values (the
  result, every rank's rows with values divided by the rank count, is a SparseGrad again,
  so the optimizer still updates touched rows only). ``sparse_grads="dense"``
  (``--sparse-grads dense``) densifies them into the buckets instead: better when most
  rows are touched every step; the optimizer then sees dense gradients (SGD's momentum
  decays on untouched rows too, as in one process given dense gradients).
* **Compression** (``compression="topk"`` etc., with ``ratio``): gradients are exchanged
  tensor by tensor through ``mpidl.compress``'s ``Exchanger`` (with the compressor's error
  feedback) instead of the fused all-reduce. With overlap, the hook compresses each
  tensor and starts its collective during backward; afterwards each is decoded and
  updated in the order started. Embedding gradients are densified first. Bytes sent per
  step (and the compression ratio) are reported in the metrics.

Every rank must run the same number of steps: the data loader guarantees it (the last
global batch of an epoch is padded or dropped on every rank alike), and ``finish``
checks the step counts agree.

Non-trainable buffers (BatchNorm running statistics) are not touched by the step; they
are averaged over the ranks before each evaluation and each checkpoint, so every rank
evaluates and saves the same model.
"""

import os
import time

from mpidl.backend import array_module
from mpidl.config import Option
from mpidl.engine.module import SparseGrad
from mpidl.errors import ConfigError
from mpidl.strategies.base import Strategy, check_options
from mpidl.strategies.fusion import MiB, FusionBuffers
from mpidl.threads import blas_threads_set, usable_cpus

ALGORITHMS = ("auto", "ring", "tree", "recursive_doubling", "mpi")
#: Default fusion buffer size; see bench/results/scaling.json for the measurements.
DEFAULT_BUCKET_MB = 4.0
SPARSE_MODES = ("allgather", "dense")

_clock = time.perf_counter

#: flags of this strategy beyond the common parallelism ones (``mpidl train --help``)
CLI_OPTIONS = [
    Option("sparse_grads", str, None, "--strategy allreduce: exchange row-sparse (Embedding) "
           "gradients by allgather of the touched rows, or dense inside the fused buckets "
           "(default allgather)", "parallelism", choices=(None,) + SPARSE_MODES),
]


class DataParallel(Strategy):
    """Synchronous all-reduce data parallelism; see the module docstring."""

    name = "allreduce"
    OPTIONS = ("algorithm", "bucket_mb", "overlap", "compression", "ratio", "sparse_grads")

    def __init__(self, comm=None, algorithm="auto", bucket_mb=None, overlap="auto",
                 compression=None, ratio=None, sparse_grads=None, **options):
        check_options("allreduce", self.OPTIONS, options)
        super().__init__(comm, algorithm=algorithm, bucket_mb=bucket_mb, overlap=overlap,
                         compression=compression, ratio=ratio, sparse_grads=sparse_grads)
        sparse = sparse_grads or "allgather"
        algorithm = algorithm or "auto"
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"--algorithm {algorithm!r} is not an allreduce algorithm: "
                              f"choose one of {', '.join(ALGORITHMS)}")
        bucket_mb = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
        if not bucket_mb > 0:
            raise ConfigError(f"--bucket-mb must be positive, got {bucket_mb}")
        if sparse not in SPARSE_MODES:
            raise ConfigError(f"--sparse-grads {sparse!r}: choose one of "
                              f"{', '.join(SPARSE_MODES)}")
        self.algorithm = algorithm
        self.bucket_mb = bucket_mb
        if overlap is None or overlap == "auto":
            self.overlap_mode = "auto"
        elif overlap in ("on", "off"):
            self.overlap_mode = overlap
        elif overlap in (True, False, 0, 1):
            self.overlap_mode = "on" if overlap else "off"
        else:
            raise ConfigError(f"--overlap must be on, off or auto (or True/False), got "
                              f"{overlap!r}")
        self.overlap = self.overlap_mode == "on"  # "auto" is decided in setup
        self.overlap_reason = ""
        self.sparse_mode = sparse
        self.compression = compression
        self.ratio = ratio
        self.compressor = self._make_compressor(compression, ratio)
        self.exchanger = None
        self.fusion = None
        self.sparse_params = []   # (name, Parameter) exchanged by allgatherv
        self._active = False      # the hook packs only inside train_step's backward
        self._hooked = False
        self.timeline = None
        self.steps = 0
        self.reset_stats()

    # -- construction helpers ----------------------------------------------------------------
    @staticmethod
    def _make_compressor(name, ratio):
        if not name or name == "none":
            if ratio is not None:
                raise ConfigError("--ratio is a compression setting: give --compression too "
                                  "(e.g. --compression topk --ratio 0.01)")
            return None
        try:
            from mpidl.compress import make_compressor  # noqa: PLC0415
        except ImportError:
            raise ConfigError("--compression needs mpidl.compress, which this installation "
                              "lacks") from None
        kw = {} if ratio is None else {"ratio": ratio}
        try:
            return make_compressor(name, **kw)
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"--compression {name}: {e}") from None

    @property
    def communicates(self):
        return self.comm is not None

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, model, optimizer, loss):
        """Broadcast rank 0's parameters and buffers, lay out the fusion buckets, hook backward."""
        super().setup(model, optimizer, loss)
        named = model.named_parameters()
        sparse_names = _sparse_param_names(model) if self.sparse_mode == "allgather" else set()
        self.sparse_params = [(n, p) for n, p in named if n in sparse_names]
        self._sparse_names = [n for n, _ in self.sparse_params]
        dense = [(n, p) for n, p in named if n not in sparse_names]
        # the communicator's Chrome-trace recorder, if it keeps one: compute spans go
        # beside its collectives, so the trace shows what overlapped what
        self.timeline = (getattr(self.comm, "timeline", None)
                         or getattr(self.comm, "_timeline", None))
        if self.communicates:
            for _, p in named:
                self.comm.bcast(p.data, root=0)
            self._bcast_buffers()
        self._params = dict(named)
        self._order = [n for n, _ in reversed(named)]  # backward's order
        if self.compressor is not None and self.communicates:
            from mpidl.compress import Exchanger  # noqa: PLC0415

            # compressed: every tensor (Embedding's densified) through the exchanger
            self.exchanger = Exchanger(self.comm, self.compressor, algorithm=self.algorithm)
            # onebit/dgc apply momentum before compressing: take it over from the optimizer
            # (a no-op for compressors with plain error feedback)
            self.exchanger.adopt_momentum(optimizer)
            self.sparse_params, self._sparse_names, dense = [], [], []
        # each rank's gradient is scaled by 1/N while packed, so a plain sum is the mean
        self.fusion = FusionBuffers(dense, int(self.bucket_mb * MiB), scale=1.0 / self.size)
        if self.overlap_mode == "auto":
            self.overlap, self.overlap_reason = overlap_pays(self.comm, named)
        if self.overlap and self.communicates and not self._hooked:
            hook = getattr(model, "add_grad_ready_hook", None)
            if hook is not None:
                hook(self._on_grads_ready)
                self._hooked = True
            else:  # a model without hooks: everything is packed after backward
                self.overlap = False

    def describe(self):
        """A few lines on the layout (for --verbose logs and reports)."""
        f = self.fusion
        if self.exchanger is not None:
            return [f"allreduce: {self.size} rank(s), compression {self.compression} "
                    f"(tensor by tensor), algorithm {self.algorithm}, overlap "
                    f"{self._overlap_text()}"]
        head = (f"allreduce: {self.size} rank(s), algorithm {self.algorithm}, "
                f"{len(f)} bucket(s) of <= {self.bucket_mb:g} MiB ({f.nbytes / MiB:.2f} MiB "
                f"in all), overlap {self._overlap_text()}")
        if self.sparse_params:
            head += f", {len(self.sparse_params)} sparse tensor(s) by allgatherv"
        return [head] + f.describe()

    def _overlap_text(self):
        text = "on" if self.overlap else "off"
        if self.overlap_mode == "auto":
            text = f"auto -> {text} ({self.overlap_reason})"
        return text

    # -- one step ------------------------------------------------------------------------------
    def train_step(self, x, y):
        model, opt, fusion, stats = self.model, self.optimizer, self.fusion, self.stats
        opt.zero_grad()
        t0 = _clock()
        logits = model.forward(x)
        loss = self.loss.forward(logits, y)
        dy = self.loss.backward()
        t1 = _clock()
        fusion.begin_step()
        if self.exchanger is not None:
            self._pending, self._started = [], set()
        self._active = self.overlap and self.communicates
        try:
            model.backward(dy)  # with overlap, the hook packs and launches buckets
        finally:
            self._active = False
        t2 = _clock()
        wait = 0.0
        if self.exchanger is not None:
            wait = self._finish_compressed()
        elif not self.communicates:  # one process without a communicator
            opt.step()
        elif self.overlap:
            stats["launched_in_backward"] += fusion.launched
            # gradients the hook did not see (unused parameters, layers outside the
            # hooked container) are packed now, and the remaining buckets go out
            fusion.pack_rest()
            self._launch_ready()
            ts = _clock()
            self._exchange_sparse()
            wait = _clock() - ts
            for b in fusion.buckets:  # wait only for the bucket the next update needs
                tw = _clock()
                b.handle.wait()
                wait += _clock() - tw
                b.handle = None
                fusion.unpack(b)
                opt.step(b.names)
            if self.sparse_params:
                opt.step(self._sparse_names)
        else:
            fusion.pack_rest()
            comm, alg = self.comm, self.algorithm
            ts = _clock()
            for b in fusion.buckets:
                comm.allreduce(b.buffer, out=b.buffer, op="sum", algorithm=alg,
                               name=b.name)
                fusion.unpack(b)
            self._exchange_sparse()
            wait = _clock() - ts
            opt.step()
        t4 = _clock()
        stats["forward"] += t1 - t0
        stats["backward"] += t2 - t1
        stats["wait"] += wait
        stats["update"] += (t4 - t2) - wait
        stats["steps"] += 1
        self.steps += 1
        tl = self.timeline
        if tl is not None:
            tl.record("compute", "forward", "", 0, t0, t1, 0)
            tl.record("compute", "backward", "", 0, t1, t2, 0)
            tl.record("compute", "exchange+update", "", 0, t2, t4, 0)
        return float(loss)

    def _on_grads_ready(self, names):
        """Backward hook: pack the layer's gradients; launch the buckets that completed."""
        if not self._active:
            return
        if self.exchanger is not None:
            for name in names:
                self._start_compressed(name)
            return
        fusion = self.fusion
        slot = fusion.slot
        completed = False
        for name in names:
            if name in slot:
                completed = fusion.pack(name) or completed
        if completed:
            self._launch_ready()

    def _launch_ready(self):
        comm, alg = self.comm, self.algorithm
        for b in self.fusion.ready():
            b.handle = comm.iallreduce(b.buffer, out=b.buffer, op="sum", algorithm=alg,
                                       name=b.name)

    def _exchange_sparse(self):
        """Average row-sparse gradients: allgatherv every rank's (coalesced) rows."""
        comm = self.comm
        for name, p in self.sparse_params:
            g = p.grad
            xp = array_module(p.data)
            if g is None:
                dim = p.data.shape[1:]
                g = SparseGrad(xp.zeros(0, dtype=xp.int64),
                               xp.zeros((0,) + dim, dtype=p.data.dtype), p.data.shape)
            elif not isinstance(g, SparseGrad):  # a dense gradient after all
                g = _dense_to_rows(g)
            g = g.coalesce()
            idx = xp.ascontiguousarray(g.indices, dtype=xp.int64)
            vals = xp.ascontiguousarray(g.values, dtype=p.data.dtype)
            all_idx, _ = comm.allgatherv(idx)
            all_vals, _ = comm.allgatherv(vals.reshape(-1))
            all_vals = all_vals.reshape((-1,) + tuple(p.data.shape[1:]))
            all_vals *= 1.0 / self.size
            p.grad = SparseGrad(all_idx, all_vals, p.data.shape)

    def _start_compressed(self, name):
        """Compress ``name``'s gradient and start its collective (once per step)."""
        if name in self._started or name not in self._params:
            return
        self._started.add(name)
        p = self._params[name]
        g = p.grad
        if g is None:
            g = array_module(p.data).zeros_like(p.data)
        elif isinstance(g, SparseGrad):
            g = g.to_dense()
        self._pending.append(self.exchanger.start(g, name))

    def _finish_compressed(self):
        """Start what backward's hook did not, then decode tensor by tensor in the order
        started (the same on every rank) and update each as it arrives; returns the time
        spent waiting and decoding."""
        for name in self._order:
            self._start_compressed(name)
        ex, opt, params = self.exchanger, self.optimizer, self._params
        wait = 0.0
        for pending in self._pending:
            tw = _clock()
            grad = ex.finish(pending)
            wait += _clock() - tw
            params[pending.name].grad = grad
            opt.step((pending.name,))
        self._pending = []
        return wait

    # -- buffers (BatchNorm statistics) ---------------------------------------------------
    def _bcast_buffers(self):
        for name, buf in self.model.named_buffers():
            if hasattr(buf, "shape") and buf.ndim > 0 and buf.flags.c_contiguous:
                self.comm.bcast(buf, root=0)

    def sync_buffers(self):
        """Average floating buffers over the ranks (BatchNorm running statistics);
        collective. Integer buffers (counters) are the same on every rank already."""
        if not self.communicates or self.size == 1:
            return
        for name, buf in self.model.named_buffers():
            if not hasattr(buf, "dtype") or buf.dtype.kind != "f" or buf.size == 0:
                continue
            out = buf.copy() if buf.ndim == 0 else buf
            self.comm.allreduce(out, out=out, op="mean", algorithm="mpi",
                                name=f"buffer {name}")
            if out is not buf:
                self.model.set_buffer(name, out)

    def prepare_eval(self):
        self.sync_buffers()

    # -- checkpoints, metrics, end ----------------------------------------------------------
    def state_dict(self):
        """Buffers are averaged first so rank 0's copy (the one saved) is every rank's;
        error-feedback residuals, if compression keeps any, are gathered to the root."""
        self.sync_buffers()
        state = {}
        if self.exchanger is not None and hasattr(self.exchanger, "state_dict"):
            mine = self.exchanger.state_dict()
            state["exchanger"] = self.gather(mine)
        return state

    def load_state_dict(self, state):
        if self.exchanger is not None and state.get("exchanger") is not None:
            per_rank = state["exchanger"]
            if len(per_rank) == self.size and hasattr(self.exchanger, "load_state_dict"):
                self.exchanger.load_state_dict(per_rank[self.rank])

    def reset_stats(self):
        """Zero the per-step time counters (seconds, summed over steps)."""
        self.stats = {"steps": 0, "forward": 0.0, "backward": 0.0, "wait": 0.0,
                      "update": 0.0, "launched_in_backward": 0}

    def metrics(self):
        """This rank's mean per-step times (ms) since the previous epoch, and bytes sent.

        compute = forward + backward + optimizer; wait = time blocked on communication
        that overlap did not hide. Starts the next epoch's counts.
        """
        s = self.stats
        n = max(s["steps"], 1)
        out = {
            "compute_ms": 1e3 * (s["forward"] + s["backward"] + s["update"]) / n,
            "wait_ms": 1e3 * s["wait"] / n,
            "overlap": int(self.overlap),
        }
        if self.exchanger is not None:
            total = self.exchanger.bytes_sent
            out["bytes_sent_per_step"] = (total - getattr(self, "_bytes_before", 0)) / n
            out["compression_ratio"] = self.exchanger.stats()["compression_ratio"]
            self._bytes_before = total
        elif self.fusion is not None:
            # what an all-reduce moves per rank and step: 2 (p-1)/p of the gradient bytes
            p = self.size
            out["bytes_sent_per_step"] = self.fusion.nbytes * 2 * (p - 1) / p
        self.reset_stats()
        return out

    def finish(self):
        """Check every rank ran the same number of steps (the loader's promise)."""
        if self.communicates and self.size > 1:
            counts = self.comm.mpi.allgather(self.steps)
            if len(set(counts)) != 1:
                raise RuntimeError(f"allreduce: ranks ran different numbers of steps "
                                   f"{counts}; every rank must see the same number of "
                                   "batches (use mpidl.data.BatchLoader's sharding)")


def overlap_pays(comm, named_params):
    """(whether to overlap, why) for ``overlap="auto"``; see the module docstring.

    Collective: every rank must take the same path (overlapped all-reduces travel on
    the progress thread's communicator, blocking ones on the caller's), so the ranks
    agree on the minimum of their local answers. The choice changes speed, not results.
    """
    from mpidl.backend import is_gpu_array  # noqa: PLC0415

    if comm is None or comm.size == 1:
        return False, "one rank: nothing to overlap"
    if any(is_gpu_array(p.data) for _, p in named_params):
        ok, why = True, "GPU: the CPU is free for the progress thread"
    else:
        ok, why = _cpu_room(comm)
    mpi = getattr(comm, "mpi", None)
    if mpi is not None:
        from mpi4py import MPI  # noqa: PLC0415

        everyone = mpi.allreduce(int(ok), op=MPI.MIN)
        if ok and not everyone:
            ok, why = False, "another rank's node has no spare core for the progress thread"
    return ok, why


def _cpu_room(comm):
    usable = usable_cpus()
    total = os.cpu_count() or usable
    local = max(1, getattr(comm, "local_size", 1))
    threads = blas_threads_set() or 1  # (a BLAS nobody limited: counted as 1)
    if usable * local <= total and usable < total:  # ranks bound to their own CPUs
        ok = usable >= threads + 1
        why = f"{usable} CPU(s) bound to this rank, {threads} BLAS thread(s)"
    else:
        ok = usable >= local * (threads + 1)
        why = (f"{usable} CPU(s) for {local} rank(s) on this node x {threads} BLAS "
               "thread(s)")
    why += (": a spare core for the progress thread" if ok
            else ": no spare core for the progress thread")
    return ok, why


def _sparse_param_names(model):
    """Names of parameters whose gradients are row-sparse (Embedding weights)."""
    from mpidl.engine.embedding import Embedding  # noqa: PLC0415

    names = set()
    for name, layer in model.modules():
        if isinstance(layer, Embedding) or getattr(layer, "sparse_grad", False):
            names.update(f"{name}.{n}" if name else n for n in layer._params)
    return names


def _dense_to_rows(g):
    xp = array_module(g)
    return SparseGrad(xp.arange(g.shape[0], dtype=xp.int64), g, g.shape)


STRATEGY = DataParallel

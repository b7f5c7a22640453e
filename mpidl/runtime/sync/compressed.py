"""Compressed gradient exchange over the data-parallel group (``--compression``).

One compressor (with its memory: error feedback, momentum correction), built in one
place (``mpidl.compress.build_compression``), serves two ways of plugging into a step:

* ``BucketHook``: for compressors whose math is element-wise
  (``granularity == "bucket"``: fp16, none), a communication hook on the fused
  buckets (as DDP's comm hooks): each bucket is compressed and exchanged as one tensor,
  so fusion, overlap and bucket order stay as without compression.
* ``PerTensorCompressed``: for the others (top-k ratios, per-tensor scales, PowerSGD's
  matrices) every tensor is exchanged on its own through the ``Exchanger``; with overlap
  the backward hook compresses each tensor and starts its collective at once, and
  ``finish`` decodes them in the order started (the same on every rank). Embedding
  gradients are densified first. The collectives run on the progress thread, each
  tensor's transfer overlapping the next one's compression, only where that pays
  (``--overlap on``, or ``auto`` with a spare core per rank or a GPU:
  ``fused.overlap_pays``); otherwise on the caller's thread as each tensor starts, so
  no progress thread busy-waits in MPI on the core that compresses.

Bytes sent per step and the compression ratio go to the epoch line.
"""

import time

from mpidl.backend import array_module
from mpidl.engine.module import SparseGrad
from mpidl.options import Option
from mpidl.runtime.sync.base import GradSync
from mpidl.runtime.sync.fused import overlap_pays

OPTIONS = [
    Option("compression", str, None, "gradient compression (e.g. topk, onebit, qsgd, "
           "dgc:momentum=0.9); the same meaning under --strategy allreduce and ps; default "
           "none", "parallelism"),
    Option("ratio", float, None, "compression ratio or density (e.g. 0.01 keeps 1%% of "
           "gradient entries with topk)", "parallelism",
           check=lambda r: None if 0 < r <= 1 else "must be in (0, 1]"),
]


class _Bytes:
    """Per-epoch bytes sent and compression ratio from an Exchanger's counters."""

    def __init__(self):
        self.exchanger = None
        self._before = 0
        self.steps = 0

    def metrics(self):
        ex = self.exchanger
        if ex is None:
            return {}
        n = max(self.steps, 1)
        out = {"bytes_sent_per_step": (ex.bytes_sent - self._before) / n,
               "compression_ratio": ex.stats()["compression_ratio"]}
        self._before, self.steps = ex.bytes_sent, 0
        return out


class BucketHook:
    """A fused bucket's all-reduce replaced by a compressed exchange (the mean)."""

    def __init__(self, compressor, algorithm="auto"):
        self.compressor = compressor
        self.algorithm = algorithm
        self.bytes = _Bytes()

    def bind(self, comm):
        from mpidl.compress import Exchanger  # noqa: PLC0415

        self.bytes.exchanger = Exchanger(comm, self.compressor, algorithm=self.algorithm)

    def start(self, buffer, name):
        return self.bytes.exchanger.start(buffer, name)

    def finish(self, pending):
        return self.bytes.exchanger.finish(pending)

    def step_done(self):
        self.bytes.steps += 1

    def describe(self):
        return f"{self.compressor.name} on each bucket"

    def metrics(self):
        return self.bytes.metrics()

    def state_dict(self):
        return self.bytes.exchanger.state_dict()

    def load_state_dict(self, state):
        self.bytes.exchanger.load_state_dict(state)


class PerTensorCompressed(GradSync):
    """Every tensor exchanged on its own through the Exchanger (module doc)."""

    name = "compressed"

    def __init__(self, compressor, algorithm="auto", overlap="off"):
        super().__init__()
        self.compressor = compressor
        self.algorithm = algorithm
        self.mode = {True: "on", False: "off"}.get(overlap, overlap)  # on, off or auto
        self.overlap = self.mode == "on"  # (the backward hooks start the exchanges)
        self.pipelined = None  # collectives on the progress thread (set up: module doc)
        self.exchanger = None
        self.bytes = _Bytes()
        self._pending, self._started = [], set()
        self._wait = 0.0

    @property
    def wants_hooks(self):
        return self.overlap and self.exchanger is not None

    def setup(self, ctx, named_params):
        from mpidl.compress import Exchanger  # noqa: PLC0415

        super().setup(ctx, named_params)
        # backward's order: the last layers' gradients are final first
        self._order = [n for n, _ in reversed(named_params)]
        if ctx.group is not None:
            self.pipelined = self.overlap or (
                self.mode == "auto" and overlap_pays(ctx.group, named_params)[0])
            self.exchanger = Exchanger(ctx.group, self.compressor, algorithm=self.algorithm,
                                       blocking=not self.pipelined)
            self.bytes.exchanger = self.exchanger

    def begin_step(self):
        self._pending, self._started = [], set()
        self._wait = 0.0

    def on_grads_ready(self, names):
        for name in names:
            self._start(name)

    def _start(self, name):
        """Compress ``name``'s gradient and start its collective (once per step)."""
        if name in self._started or name not in self.params:
            return
        self._started.add(name)
        p = self.params[name]
        g = p.grad
        if g is None:
            g = array_module(p.data).zeros_like(p.data)
        elif isinstance(g, SparseGrad):
            g = g.to_dense()
        self._pending.append(self.exchanger.start(g, name))

    def finish(self):
        if self.exchanger is None:
            if self.names:
                yield self.names
            return
        for name in self._order:
            self._start(name)
        for pending in self._pending:
            t = time.perf_counter()
            grad = self.exchanger.finish(pending)
            self._wait += time.perf_counter() - t
            self.params[pending.name].grad = grad
            yield [pending.name]
        self._pending = []
        self.bytes.steps += 1

    def wait_seconds(self):
        return self._wait

    def describe(self):
        how = ("on the progress thread" if self.pipelined else "blocking") \
            if self.pipelined is not None else "not set up"
        return [f"compression {self.compressor.name} (tensor by tensor), algorithm "
                f"{self.algorithm}, overlap {'on' if self.overlap else 'off'}, "
                f"collectives {how}"]

    def metrics(self):
        return {"overlap": int(self.overlap), **self.bytes.metrics()}

    def state_dict(self):
        return self.exchanger.state_dict() if self.exchanger is not None else {}

    def load_state_dict(self, state):
        if self.exchanger is not None and state:
            self.exchanger.load_state_dict(state)

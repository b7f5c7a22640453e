"""Dense gradients averaged over the data-parallel group through fused buckets.

Think Horovod's tensor fusion and DDP's buckets (``mpidl.runtime.fusion`` lays them out):
gradients are packed into a few preallocated flat buckets of at most ``bucket_mb`` MiB
in the reverse of the parameter order (backward's order), one all-reduce per bucket.
Packing multiplies by 1/N, so the all-reduce is a plain sum and the mean costs no extra
pass; after it the bucket's views become the parameters' ``grad`` (no copy out).

* **Overlap** (``overlap="on"``): a grad-ready hook packs each parameter as soon as its
  gradient is final (the step's last backward pass) and a complete bucket's
  non-blocking all-reduce starts at once (buckets strictly in index order, so every rank
  issues the same collectives in the same order) on the group's progress thread while
  backward goes on. ``finish`` then waits for bucket 0 and yields its names (the
  optimizer updates them), waits for bucket 1, and so on.
* **No overlap** (``"off"``): after backward each bucket is all-reduced with a blocking
  call, then all names are yielded at once.
* **auto** (the default): overlap where it can pay, i.e. on GPU, or when this node has a
  spare CPU per rank for the progress thread (see ``overlap_pays``). On a CPU node whose
  cores all compute, the progress thread only takes time from backward: bench/scaling.py
  measured overlapped steps slower than blocking ones with 2 ranks on 2 cores.
* **A communication hook** (``hook``, as DDP's comm hooks): compressors that can run on
  a whole bucket (``Compressor.granularity == "bucket"``: fp16, none) replace the
  all-reduce of each bucket by their own exchange; packing then does not scale, the
  hook returns the mean.
* **Mixed precision** (``--precision bf16|fp16``, the runtime's ``precision``): the
  buckets hold 2-byte gradients (float16, or bfloat16 words), half the bytes, reduced by
  mpidl's own algorithms (each addition rounded once to the format; never an MPI
  float16 datatype, see ``mpidl.comm.ops``).
"""

import os
import time

from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.fusion import MiB, FusionBuffers
from mpidl.runtime.sync.base import GradSync
from mpidl.threads import blas_threads_set, usable_cpus

#: Default fusion buffer size; see bench/results/scaling.json for the measurements.
DEFAULT_BUCKET_MB = 4.0
OVERLAP_MODES = ("auto", "on", "off")
_clock = time.perf_counter

OPTIONS = [
    Option("algorithm", str, None, "allreduce algorithm: ring, tree, recursive_doubling, "
           "mpi or auto (default auto)", "parallelism"),
    Option("bucket_mb", float, None, "gradient fusion bucket size in MiB (default "
           f"{DEFAULT_BUCKET_MB:g})", "parallelism", metavar="MB",
           check=lambda mb: None if 1 <= mb * MiB < float("inf") else
           "must be a positive number of MiB, at least one byte"),
    Option("overlap", str, "auto", "overlap gradient communication with backward: on, "
           "off, or auto (on with a GPU or a spare core per rank, where it pays); "
           "--no-overlap is --overlap off", "parallelism", choices=OVERLAP_MODES),
]


def check_algorithm(algorithm):
    """The all-reduce algorithm name, checked against the communicator's registry."""
    from mpidl.comm import ALGORITHMS  # noqa: PLC0415

    algorithm = algorithm or "auto"
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"--algorithm {algorithm!r} is not an allreduce algorithm: "
                          f"choose one of {', '.join(ALGORITHMS)}")
    return algorithm


def check_overlap(overlap):
    if overlap is None or overlap == "auto":
        return "auto"
    if overlap in ("on", "off"):
        return overlap
    if overlap in (True, False, 0, 1):
        return "on" if overlap else "off"
    raise ConfigError(f"--overlap must be on, off or auto (or True/False), got {overlap!r}")


def check_bucket_mb(bucket_mb):
    bucket_mb = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
    if not 1 <= bucket_mb * MiB < float("inf"):
        raise ConfigError(f"--bucket-mb must be a positive number of MiB, got {bucket_mb}")
    return bucket_mb


class FusedAllreduce(GradSync):
    """Average dense gradients over ``ctx.group`` through fused buckets (module doc)."""

    name = "fused-allreduce"

    def __init__(self, algorithm="auto", bucket_mb=None, overlap="auto", hook=None):
        super().__init__()
        self.algorithm = check_algorithm(algorithm)
        self.bucket_mb = check_bucket_mb(bucket_mb)
        self.overlap_mode = check_overlap(overlap)
        self.overlap = self.overlap_mode == "on"  # "auto" is decided in setup
        self.overlap_reason = ""
        self.hook = hook              # a bucket comm hook (compression), or None
        self.comm = None
        self.fusion = None
        self._active = False
        self._wait = 0.0
        self.launched_in_backward = 0

    @property
    def wants_hooks(self):
        return self.overlap and self.comm is not None

    def setup(self, ctx, named_params):
        super().setup(ctx, named_params)
        self.comm = ctx.group
        size = 1 if self.comm is None else self.comm.size
        scale = 1.0 if self.hook is not None else 1.0 / size
        precision = getattr(ctx, "precision", None)  # mixed precision: 2-byte buckets
        pp = getattr(ctx, "pp", None)  # a pipeline's chunks: a bucket holds one chunk's
        self.fusion = self._fusion(named_params, int(self.bucket_mb * MiB), scale,
                                   None if precision is None else precision.wire,
                                   None if pp is None else pp.part_of())
        if self.hook is not None and self.comm is not None:
            self.hook.bind(self.comm)
        if self.overlap_mode == "auto":
            self.overlap, self.overlap_reason = overlap_pays(self.comm, ctx.named_params)

    def _fusion(self, named_params, bucket_bytes, scale, wire=None, part_of=None):
        """The buckets' layout and buffers (a subclass may share one buffer)."""
        return FusionBuffers(named_params, bucket_bytes, scale=scale, wire=wire,
                             part_of=part_of)

    # -- a step
    def begin_step(self):
        self.fusion.begin_step()
        self._wait = 0.0

    def on_grads_ready(self, names):
        fusion = self.fusion
        completed = False
        for name in names:
            if name in fusion.slot:
                completed = fusion.pack(name) or completed
        if completed:
            self._launch_ready()

    def _launch_ready(self):
        for b in self.fusion.ready():
            b.handle = self._start(b, blocking=False)

    def _start(self, b, blocking):
        if self.hook is not None:
            return self.hook.start(b.buffer, b.name)
        if blocking:
            self.comm.allreduce(b.wire, out=b.wire, op="sum", algorithm=self.algorithm,
                                name=b.name)
            return None
        return self.comm.iallreduce(b.wire, out=b.wire, op="sum",
                                    algorithm=self.algorithm, name=b.name)

    def _complete(self, b):
        if self.hook is not None:
            result = self.hook.finish(b.handle)
            if result is not b.buffer:
                b.buffer[...] = result
        elif b.handle is not None:
            b.handle.wait()
        b.handle = None
        self.fusion.unpack(b)

    def finish(self):
        fusion = self.fusion
        if self.comm is None:  # one process without a communicator: nothing to average
            if self.names:
                yield self.names
            return
        if self.overlap:
            self.launched_in_backward += fusion.launched
            # gradients the hooks did not see (unused parameters, layers outside the
            # hooked model) are packed now, and the remaining buckets go out
            fusion.pack_rest()
            self._launch_ready()
            for b in fusion.buckets:  # wait only for the bucket the next update needs
                t = _clock()
                self._complete(b)
                self._wait += _clock() - t
                yield b.names
            self._step_done()
            return
        fusion.pack_rest()
        t = _clock()
        for b in fusion.buckets:
            b.handle = self._start(b, blocking=True)
            self._complete(b)
        self._wait += _clock() - t
        self._step_done()
        if self.names:
            yield self.names

    def _step_done(self):
        if self.hook is not None:
            self.hook.step_done()

    def wait_seconds(self):
        return self._wait

    # -- reporting
    def overlap_text(self):
        text = "on" if self.overlap else "off"
        if self.overlap_mode == "auto":
            text = f"auto -> {text} ({self.overlap_reason})"
        return text

    def describe(self):
        f = self.fusion
        size = 1 if self.comm is None else self.comm.size
        how = f"compression {self.hook.describe()}" if self.hook is not None else \
            f"algorithm {self.algorithm}"
        head = (f"fused all-reduce over {size} rank(s), {how}, {len(f)} bucket(s) of <= "
                f"{self.bucket_mb:g} MiB ({f.nbytes / MiB:.2f} MiB in all), overlap "
                f"{self.overlap_text()}")
        return [head] + f.describe()

    def metrics(self):
        out = {"overlap": int(self.overlap)}
        if self.hook is not None:
            out.update(self.hook.metrics())
        return out

    def memory(self, ledger):
        # the buckets: the gradients themselves once reduced (the parameters' grad are
        # views of them, counted as gradients first), else communication buffers
        ledger.add("mem_comm", [b.buffer for b in self.fusion.buckets])

    def bytes_per_step(self):
        """What a ring all-reduce of the buckets moves per rank and step."""
        p = 1 if self.comm is None else self.comm.size
        return self.fusion.nbytes * 2 * (p - 1) / p

    def state_dict(self):
        return self.hook.state_dict() if self.hook is not None else {}

    def load_state_dict(self, state):
        if self.hook is not None and state:
            self.hook.load_state_dict(state)


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

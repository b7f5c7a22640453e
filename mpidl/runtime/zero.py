"""ZeRO (``--zero 0|1|2|3``): optimizer state, gradients and parameters sharded over the
data-parallel group, with every bit of stage 0's trajectory.

Shards follow the fused-bucket layout (``fusion.plan``): bucket b of n elements is cut
by ``layout.even_split(n, N)`` and rank r owns chunk r, the chunk ``reduce_scatter``
returns. A step, per bucket:

* the gradients are packed as for stage 0 (times 1/N) and **reduce-scattered** instead of
  all-reduced: rank r receives the reduced chunk r (``Shard.grad``);
* the **sharded placement** steps chunk r only, with an optimizer of the trainer's class
  and hyper-parameters holding one flat parameter per bucket shard (``Sharded.inner``);
  SGD (momentum, Nesterov, weight decay), Adam and AdamW are elementwise, so the flat
  update is bitwise the per-parameter one;
* an **all-gather** of the updated chunks refreshes every rank's full parameters (stages
  1 and 2: the parameters are views of one flat buffer per bucket, ``Shard.params``, so
  the gather lands in place).

Stage 1 keeps the fused gradient buckets (a full gradient per rank, as stage 0 does);
stage 2 keeps the gradient shards only: one communication buffer, the size of the
largest bucket, is packed and reduce-scattered bucket after bucket once backward is done
(no overlap with backward), and each parameter's gradient is dropped once packed.

**Exactness.** The reduced chunk must be the bits stage 0's all-reduce gives. That holds
for ``ring`` (its reduce-scatter is the first half of its all-reduce), ``tree`` (both
reduce to rank 0 down the same tree) and ``recursive_doubling`` below 4 ranks (one
pairwise round after the fold). Recursive halving at 4+ ranks adds in another order
than recursive doubling, and MPI's own ``Reduce_scatter`` need not match its
``Allreduce`` (it does not, measured with MPICH at 3 and 4 ranks): for those buckets
the gradient is **all-reduced** with stage 0's algorithm and the chunk taken from it —
exact, at the price of more bytes; ``describe()`` says which buckets do so. With
``--algorithm auto`` each bucket's algorithm is resolved as stage 0 resolves it (the
all-reduce table, by the bucket's bytes).

**Traffic** with ``--algorithm ring``: rank r sends, per bucket of n elements,
``n - c[r]`` (reduce-scatter) and ``n - c[r+1]`` (all-gather) elements, exactly what
stage 0's ring all-reduce sends; averaged over the ranks that is 2(N-1)/N of the
bucket, exactly.

**Layouts.** With tensor parallelism and pipelines ZeRO runs on each rank's
data-parallel group and shards the slices or the stage it holds. A pipeline's schedule
orders its micro-batches' passes, so stage 3 gathers afresh before each of them
(``Pipeline.pass_hook``, ``ParamGathers.new_pass``); with interleaved chunks no bucket
holds two chunks' parameters (``fusion.plan``'s ``part_of``, for every stage alike, so
the bits stay stage 0's) and a pass prefetches within its chunk, so each pass gathers
its chunk's buckets once. What that cannot serve yet is refused by ``check_pipeline``.

**Mixed precision** (``--precision bf16|fp16``): the buckets are 2-byte, and so is
every collective. Each ``Shard`` holds its chunk of the float32 master weights (the
inner optimizer steps it) and decodes its reduced gradient chunk into float32, divided
by the loss scale, before the update (``Sharded.step``); the updated chunk, rounded to
the format, is all-gathered as 2-byte words and decoded into the working copies (stages
1-2), or kept in that format for stage 3's gathers, which decode what arrives. Each
rank sees only its chunks, so fp16's overflow check is agreed over the group before
any update (``Precision.agree``). The same bits as stage 0 in the same precision: the
decode, the unscale, the elementwise update and the rounding are stage 0's, chunk by
chunk.

**Lazily built models** (``mpidl.engine.lazy``; ``mpidl train --zero 3`` in fp32): at
stage 3 each rank draws only its chunk of every bucket (``Shard(chunk_only)``), set-up
makes no full buffer, and evaluation gathers bucket by bucket as a training forward
does (``ZeroSync.gathers_in_eval``; the runtime keeps the ranks' evaluation forwards in
step), so no rank holds the whole model (checkpoints are its chunks, below; ``--save``
gathers a bucket at a time). A model built
eagerly is gathered whole after set-up and for evaluation, as before (the Python API
reads its parameters after ``setup``).

**Checkpoints** are per parameter, as a replicated optimizer keeps its state, so one
resumes at any stage and any number of ranks. Over data parallelism alone each rank
writes its own chunks as flat pieces of every parameter, optimizer slot and float32
master (``Sharded.checkpoint_pieces``, ``mpidl.training.checkpoint``'s shard files) and
nothing is gathered; loading reads, of each tensor, only the elements of this run's
chunks (``import_state``, ``load_params``, ``load_masters``: a piece at a time, from
arrays or from a checkpoint left on disk). Under a pipeline or tensor parallelism each
rank writes its chunks too, of its stage's buckets and of its slices
(``Runtime._chunk_parts``). Through the Python API's ``Runtime.state_dict``
``export_state`` (collective) gathers the shards' optimizer state into the trainer's
optimizer on the group's first rank and the masters into ``Precision.exported``, which
the runtime writes from there.
"""

import copy
import time

from mpidl.backend import array_module, to_device, to_numpy
from mpidl.comm.layout import even_split
from mpidl.engine.lazy import flat_slice, is_deferred, is_lazy
from mpidl.engine.module import Parameter
from mpidl.errors import AgreedUserError, ConfigError
from mpidl.options import Option
from mpidl.runtime.sync.fused import FusedAllreduce

STAGES = (0, 1, 2, 3)
_clock = time.perf_counter

OPTIONS = [
    Option("zero", int, 0, "ZeRO stage over the data-parallel group: 0 replicated "
           "optimizer (default), 1 shard the optimizer state, 2 also the gradients, 3 also "
           "the parameters; bitwise the trajectory of stage 0", "parallelism",
           metavar="STAGE", check=lambda v: None if v in STAGES else
           "must be 0, 1, 2 or 3 (the ZeRO stage)"),
    Option("zero_reuse", str, None, "--zero 3: keep the buckets backward starts with (its "
           "first two layers') gathered from the end of forward instead of freeing and "
           "gathering them again: fewer bytes, held through the loss; off by default",
           "parallelism", choices=(None, "on", "off")),
]


def check_stage(zero):
    """The stage as an int, or one ConfigError."""
    if isinstance(zero, bool) or zero not in STAGES:
        raise ConfigError(f"--zero must be 0, 1, 2 or 3 (the ZeRO stage), got {zero!r}")
    return int(zero)


def check_options(strategy, options):
    """ConfigError for settings ZeRO cannot serve (local work; run for every preset)."""
    if "zero" not in options:
        return 0
    zero = check_stage(options["zero"])
    if options.get("zero_reuse") == "on" and zero != 3:
        raise ConfigError(f"--zero-reuse on keeps gathered parameters, which only --zero 3 "
                          f"gathers (got --zero {zero}); drop --zero-reuse or use --zero 3")
    if zero == 0:
        return 0
    if strategy == "ps":
        raise ConfigError(f"--zero {zero} shards the optimizer over the data-parallel group "
                          "of --strategy allreduce; the parameter server keeps the optimizer "
                          "on its servers already (use --strategy allreduce, or drop --zero)")
    if strategy == "hogwild":
        raise ConfigError(f"--zero {zero} shards the optimizer over the data-parallel group "
                          "of --strategy allreduce; hogwild keeps one copy of the weights on "
                          "its servers and no optimizer state (drop --zero)")
    sync = options.get("sync")
    if sync not in (None, "allreduce"):
        raise ConfigError(f"--zero {zero} cannot serve --sync {sync}: each replica there "
                          "steps its own optimizer alone; drop one of them")
    if options.get("compression"):
        raise ConfigError(f"--zero {zero} cannot serve --compression "
                          f"{options['compression']}: compressed gradients are not "
                          "reduce-scattered; drop one of them")
    return zero


def check_pipeline(zero, stages, schedule=None, emulate_compute=False, zero_reuse=None):
    """One ConfigError for what stage 3 does not serve with ``--pipeline-stages`` yet:
    it gathers a chunk's buckets afresh for every pass the schedule runs
    (``ParamGathers.new_pass``), which needs passes that run (not emulated) and no whole
    weight copies (async's stashing); ``--zero-reuse on`` would keep buckets between
    passes."""
    from mpidl.runtime.pipeline_schedule import parse  # noqa: PLC0415

    if (zero or 0) < 3 or (stages or 1) < 2:
        return
    kind, _ = parse(schedule or "1f1b")
    refuse = {"--schedule async": kind == "async",
              "--emulate-compute": emulate_compute,
              "--zero-reuse on": zero_reuse == "on"}
    for flag, bad in refuse.items():
        if bad:
            raise ConfigError(f"--pipeline-stages {stages} with --zero 3 and {flag} is not "
                              "built yet: drop one of them (--zero 1 and 2 compose with it)")


def exact_reduce_scatter(algorithm, size):
    """Whether ``algorithm``'s reduce-scatter gives bitwise chunk ``rank`` of its
    all-reduce on ``size`` ranks (module doc)."""
    if algorithm in ("ring", "tree"):
        return True
    if algorithm == "recursive_doubling":
        return size < 4
    return False


#: optimizers whose update is elementwise (a flat shard's update is the per-parameter one)
def _elementwise():
    from mpidl.engine.optim import SGD, Adam, AdamW  # noqa: PLC0415

    return (SGD, Adam, AdamW)


def check_setup(zero, model, optimizer, sparse_mode):
    """ConfigError (local, before any communication) for a model or optimizer ZeRO
    cannot serve: a non-elementwise optimizer, row-sparse gradients exchanged apart."""
    if not zero:
        return
    if type(optimizer) not in _elementwise():
        raise ConfigError(f"--zero {zero} steps flat shards of the parameters, which is "
                          "exact for elementwise optimizers only (sgd, adam, adamw); got "
                          f"{type(optimizer).__name__} (use --zero 0)")
    held = {id(p) for p in optimizer.params.values()}
    missing = [n for n, p in model.named_parameters() if id(p) not in held]
    if missing:
        raise ConfigError(f"--zero {zero} steps every parameter of the model, but the "
                          f"optimizer does not hold {', '.join(missing[:3])}"
                          f"{' ...' if len(missing) > 3 else ''} (frozen parameters); give "
                          "the optimizer all of them, or use --zero 0")
    if sparse_mode == "allgather":
        from mpidl.runtime.sync.rowsparse import sparse_param_names  # noqa: PLC0415

        sparse = sorted(sparse_param_names(model))
        if sparse:
            raise ConfigError(f"--zero {zero}: {', '.join(sparse[:3])} ha"
                              f"{'s' if len(sparse) == 1 else 've'} row-sparse gradients, "
                              "which --sparse-grads allgather exchanges outside the buckets "
                              "ZeRO shards; add --sparse-grads dense")


class Shard:
    """One bucket's shard on this rank: where chunk ``rank`` lies and what is held.

    ``lo:hi``: this rank's chunk of the bucket's flat layout; ``params``: the bucket's
    parameters as one flat buffer (their ``data`` are views of it); ``param``: the flat
    ``Parameter`` the inner optimizer steps (a view of ``params[lo:hi]``); ``grad``: the
    reduced gradient chunk (``grad_wire``: as the collectives see it); ``algorithm``: the
    collective algorithm (stage 0's for this bucket); ``exact_rs``: whether its
    reduce-scatter is used (else all-reduce + slice); ``dtype``: the parameters'.

    Mixed precision (``precision``): the buckets and ``grad`` are 2-byte; ``param`` is
    this rank's chunk of the float32 **masters** (its own array, taken from
    ``precision.masters`` before they go), its ``grad`` the decoded float32 chunk while
    it is stepped; the working copies (the masters rounded) are in the 2-byte format: at
    stages 1-2 ``words``, the whole bucket's (the all-gather's target; ``params``, the
    float32 buffer built at set-up, goes once ``working_words`` handed them to the
    model's ``working_copy.WorkingCopies``), at stage 3 ``low``, this rank's chunk,
    which the gathers send.
    """

    __slots__ = ("bucket", "counts", "displs", "lo", "hi", "params", "param", "grad",
                 "grad_wire", "algorithm", "exact_rs", "dtype", "low", "words")

    def __init__(self, bucket, rank, size, algorithm, own=False, precision=None,
                 chunk_only=False):
        self.bucket = bucket
        n = bucket.buffer.size
        self.counts, self.displs = even_split(n, size)
        self.lo = self.displs[rank]
        self.hi = self.lo + self.counts[rank]
        self.algorithm = algorithm
        self.exact_rs = exact_reduce_scatter(algorithm, size)
        xp = array_module(bucket.buffer)
        self.dtype = bucket.params[0].data.dtype  # (the bucket's is the wire format's)
        if chunk_only:  # stage 3 of a lazily built model: the chunk alone, drawn for
            # this rank (``LazyInit.values_flat``); no full buffer until a gather
            self.params = None
            chunk = self._chunk(bucket.params, xp)
        else:  # the parameters move into one flat buffer (the all-gather's target)
            self.params = xp.empty(n, dtype=self.dtype)
            offset = 0
            for p in bucket.params:
                k = p.data.size
                view = self.params[offset:offset + k].reshape(p.data.shape)
                view[...] = p.data
                p.data = view
                offset += k
            chunk = self.params[self.lo:self.hi]
        # stage 3 (``own``): the chunk is this rank's own array, the full buffer comes and
        # goes (``ParamGathers``); stages 1-2: a view, the buffer stays
        self.grad = xp.zeros(self.hi - self.lo, dtype=bucket.buffer.dtype)
        self.grad_wire = self.grad.view(bucket.dtype)
        self.low = self.words = None
        if precision is None:
            self.param = Parameter(chunk.copy() if own and not chunk_only else chunk)
            self.param.grad = self.grad
            return
        masters = _flat(xp, [precision.masters[name].data for name in bucket.names])
        self.param = Parameter(masters[self.lo:self.hi].copy())
        if own:
            self.low = xp.empty(self.hi - self.lo, dtype=bucket.buffer.dtype)
            precision.wire.encode(chunk, 1.0, self.low)
        else:
            self.words = xp.empty(n, dtype=bucket.buffer.dtype)
            precision.wire.encode(self.params, 1.0, self.words)

    def _chunk(self, params, xp):
        """Elements ``lo:hi`` of the bucket's flat layout, from its parameters' values
        (arrays, or lazily built ones not drawn yet: only those elements are drawn)."""
        chunk = xp.empty(self.hi - self.lo, dtype=self.dtype)
        values = dict(zip(self.bucket.names, (p.data for p in params)))
        for name, first, end, lo, hi in _overlaps(self):
            chunk[lo:hi] = to_device(flat_slice(values[name], first, end))
        return chunk


class ZeroSync(FusedAllreduce):
    """The gradient part of ZeRO: fused buckets reduce-scattered into ``Shard.grad``."""

    name = "zero-reduce-scatter"

    def __init__(self, stage, algorithm="auto", bucket_mb=None, overlap="auto", reuse=False):
        super().__init__(algorithm, bucket_mb, "off" if stage >= 2 else overlap)
        self.stage = check_stage(stage)
        self.reuse = bool(reuse)  # --zero-reuse on (stage 3: check_options refuses it else)
        self.shards = []
        self.precision = None  # mixed precision's part (2-byte buckets, sharded masters)

    def setup(self, ctx, named_params):
        # stage 2 packs every bucket into one shared communication buffer
        self._shared = self.stage >= 2
        super().setup(ctx, named_params)
        comm = self.comm
        size = 1 if comm is None else comm.size
        rank = 0 if comm is None else comm.rank
        self.shards = []
        self.precision = precision = getattr(ctx, "precision", None)
        # stage 3 of a lazily built model: no rank ever holds it whole, from set-up on
        lazy = self.stage == 3 and any(is_lazy(p.data) for _, p in named_params)
        for b in self.fusion.buckets:
            alg = self.algorithm
            if alg == "auto" and comm is not None:
                alg = comm.selector.choose("allreduce", b.nbytes)  # as stage 0 would
            self.shards.append(Shard(b, rank, size, alg, own=self.stage == 3,
                                     precision=precision, chunk_only=lazy))
        self.micro = getattr(ctx.schedule, "k", 1)
        # gathers of a bucket per micro-batch: forward and backward (and with a pipeline's
        # --recompute, the forward backward runs again)
        pp = getattr(ctx, "pp", None)
        self._pipelined = pp is not None
        self.passes = 3 if pp is not None and pp.recompute else 2
        self.gathers = (ParamGathers(self, ctx.model, self.reuse,
                                     None if pp is None else pp.part_of(),
                                     None if precision is None else precision.wire)
                        if self.stage == 3 else None)
        if pp is not None and self.gathers is not None:
            pp.pass_hook = self.gathers.new_pass
        placement = ctx.placement
        if not isinstance(placement, Sharded):
            raise TypeError("ZeroSync needs the Sharded optimizer placement")
        if precision is not None:  # the shards took their chunks of the masters
            precision.hand_masters_to(placement)
        placement.bind(self, precision)

    def _fusion(self, named_params, bucket_bytes, scale, wire=None, part_of=None):
        from mpidl.runtime.fusion import FusionBuffers  # noqa: PLC0415

        return FusionBuffers(named_params, bucket_bytes, scale=scale, shared=self._shared,
                             wire=wire, part_of=part_of)

    # -- a step
    def _start(self, b, blocking):
        sh = self.shards[b.index]
        if self.comm is None:  # one process without a communicator: the chunk is all
            sh.grad[...] = b.buffer
            return None
        if sh.exact_rs:
            if blocking:
                self.comm.reduce_scatter(b.wire, out=sh.grad_wire, op="sum",
                                         algorithm=sh.algorithm, name=b.name)
                return None
            return self.comm.ireduce_scatter(b.wire, out=sh.grad_wire, op="sum",
                                             algorithm=sh.algorithm, name=b.name)
        if blocking:
            self.comm.allreduce(b.wire, out=b.wire, op="sum", algorithm=sh.algorithm,
                                name=b.name)
            return None
        return self.comm.iallreduce(b.wire, out=b.wire, op="sum",
                                    algorithm=sh.algorithm, name=b.name)

    def _complete(self, b):
        if b.handle is not None:
            b.handle.wait()
        b.handle = None
        sh = self.shards[b.index]
        if not sh.exact_rs and self.comm is not None:
            sh.grad[...] = b.buffer[sh.lo:sh.hi]
        for p in b.params:  # the full gradient is not kept (only the shard is reduced)
            p.grad = None

    def begin_step(self):
        super().begin_step()
        if self.gathers is not None:
            self.gathers.unpin()

    def working_words(self):
        """Mixed precision at stages 1-2: ``{name: the parameter's 2-byte working copy}``,
        views of its bucket's ``Shard.words`` (which the update's all-gather fills), for
        ``working_copy.WorkingCopies``; the float32 flat buffers go (the parameters'
        ``data`` keep them alive until the first step frees them)."""
        out = {}
        for sh in self.shards:
            if sh.words is None:
                continue
            for name, view, flat in zip(sh.bucket.names, sh.bucket.views,
                                        _param_views(sh.words, sh)):
                out[name] = flat.reshape(view.shape)
            sh.params = None
        return out

    @property
    def gathers_in_eval(self):
        """Whether evaluation gathers the parameters layer by layer, as a training forward
        does (stage 3 of a lazily built model, outside a pipeline): its forwards are then
        collective over the group, so every rank must run as many (``Runtime``)."""
        return self.gathers is not None and self.gathers.frugal and not self._pipelined

    def whole_params(self):
        """Collective over the group: ``(name, whole host array)`` of every parameter, a
        bucket at a time (gathered, handed out, freed again unless it was gathered
        already): ``--save`` of a model no rank holds whole (``gathers_in_eval``)."""
        g = self.gathers
        g.counting = False  # (not a training pass's gathers)
        for sh in self.shards:
            i = sh.bucket.index
            held = i in g.gathered
            g.ensure(i)
            for name, p in zip(sh.bucket.names, sh.bucket.params):
                yield name, to_numpy(p.data)
            if not held and not g.pinned:
                g.release(i, keep=False)
        g.counting = True

    def prepare_eval(self):
        if self.gathers_in_eval:
            self.gathers.evaluate()
        else:
            self.gather_params()

    def gather_params(self):
        if self.gathers is not None:
            self.gathers.materialize()

    def finish(self):
        if self.gathers is not None:
            self.gathers.release_all(spares=False)  # backward is over
        if self.comm is not None and not self._shared:
            yield from super().finish()
            return
        # stages 2-3 (and one process): bucket after bucket, packed just before it goes
        fusion = self.fusion
        for b in fusion.buckets:
            for name in b.names:
                fusion.pack(name)
            t = _clock()
            b.handle = self._start(b, blocking=True)
            self._complete(b)
            self._wait += _clock() - t
            yield b.names

    # -- reporting
    def metrics(self):
        out = super().metrics()
        out["zero"] = self.stage
        g = self.gathers
        if g is not None:  # stage 3: parameter gathers in training, how many prefetched,
            # how many into a spare buffer
            out["param_gathers"], out["param_prefetched"] = g.gathers, g.prefetched
            out["param_reused"] = g.reused
            g.gathers = g.prefetched = g.reused = 0
        return out

    def describe(self):
        f = self.fusion
        size = 1 if self.comm is None else self.comm.size
        how = {}
        for sh in self.shards:
            how.setdefault((sh.algorithm, sh.exact_rs), []).append(sh.bucket.index)
        parts = []
        for (alg, exact), idx in how.items():
            op = "reduce-scatter" if exact else \
                "all-reduce + own chunk (its reduce-scatter sums in another order)"
            parts.append(f"{alg} {op} for bucket(s) {_ranges(idx)}")
        if self.stage == 3:
            parts.append("parameters all-gathered bucket by bucket before each forward and "
                         "backward (the next bucket prefetched), freed after")
            if self.gathers is not None and self.gathers.keep:
                parts.append(f"bucket(s) {_ranges(sorted(self.gathers.keep))} kept from "
                             "forward into backward (--zero-reuse on)")
        held = ("optimizer state" if self.stage == 1 else
                "optimizer state and gradients" if self.stage == 2 else
                "optimizer state, gradients and parameters")
        overlap = self.overlap_text() if self.stage == 1 else \
            "off (one shared communication buffer, packed after backward)"
        if self.stage < 3:
            parts.append("then an all-gather of the updated shards")
        head = (f"ZeRO stage {self.stage} over {size} rank(s): {held} sharded along "
                f"{len(f)} bucket(s) of <= {self.bucket_mb:g} MiB ({f.nbytes / 2**20:.2f} "
                f"MiB in all), this rank owns {self.shard_elements()} of "
                f"{sum(b.buffer.size for b in f.buckets)} elements; {'; '.join(parts)}; "
                f"overlap {overlap}")
        return [head] + f.describe()

    def shard_elements(self):
        return sum(sh.hi - sh.lo for sh in self.shards)

    def memory(self, ledger):
        # the full flat parameters (stages 1-2; stage 3 while gathered) and this rank's
        # chunks; the reduced gradient chunks; stage 1's packed buckets are a full gradient
        # (as stage 0's), stage 2-3's one shared buffer is a communication buffer
        ledger.add("mem_params", [sh.params for sh in self.shards if sh.params is not None])
        if self.precision is not None:
            # mixed precision: the chunks of the float32 masters (optimizer state), the
            # 2-byte working chunks (stage 3; stages 1-2's whole buffers: the precision
            # part counts them)
            ledger.add("mem_optimizer", [sh.param.data for sh in self.shards])
            ledger.add("mem_params", [sh.low for sh in self.shards if sh.low is not None])
        else:
            ledger.add("mem_params", [sh.param.data for sh in self.shards])
        buckets = [b.buffer for b in self.fusion.buckets]
        if self.stage == 1:
            ledger.add("mem_grads", buckets)
        ledger.add("mem_grads", [sh.grad for sh in self.shards])
        ledger.add("mem_comm", buckets)
        if self.gathers is not None:
            ledger.add("mem_comm", [buf for buf, _ in self.gathers.gathered.values()])
            ledger.add("mem_comm", self.gathers.spares)

    def bytes_per_step(self):
        """Bytes this rank sends per step through a home-made algorithm's ring: the
        reduce-scatter (or all-reduce) and the all-gather of every bucket."""
        p = 1 if self.comm is None else self.comm.size
        if p == 1:
            return 0
        r = self.comm.rank
        total = 0
        for sh in self.shards:
            n, c = sh.bucket.buffer.size, sh.counts
            sent = (n - c[r]) + (n - c[(r + 1) % p])        # reduce-scatter + all-gather
            if not sh.exact_rs:
                sent += n - c[(r + 1) % p]                   # the all-reduce's second half
            if self.stage == 3:  # gathered for every forward and backward, not after
                again = self.micro * (self.passes - (sh.bucket.index in self.gathers.keep))
                sent += (again - 1) * (n - c[(r + 1) % p])
            total += sent * sh.bucket.dtype.itemsize
        return total


def _per_param(sh, flat):
    """``(name, array)`` for each parameter of ``sh``'s bucket: its piece of ``flat`` (the
    bucket's whole layout, gathered), shaped like it, on the parameters' device."""
    offset = 0
    for name, view in zip(sh.bucket.names, sh.bucket.views):
        k = view.size
        yield name, to_device(flat[offset:offset + k].reshape(view.shape),
                              dtype=sh.dtype).copy()
        offset += k


def _overlaps(sh):
    """``(name, first, end, lo, hi)`` for every parameter of ``sh``'s bucket with
    elements in this rank's chunk: its flat elements ``[first, end)`` are the chunk's
    ``[lo, hi)``."""
    offset = 0
    for name, view in zip(sh.bucket.names, sh.bucket.views):
        k = view.size
        a, b = max(sh.lo, offset), min(sh.hi, offset + k)
        if a < b:
            yield name, a - offset, b - offset, a - sh.lo, b - sh.lo
        offset += k


def _flat(xp, arrays):
    """The bucket's whole layout as one new flat ``xp`` array from its parameters' arrays,
    in the bucket's order: ``_per_param``'s inverse."""
    return xp.concatenate([a.reshape(-1) for a in arrays])


def _param_views(flat, sh):
    """The parameters of ``sh``'s bucket as flat views of ``flat`` (its whole layout)."""
    offset = 0
    for view in sh.bucket.views:
        yield flat[offset:offset + view.size]
        offset += view.size


def _words(buf):
    """A 2-byte buffer as uint16 words: what a gather copies, whatever the format."""
    return buf.view(array_module(buf).uint16)


def _decode_tail(wire, words, buf):
    """Decode ``words`` (the 2-byte format, the second half of float32 ``buf``'s bytes)
    into ``buf`` in place: a piece at a time from the front, each piece read whole before
    it is written, and piece [lo, hi) writes bytes below 4·hi <= 2·n + 2·hi, where the
    words still to be read begin: nothing unread is overwritten."""
    from mpidl.bfloat16 import pieces  # noqa: PLC0415

    for piece, out in pieces(words.view(wire.storage), buf):
        wire.decode(piece, out=out)


def _ranges(idx):
    return ", ".join(str(i) for i in idx) if len(idx) <= 4 else f"{idx[0]}..{idx[-1]}"


class Sharded:
    """Optimizer placement of ZeRO: each rank steps its shards, then all-gathers them.

    ``inner`` is an optimizer of the trainer's optimizer's class and hyper-parameters over
    one flat ``Parameter`` per bucket shard (named like the bucket); the trainer's
    optimizer keeps no state of its own but its learning rate (schedules set it) and
    hyper-parameters, copied into ``inner`` before every update.
    """

    def __init__(self, optimizer, stage=1):
        self.optimizer = optimizer
        self.stage = check_stage(stage)
        self.name = f"zero-{self.stage} sharded"
        self.sync = None
        self.inner = None
        self.precision = None   # mixed precision: the masters are the shards' ``param``
        self.shards = {}        # bucket name -> Shard
        self.of_param = {}      # parameter name -> bucket name
        self._exported = False  # the root's optimizer holds a checkpoint's gathered state

    def memory(self, ledger):
        """This rank's shards' optimizer state (and, on the root between a checkpoint and
        the next step, the gathered per-parameter state it wrote)."""
        from mpidl.runtime.placement import state_arrays  # noqa: PLC0415

        if self.inner is not None:
            ledger.add("mem_optimizer", state_arrays(self.inner))
        ledger.add("mem_optimizer", state_arrays(self.optimizer))

    def bind(self, sync, precision=None):
        self.sync = sync
        self.precision = precision
        self.shards = {sh.bucket.name: sh for sh in sync.shards}
        self.of_param = {n: sh.bucket.name for sh in sync.shards for n in sh.bucket.names}
        opt = self.optimizer
        inner = copy.copy(opt)  # the same class and hyper-parameters, none of the state
        inner.params = {name: sh.param for name, sh in self.shards.items()}
        inner.state = {}
        inner._scratch = {}
        self.inner = inner
        if opt.state:  # state loaded before set-up (a resume through the Python API)
            self.import_state()

    def zero_grad(self, model):
        self.optimizer.zero_grad()
        model.zero_grad()
        if self._exported:  # a checkpoint was written: the root lets go of its copy
            self.optimizer.state = {}
            if self.precision is not None:
                self.precision.exported = {}
            self._exported = False

    def _refresh(self):
        opt, inner = self.optimizer, self.inner
        inner._lr = opt.lr
        for h in opt.hyper:
            setattr(inner, h, getattr(opt, h))
        inner.fused = opt.fused

    def step(self, names, coef=1.0):
        """Step this rank's chunks of the buckets of ``names``, their reduced gradients
        times ``coef`` (the clipping coefficient) first; then gather (stages 1-2)."""
        buckets = []
        for n in names:
            b = self.of_param.get(n)
            if b is not None and (not buckets or buckets[-1] != b) and b not in buckets:
                buckets.append(b)
        if not buckets:
            return
        self._refresh()
        comm = self.sync.comm
        prec = self.precision
        for b in buckets:
            sh = self.shards[b]
            if prec is not None:  # the reduced 2-byte chunk, decoded (into the precision
                # part's scratch: one chunk at a time) and unscaled (exact)
                scratch = prec.grad_scratch(sh.grad.size, sh.grad)
                sh.param.grad = prec.wire.decode(sh.grad, out=scratch)
                if prec.scale != 1.0:
                    sh.param.grad *= sh.param.grad.dtype.type(1.0 / prec.scale)
            if coef != 1.0:
                sh.param.grad *= sh.param.grad.dtype.type(coef)
            self.inner.step([b])
            if prec is not None:
                sh.param.grad = None
                self._publish(sh)
            elif comm is not None and self.stage < 3:  # (stage 3 gathers before use)
                comm.allgather_shards(sh.params, algorithm=sh.algorithm, name=f"{b}.params")

    def _publish(self, sh):
        """Mixed precision: the working copies become the masters rounded to the format.
        Stages 1-2 all-gather the rounded chunks in the 2-byte format into the bucket's
        working copies (``Shard.words``); stage 3 keeps its chunk in that format for the
        gathers before use."""
        wire, b = self.precision.wire, sh.bucket
        if self.stage == 3:
            wire.encode(sh.param.data, 1.0, sh.low)
            return
        wire.encode(sh.param.data, 1.0, sh.words[sh.lo:sh.hi])
        comm = self.sync.comm
        if comm is not None:  # (words: nothing is summed)
            comm.allgather_shards(_words(sh.words), algorithm=sh.algorithm,
                                  name=f"{b.name}.params")
        for name, w in zip(b.names, _param_views(sh.words, sh)):
            self.precision.words_written(name, w)

    def reduced_chunks(self, names):
        """The reduced gradient chunks this rank holds for the buckets of ``names``
        (mixed precision reads them for overflows)."""
        buckets = {self.of_param[n] for n in names if n in self.of_param}
        return [self.shards[b].grad_wire for b in buckets]

    def load_masters(self, masters):
        """Mixed precision: a checkpoint's float32 masters (per parameter, any stage's;
        arrays or ``Deferred``) cut into this rank's chunks, and the working copies
        rounded from them."""
        wire = self.precision.wire
        for b, sh in self.shards.items():
            missing = [n for n in sh.bucket.names if n not in masters]
            if missing:
                raise ConfigError(f"--zero {self.stage}: the checkpoint has no master "
                                  f"weights for {', '.join(missing[:3])}; resume it with "
                                  "the model it was written with")
            sh.param.data[...] = self._chunk_of(sh, masters)
            if sh.low is not None:
                wire.encode(sh.param.data, 1.0, sh.low)
            if sh.words is not None:  # stages 1-2: the whole bucket's working copies
                for name, view in zip(sh.bucket.names, sh.bucket.views):
                    value = to_device(flat_slice(masters[name], 0, view.size),
                                      dtype=sh.param.data.dtype)
                    self.precision.set_working(name, value.reshape(view.shape))
            if sh.params is not None:  # the whole working copies (stage 3: while gathered)
                for name, view in zip(sh.bucket.names, _param_views(sh.params, sh)):
                    view[...] = to_device(flat_slice(masters[name], 0, view.size),
                                          dtype=view.dtype)
                self.precision.round(sh.params)

    def _chunk_of(self, sh, per_param):
        """This rank's chunk of bucket ``sh`` from ``{name: whole tensor}`` (arrays or
        ``Deferred``: only the chunk's elements of each are made), in the chunk's dtype."""
        dtype = sh.param.data.dtype
        chunk = array_module(sh.param.data).empty(sh.hi - sh.lo, dtype=dtype)
        for name, first, end, lo, hi in _overlaps(sh):
            chunk[lo:hi] = to_device(flat_slice(per_param[name], first, end), dtype=dtype)
        return chunk

    # -- sharded checkpoints (data parallelism alone; module doc)
    def _working_chunk(self, sh):
        """This rank's chunk of bucket ``sh``'s working parameters (what the model computes
        with; under mixed precision the masters rounded), on the host."""
        if self.precision is None:
            return to_numpy(sh.param.data)
        if sh.low is not None or sh.words is not None:  # in the 2-byte format
            low = sh.low if sh.low is not None else sh.words[sh.lo:sh.hi]
            out = array_module(sh.param.data).empty(sh.hi - sh.lo, dtype=sh.dtype)
            self.precision.wire.decode(low, out=out)
            return to_numpy(out)
        return to_numpy(sh.params[sh.lo:sh.hi])

    def checkpoint_pieces(self):
        """This rank's part of a sharded checkpoint: ``[place, first element, 1-D host
        array]`` of every parameter's elements in its chunks: the working values
        (``model``), each optimizer slot (``optimizer/state``) and, under mixed
        precision, the float32 masters (``runtime/precision/masters``). Views, no copies
        (on a CPU)."""
        out = []
        for b, sh in self.shards.items():
            working = self._working_chunk(sh)
            slots = {k: to_numpy(v) for k, v in self.inner.state.get(b, {}).items()
                     if k != "step"}
            masters = None if self.precision is None else to_numpy(sh.param.data)
            for name, first, _, lo, hi in _overlaps(sh):
                out.append([["model", name], first, working[lo:hi]])
                for slot, v in slots.items():
                    out.append([["optimizer", "state", name, slot], first, v[lo:hi]])
                if masters is not None:
                    out.append([["runtime", "precision", "masters", name], first,
                                masters[lo:hi]])
        return out

    def checkpoint_index(self):
        """The index's part of a sharded checkpoint (alike on every rank): ``[place,
        shape, dtype]`` of every tensor the shards hold pieces of, and ``{name: {"step":
        n}}``, the optimizer's per-parameter update counts."""
        import numpy as np  # noqa: PLC0415

        entries, steps = [], {}
        for b, sh in self.shards.items():
            st = self.inner.state.get(b)
            slots = [(k, np.dtype(v.dtype).str) for k, v in (st or {}).items() if k != "step"]
            for name, view in zip(sh.bucket.names, sh.bucket.views):
                shape = list(view.shape)
                entries.append([["model", name], shape, np.dtype(sh.dtype).str])
                for slot, dtype in slots:
                    entries.append([["optimizer", "state", name, slot], shape, dtype])
                if self.precision is not None:
                    entries.append([["runtime", "precision", "masters", name], shape,
                                    np.dtype(sh.param.data.dtype).str])
                if st is not None:
                    steps[name] = {"step": int(st["step"])}
        return entries, steps

    def chunks_finite(self):
        """Whether this rank's chunks are finite: the parameters it steps (the masters,
        under mixed precision) and the working values (a master past fp16's range rounds
        to inf)."""
        import numpy as np  # noqa: PLC0415

        for sh in self.shards.values():
            if not np.isfinite(to_numpy(sh.param.data)).all():
                return False
            if self.precision is not None and not np.isfinite(self._working_chunk(sh)).all():
                return False
        return True

    def load_params(self, model, state):
        """Stage 3 of a model whose buckets are not gathered (built lazily): a checkpoint's
        parameters (arrays or ``Deferred``, any layout's) cut into this rank's chunks a
        piece at a time, never whole; the model's buffers (and any parameter outside the
        buckets) loaded whole."""
        self.sync.gathers.release_all(spares=False)  # (nothing gathered holds old values)
        for sh in self.shards.values():
            sh.param.data[...] = self._chunk_of(sh, state)
        for name, p in model.named_parameters():
            if name not in self.of_param:
                value = state[name]
                p.data[...] = to_device(value.values() if is_deferred(value) else value,
                                        dtype=p.data.dtype)
        for name, _ in model.named_buffers():
            value = state[name]
            model.set_buffer(name, to_device(value.values()) if is_deferred(value) else
                             to_device(value).copy())

    # -- checkpoints gathered, under tensor or pipeline parallelism (module doc)
    def export_state(self, runtime):
        """Collective over the data-parallel group: the shards' optimizer state, gathered
        on the group's first rank into its optimizer as per-parameter state (what a
        replicated optimizer holds), which drops it again at the next step. With tensor or
        pipeline parallelism each group's first rank holds its slices' or stage's state,
        and the runtime joins those for the checkpoint."""
        if self.sync.gathers is not None:
            self.sync.gathers.materialize()  # the root saves the model's full parameters
        mine = {}
        for b, st in self.inner.state.items():
            mine[b] = {k: (v if isinstance(v, int) else to_numpy(v)) for k, v in st.items()}
        masters = None if self.precision is None else \
            {b: to_numpy(sh.param.data) for b, sh in self.shards.items()}
        group = runtime.group
        if group is None or group.size == 1:
            per_rank = [(mine, masters)]
        else:
            with group.waiting("in the gather of ZeRO optimizer shards (checkpoint)"):
                per_rank = group.mpi.gather((mine, masters), root=0)
            if group.rank != 0:
                return
        import numpy as np  # noqa: PLC0415

        if self.precision is not None:  # the float32 masters, per parameter
            self.precision.exported = {
                name: value for b, sh in self.shards.items()
                for name, value in _per_param(sh, np.concatenate([m[b] for _, m in per_rank]))}
        per_rank = [state for state, _ in per_rank]
        full = {}
        for b, sh in self.shards.items():
            states = [r.get(b) for r in per_rank]
            if all(s is None for s in states):
                continue
            if any(s is None for s in states):
                raise RuntimeError(f"ZeRO checkpoint: bucket {b} has optimizer state on some "
                                   "ranks only")
            step = states[0]["step"]
            for k in states[0]:
                if k == "step":
                    continue
                for name, value in _per_param(sh, np.concatenate([s[k] for s in states])):
                    full.setdefault(name, {"step": step})[k] = value
        self.optimizer.state = full
        self._exported = True

    def import_state(self):
        """Cut the per-parameter state the trainer's optimizer loaded (a checkpoint of any
        stage and number of ranks; its tensors may still be on disk, ``Deferred``) into
        this rank's shards, reading only their elements; the optimizer lets it go."""
        full = self.optimizer.state
        inner = {}
        for b, sh in self.shards.items():
            have = [n for n in sh.bucket.names if n in full]
            if not have:
                continue
            if len(have) != len(sh.bucket.names):
                missing = [n for n in sh.bucket.names if n not in full]
                raise ConfigError(f"--zero {self.stage}: the checkpoint has optimizer state "
                                  f"for some parameters of {b} but not for {missing[:3]}; "
                                  "resume it with --zero 0")
            steps = {int(full[n]["step"]) for n in have}
            if len(steps) != 1:
                raise ConfigError(f"--zero {self.stage}: the checkpoint's parameters "
                                  f"{have[:3]} were updated different numbers of times "
                                  f"({sorted(steps)}); one shard needs one step count: "
                                  "resume it with --zero 0")
            st = {"step": steps.pop()}
            for slot in full[have[0]]:
                if slot != "step":  # this rank's chunk, a parameter's piece at a time
                    st[slot] = self._chunk_of(sh, {n: full[n][slot] for n in have})
            inner[b] = st
        self.inner.state = inner
        self.optimizer.state = {}
        self._exported = False


class _Freed:
    """A parameter's ``data`` while no float32 copy of it is held (a stage-3 bucket not
    gathered; a 2-byte working copy between passes, ``working_copy``): its ``shape`` and
    ``dtype`` can be read (a checkpoint's shapes are checked against them), any other use
    is one clear error instead of wrong numbers (``hint``: what holds it, and what to do;
    default: stage 3's)."""

    __slots__ = ("name", "shape", "dtype", "hint")

    def __init__(self, name, shape, dtype, hint=None):
        self.name, self.shape, self.dtype, self.hint = name, tuple(shape), dtype, hint

    @property
    def ndim(self):
        return len(self.shape)

    def _refuse(self):
        # every rank runs the same model code and meets this at the same point: an error
        # the ranks agree on (one line, exit 2 from the command line)
        if self.hint is not None:
            return AgreedUserError(f"parameter {self.name!r} was used while not decoded: "
                                   f"{self.hint}")
        return AgreedUserError(f"--zero 3 cannot serve this model: parameter {self.name!r} "
                               "was used while not gathered, outside its layer's own "
                               "forward (layer(x)) and backprop, where stage 3 gathers it "
                               "(a container calling child.forward directly?); use --zero 2 "
                               "or call children as layer(x) and layer.backprop(dy)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self._refuse()

    def __array__(self, *args, **kwargs):
        raise self._refuse()

    def __repr__(self):
        held = "2-byte, not decoded" if self.hint else "sharded by --zero 3, not gathered"
        return f"<{self.name}: {held}>"


def param_layers(model):
    """``[(layer, its own parameters)]`` of every layer holding parameters, each once, in
    the order forward meets them."""
    out, seen = [], set()
    for _, m in model.modules():
        own = list(m._params.values())
        if own and id(m) not in seen:
            seen.add(id(m))
            out.append((m, own))
    return out


def boundary_params(model):
    """The names of the parameters of the last two layers with parameters in forward
    order: the ones backward needs first (``--zero-reuse on`` keeps their buckets
    gathered from forward into backward; ``mpidl simulate`` lays the step out from the
    same names)."""
    last = {id(p) for _, own in param_layers(model)[-2:] for p in own}
    return {name for name, p in model.named_parameters() if id(p) in last}


class ParamGathers:
    """ZeRO stage 3: which buckets' full parameters are gathered now.

    A pre-forward / pre-backward hook on every layer that holds parameters gathers the
    buckets that layer needs (waiting for a prefetch when one is in flight) and starts
    the non-blocking gathers of the buckets the next layer of the pass needs (or, when it
    needs none more, of the pass's next bucket: forward walks the buckets from the last
    index down, backward up), then frees the buckets the pass has left behind. A change
    of pass (forward to backward, or the next micro-batch) frees everything, so each
    bucket is gathered once per forward and once per backward (with a pipeline, whose
    schedule orders the passes of its micro-batches, each pass starts afresh:
    ``new_pass``, and with interleaved chunks, ``part``, prefetches stay within the
    pass's chunk; with ``reuse``, ``--zero-reuse on``: but the buckets of backward's
    first two layers, ``keep``, which forward leaves gathered for it). While *pinned*
    (after set-up, for evaluation and checkpoints) every bucket is gathered and the hooks
    do nothing; the next step takes each rank's chunk back and frees them. A lazily built
    model (``mpidl.engine.lazy``) is not pinned after set-up: every rank holds its chunks
    only, its passes gather them, and so do its evaluation's forwards (``evaluate``);
    its checkpoints are each rank's chunks (under tensor or pipeline parallelism, which
    gather them, every bucket is pinned: ``materialize``), ``--save`` takes one at a time.

    A buffer freed in forward (or when a pass ends) is kept as a *spare* for the next
    gather of a bucket of its size (the same bucket in backward, or another block's of
    the same shape): a large block freed and taken afresh is mapped anew by the
    allocator every time (glibc maps blocks above 32 MiB), and touching its pages again
    costs a CPU more than the gather itself. Spares are kept only while the gathered
    buffers and the spares together stay within the most the training passes have had
    gathered at once (``high``), the smallest dropped first, and only until backward's
    first layer has taken its gathers from them: backward, where the gradients add to
    the activations, holds no spare (the last forward's buckets are its first ones, and
    the rest would be held until its end). The ledger counts them (``mem_comm``).

    Under mixed precision (``wire``) a gather sends each rank's 2-byte chunk of the
    working copies (``Shard.low``) into the second half of the full float32 buffer's
    bytes, decoded into the whole buffer once it has arrived (``_bind``, ``_decode_tail``):
    no buffer beside it.
    """

    def __init__(self, sync, model, reuse=False, part_of=None, wire=None):
        if not hasattr(model, "modules"):
            raise ConfigError(f"--zero 3 gathers parameters layer by layer and needs an mpidl "
                              f"Layer; got {type(model).__name__} (use --zero 2)")
        self.comm = sync.comm
        self.shards = sync.shards
        self.wire = wire
        self.words = {}  # bucket index -> its gathered 2-byte words (mixed precision)
        index_of = {id(p): sh.bucket.index for sh in self.shards for p in sh.bucket.params}
        self.needs = {}  # id(layer) -> indices of the buckets its own parameters are in
        for m, params in param_layers(model):
            own = sorted({index_of[id(p)] for p in params if id(p) in index_of})
            if own:
                self.needs[id(m)] = own
                m.add_pre_hook(self._before)
        # each bucket's part of the model (``part_of``: an interleaved pipeline's chunk,
        # whose passes run apart: a pass prefetches within its own chunk only)
        self.part = [None if part_of is None else part_of(sh.bucket.names[0])
                     for sh in self.shards]
        # the layers with parameters in the order forward meets them (backward: reversed)
        order = list(self.needs)
        pairs = [(a, b) for a, b in zip(order, order[1:])
                 if self.part[self.needs[a][0]] == self.part[self.needs[b][0]]]
        self.after = {"forward": dict(pairs), "backward": {b: a for a, b in pairs}}
        # --zero-reuse on: the buckets backward's first two layers need stay gathered
        # from forward into backward (``boundary_params``' layers)
        self.keep = {i for m in order[-2:] for i in self.needs[m]} if reuse else set()
        # set-up leaves every bucket gathered (Shard built the full buffers), but for a
        # lazily built model, whose ranks hold their chunks only (``Shard(chunk_only)``)
        self.gathered = {sh.bucket.index: [sh.params, None] for sh in self.shards
                         if sh.params is not None}
        for sh in self.shards:
            if sh.params is None:
                for name, p, view in zip(sh.bucket.names, sh.bucket.params, sh.bucket.views):
                    p.data = _Freed(name, view.shape, sh.dtype)
        self.pinned = len(self.gathered) == len(self.shards)
        # never whole on a rank (a lazily built model): evaluation gathers layer by layer
        self.frugal = not self.pinned
        self.counting = True  # gathers count as a training pass's (not while evaluating)
        self.phase = None
        self.gathers = self.prefetched = 0  # in training passes (reset by metrics)
        self.spares = []  # freed full buffers kept for the next gathers of their size
        self.reused = 0  # gathers into a spare buffer (reset by metrics)
        self.high = 0  # the most bytes gathered at once in a training pass

    # -- the hooks
    def _before(self, layer, phase):
        if self.pinned:
            return
        if phase != self.phase:
            into_backward = self.phase == "forward" and phase == "backward"
            self.release_all(hold=self.keep if into_backward else ())
            self.phase = phase
        need = self.needs.get(id(layer))
        if not need:
            return
        lo, hi = need[0], need[-1]
        for i in list(self.gathered):  # the buckets this pass has left behind
            if phase == "forward" and i > hi and i not in self.keep:
                self.release(i, keep=True)  # a spare (backward gathers it again)
            elif phase == "backward" and i < lo:
                self.release(i, keep=False)
        for i in need:
            self.ensure(i)
        # prefetch the buckets of the next layer this pass meets (all of them: a layer
        # whose weight and bias sit in two buckets would otherwise wait for one), or,
        # when it needs none that are not here, the pass's next bucket
        nxt = self.after[phase].get(id(layer))
        ahead = [i for i in (self.needs[nxt] if nxt is not None else ())
                 if i not in self.gathered]
        if not ahead:
            i = lo - 1 if phase == "forward" else hi + 1
            ahead = [i] if (0 <= i < len(self.shards) and i not in self.gathered
                            and self.part[i] == self.part[lo]) else []
        for i in ahead:
            self._start(i, blocking=False)
        if phase == "backward":  # the spares forward left have served backward's first
            self.spares.clear()  # gathers; the others would be held until its end

    # -- gather and free
    def _start(self, i, blocking):
        sh = self.shards[i]
        buf = self._buffer(sh)
        if self.wire is None:
            sent = buf
            buf[sh.lo:sh.hi] = sh.param.data
        else:
            sent = self.words[i] = _words(buf)[buf.size:]  # (the second half of its bytes)
            sent[sh.lo:sh.hi] = _words(sh.low)
        handle = None
        training = not self.pinned and self.counting
        if training:
            self.gathers += 1
            self.prefetched += not blocking
        if self.comm is not None:
            name = f"{sh.bucket.name}.params"
            if blocking:
                self.comm.allgather_shards(sent, algorithm=sh.algorithm, name=name)
            else:
                handle = self.comm.iallgather_shards(sent, algorithm=sh.algorithm, name=name)
        self.gathered[i] = [buf, handle]
        if training:
            self.high = max(self.high, self._held(self.gathered.values()))
        if handle is None:
            self._bind(i, buf)

    def _buffer(self, sh):
        """An uninitialised full buffer for ``sh``'s bucket: a spare of its size, or new
        (the smallest spares dropped first if a new one would pass ``high``)."""
        xp = array_module(sh.param.data)
        n, dtype = sh.bucket.buffer.size, sh.dtype
        for k, spare in enumerate(self.spares):
            if spare.size == n and spare.dtype == dtype and array_module(spare) is xp:
                self.reused += 1
                return self.spares.pop(k)
        self._trim(extra=n * dtype.itemsize)
        return xp.empty(n, dtype=dtype)

    def _keep(self, buf):
        """A freed full buffer becomes a spare, within ``high`` (not while pinned: the
        buffers of evaluation and checkpoints are every bucket at once)."""
        if self.pinned or not self.high:
            return
        self.spares.append(buf)
        self._trim()

    def _trim(self, extra=0):
        self.spares.sort(key=lambda b: b.nbytes, reverse=True)
        while self.spares and (self._held(self.gathered.values()) + extra
                               + sum(b.nbytes for b in self.spares) > self.high):
            self.spares.pop()

    @staticmethod
    def _held(entries):
        return sum(buf.nbytes for buf, _ in entries)

    def _bind(self, i, buf):
        sh = self.shards[i]
        words = self.words.pop(i, None)
        if words is not None:
            _decode_tail(self.wire, words, buf)
        sh.params = buf
        offset = 0
        for p, view in zip(sh.bucket.params, sh.bucket.views):
            k = view.size
            p.data = buf[offset:offset + k].reshape(view.shape)
            offset += k

    def ensure(self, i):
        """Bucket ``i``'s full parameters in place (gathered now, or its prefetch waited)."""
        entry = self.gathered.get(i)
        if entry is None:
            self._start(i, blocking=True)
            return
        if entry[1] is not None:
            entry[1].wait()
            entry[1] = None
            self._bind(i, entry[0])

    def release(self, i, keep=True):
        """Free bucket ``i``'s full buffer (``keep``: as a spare, within ``high``)."""
        entry = self.gathered.pop(i)
        if entry[1] is not None:  # a prefetch nobody used: finish it before freeing
            entry[1].wait()
        self.words.pop(i, None)
        sh = self.shards[i]
        sh.params = None
        for name, p, view in zip(sh.bucket.names, sh.bucket.params, sh.bucket.views):
            p.data = _Freed(name, view.shape, sh.dtype)
        if keep:
            self._keep(entry[0])

    def new_pass(self):
        """A pipeline's schedule starts a forward or backward pass of one micro-batch
        (``Pipeline.pass_hook``): it gathers its buckets afresh, so that every pass, in
        whatever order the schedule runs them, gathers each bucket it needs once."""
        if not self.pinned:
            self.release_all()

    def release_all(self, spares=True, hold=()):
        """Free every gathered buffer but those of ``hold``; ``spares=False``: keep none
        as a spare either."""
        for i in sorted(self.gathered):
            if i not in hold:
                self.release(i, keep=spares)
        self.phase = None
        if not spares:
            self.spares.clear()

    def materialize(self):
        """Collective: every bucket gathered and kept until the next step (evaluation and
        the end of training of an eager model, gathered checkpoints)."""
        if self.pinned:
            return
        self.release_all()
        self.pinned = True  # (these gathers are not a training pass's)
        for i in range(len(self.shards)):
            self.ensure(i)
        self.spares.clear()

    def evaluate(self):
        """Evaluation's forwards gather as a training forward does, bucket by bucket
        (``frugal``), uncounted; whatever they leave gathered, the next step's forward
        takes as it is (nothing changed the parameters in between)."""
        if not self.pinned:
            self.counting = False

    def unpin(self):
        """The start of a step: each rank takes its chunk of the (possibly reloaded) full
        parameters back, and every full buffer is freed."""
        self.counting = True
        if not self.pinned:
            return
        if self.wire is None:  # (mixed precision: the masters are the chunks, and the
            for i, (buf, _) in self.gathered.items():  # checkpoint's reach them directly)
                sh = self.shards[i]
                sh.param.data[...] = buf[sh.lo:sh.hi]
        self.release_all()
        self.pinned = False

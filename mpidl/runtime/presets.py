"""``--strategy local|allreduce|ps|hogwild``: presets that put a step's parts together.

=========  ========================  =====================================  ============
preset     schedule                  gradient syncs                         optimizer
=========  ========================  =====================================  ============
local      micro-batches             none                                   replicated
allreduce  micro-batches             fused buckets (dense; a compressor     replicated
                                     that works on buckets as their comm
                                     hook) + row-sparse all-gather
                                     (Embedding); or per-tensor compressed
ps         micro-batches (workers)   push to / pull from parameter servers  on servers
                                     (``--group-size G``: fused all-reduce
                                     in groups of G workers, then the
                                     group's first rank pushes and pulls)
hogwild    micro-batches (workers)   read / add to MPI windows on the       none (-lr*g
                                     servers, lock-free (``hogwild``)       added there)
=========  ========================  =====================================  ============

``--precision bf16|fp16`` (``precision``) composes with ``local`` and with ``allreduce``'s
dense fused buckets (2-byte buckets), ZeRO included (the float32 masters sharded with the
optimizer state); it refuses what cannot serve it: the parameter
server, compressed exchange (its payloads are their own formats) and model averaging
(which averages the working copies, not the float32 masters).

``--sparse-sync ps`` (``parallax``) makes ``allreduce`` Parallax: ranks 0..S-1 serve the
parameters with row-sparse gradients (or those ``--ps-params`` names) and run their
optimizer, the other ranks all-reduce the rest among themselves and push those
gradients to the servers (``--servers``, ``--mode`` apply to that part).

``--sync local-sgd|diloco --period H`` composes with ``allreduce`` (``averaging``): the
gradient syncs above run during ``--warmup-steps`` only, then every rank steps alone and
the parameters are averaged every H steps (``--sync allreduce``, the default, is the
plain preset). ``ps`` refuses it; on one process (``local``) it has no effect.

Each part declares its own settings (``OPTIONS`` in its module); ``cli_options()``
collects them for the command line. ``build(name, comm, **options)`` hands each part
only the settings it declares; a setting no part of the chosen preset uses is an error
from Python (``strict=True``) and, from the command line (``strict=False``), a line in
the log saying it has no effect here (one command line runs on 1 rank and on N).
"""

from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime import averaging as averaging_part
from mpidl.runtime import clip as clip_part
from mpidl.runtime import hogwild as hogwild_part
from mpidl.runtime import dealing as dealing_part
from mpidl.runtime import hybrid as hybrid_part
from mpidl.runtime import lbfgs as lbfgs_part
from mpidl.runtime import pipeline as pipeline_part
from mpidl.runtime import precision as precision_part
from mpidl.runtime import schedule as schedule_part
from mpidl.runtime import tensor_parallel as tp_part
from mpidl.runtime import zero as zero_part
from mpidl.runtime.placement import OnServers, Replicated
from mpidl.runtime.runtime import Runtime
from mpidl.runtime.sync import compressed, fused, groups, parallax, pushpull, rowsparse
from mpidl.runtime.sync.base import GradSync

ALIASES = {"dp": "allreduce", "data_parallel": "allreduce", "parameter_server": "ps"}

OPTIONS = [
    Option("strategy", str, None, "local (one process), allreduce (data parallel) or ps "
           "(parameter server): presets of a step's parts; default: local on one rank, "
           "allreduce on several", "parallelism"),
    Option("cuda_graph", bool, False, "--device gpu, one process: capture the whole "
           "training step in a CUDA graph and replay it (SGD, Adam, AdamW; falls back to "
           "eager steps, saying why, when the step cannot be captured)", "parallelism"),
    Option("sync_bn", bool, False, "synchronize BatchNorm statistics over the data-parallel "
           "group (forward and backward), so N ranks with batch b train exactly like one "
           "process with batch N*b", "parallelism"),
]

#: options only the Python API takes (benchmarks, tests), never flags
PS_TUNING = ("trace", "poll_max_ms")
BENCH_TUNING = ("compute_pace",)  # seconds per sample of emulated compute (schedule.py)
AVERAGING_CHECK = ("verify_averaging",)  # a digest exchange after every averaging
#: presets whose ranks agree on the parameters only between epochs: checkpoints are
#: written at every epoch's end, never every K steps
EPOCH_END_CHECKPOINTS = ("ps", "hogwild")


def cli_options():
    """Every part's settings, for ``mpidl.config`` and the command line."""
    return (OPTIONS + schedule_part.OPTIONS + fused.OPTIONS + rowsparse.OPTIONS
            + compressed.OPTIONS + pushpull.OPTIONS + groups.OPTIONS + averaging_part.OPTIONS
            + zero_part.OPTIONS + hogwild_part.OPTIONS + precision_part.OPTIONS
            + tp_part.OPTIONS + hybrid_part.OPTIONS + pipeline_part.OPTIONS
            + dealing_part.OPTIONS + lbfgs_part.OPTIONS + parallax.OPTIONS)


def names():
    """The preset names usable with --strategy (aliases included)."""
    return sorted(set(PRESETS) | set(ALIASES))


def canonical(name):
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise ConfigError(f"strategy {name!r} is not available in this version of mpidl; "
                          f"available: {', '.join(names())}")
    return name


def build(name, comm=None, strict=True, **options):
    """A ``Runtime`` for preset ``name`` on ``comm`` (an mpidl Communicator over every
    rank, or None for one process); local work only, no communication."""
    name = canonical(name)
    given = {k: v for k, v in options.items() if v is not None}
    clip = clip_part.check_max_norm(given.pop("clip_grad_norm", None))
    if clip is not None and name in clip_part.REFUSED:
        raise ConfigError(f"--clip-grad-norm cannot be used with --strategy {name}: "
                          f"{clip_part.REFUSED[name]}; use --strategy allreduce")
    averaging_part.check_options(name, given)
    zero_part.check_options(name, given)
    hybrid_part.check_options(name, given)
    if (given.get("tensor_parallel") or 1) > 1 and name not in ("local", "allreduce"):
        raise ConfigError(f"--tensor-parallel {given['tensor_parallel']} cannot be used with "
                          f"--strategy {name}: tensor parallelism splits layers over ranks "
                          "that train together (--strategy allreduce)")
    if (given.get("pipeline_stages") or 1) > 1 and name not in ("local", "allreduce"):
        raise ConfigError(f"--pipeline-stages {given['pipeline_stages']} cannot be used with "
                          f"--strategy {name}: a pipeline's stages train together "
                          "(--strategy allreduce)")
    parallax.check_preset(name, given)
    if (given.get("group_size") or 1) != 1 and name != "ps":
        raise ConfigError(f"--group-size {given['group_size']} makes worker groups of a "
                          f"parameter server, not of --strategy {name}: add --strategy ps "
                          "(with --servers S), or drop --group-size")
    preset, takes = PRESETS[name]
    if name == "allreduce" and not parallax.wanted(given.get("sparse_sync")):
        takes = takes - _PS_SERVERS  # (the servers' settings serve --sparse-sync ps only)
    unused = sorted(k for k in given if k not in takes)
    if unused and strict:
        raise ConfigError(f"strategy {name!r} does not take option(s) {', '.join(unused)}; "
                          f"it takes {', '.join(sorted(takes)) or 'none'}")
    mine = {k: v for k, v in given.items() if k in takes}
    rt = preset(comm, unused, **mine)
    if clip is not None:
        rt.clip = clip_part.GradClip(clip)
        rt.clip.check(rt)
    return rt


def check_optimizer(name, optimizer):
    """A ``ConfigError`` when preset ``name`` cannot run ``optimizer`` (before any rank
    communicates; the runtime checks again at setup for the Python API)."""
    if canonical(name) == "hogwild":
        hogwild_part.check_optimizer(optimizer)


def _names(options):
    return {o.name for o in options}


def _schedule(accumulate, straggler, rank, trainers, what="training rank", pace=None):
    spec = schedule_part.parse_straggler(straggler)
    if pace is not None and not float(pace) > 0:
        raise ConfigError(f"compute_pace must be a positive number of seconds per sample, "
                          f"got {pace!r}")
    if isinstance(spec, schedule_part.Transient):
        return schedule_part.MicroBatches(accumulate, transient=spec, rank=rank, pace=pace)
    factor = 1.0
    if spec is not None:
        if spec[0] not in trainers:
            raise ConfigError(f"--straggler {straggler}: rank {spec[0]} is not a {what}; "
                              f"{what}s are ranks {trainers[0]}..{trainers[-1]}"
                              + (f" (ranks 0..{trainers[0] - 1} serve)" if trainers[0] else ""))
        factor = spec[1] if spec[0] == rank else 1.0
    return schedule_part.MicroBatches(accumulate, straggler=factor, pace=pace)


def _size(comm):
    return 1 if comm is None else comm.size


def _precision(precision, loss_scale, loss_scale_window, refuse=None):
    """The Precision part (None for fp32); ``refuse``: (what, why) this preset cannot do
    with a low precision."""
    part = precision_part.build_precision(precision, loss_scale, loss_scale_window)
    if part is not None and refuse is not None:
        what, why = refuse
        raise ConfigError(f"--precision {part.format} cannot be used with {what}: {why}; "
                          f"drop {what} or use --precision fp32")
    return part


def local(comm, unused, accumulate=1, straggler=None, precision=None, loss_scale=None,
          loss_scale_window=None, cuda_graph=False, tensor_parallel=1, micro_batches=None,
          **pipeline):
    prec = _precision(precision, loss_scale, loss_scale_window,
                      ("--cuda-graph", "the captured step is the plain float32 one")
                      if cuda_graph else None)
    tp_part.check_degree(tensor_parallel, _size(comm))
    accumulate = _micro_batches(accumulate, micro_batches)
    _pipeline(comm, pipeline, accumulate, tensor_parallel)
    if _size(comm) > 1:
        raise ConfigError(f"strategy 'local' trains on one process, but {comm.size} ranks "
                          "were started: use --strategy allreduce (the default for more than "
                          "one rank) or run without mpiexec")
    if cuda_graph and (accumulate or 1) > 1:
        raise ConfigError(f"--cuda-graph captures a step of one batch, not --accumulate "
                          f"{accumulate} micro-batches; drop one of them")
    if cuda_graph and straggler:
        raise ConfigError("--cuda-graph cannot slow a captured step (--straggler); drop one "
                          "of them")
    sched = _schedule(accumulate, straggler, 0, [0])
    runtime = Runtime(comm, "local", sched, [(_everything, GradSync())], Replicated,
                      unused=unused, precision=prec)
    runtime.cuda_graph = bool(cuda_graph)
    if cuda_graph:
        runtime.checks.append(_graph_check)
    return runtime


def _graph_check(model, optimizer):
    from mpidl.backend import is_gpu_array  # noqa: PLC0415

    if not all(is_gpu_array(p.data) for _, p in model.named_parameters()):
        raise ConfigError("--cuda-graph needs the model on a GPU: add --device gpu")


def allreduce(comm, unused, accumulate=1, straggler=None, algorithm=None, bucket_mb=None,
              overlap="auto", compression=None, ratio=None, sparse_grads=None, sync_bn=False,
              sync=None, period=None, warmup_steps=None, outer_lr=None, outer_momentum=None,
              verify_averaging=False, zero=0, zero_reuse=None, precision=None, loss_scale=None,
              loss_scale_window=None, tensor_parallel=1, hybrid=None, micro_batches=None,
              compute_pace=None, sparse_sync=None, ps_params=None, servers=None, mode=None,
              staleness=None, wait=None, staleness_aware_lr=None, epoch_quorum=None,
              **pipeline):
    ps_settings = dict(servers=servers, mode=mode, staleness=staleness, wait=wait,
                       staleness_aware_lr=staleness_aware_lr, epoch_quorum=epoch_quorum)
    if parallax.wanted(sparse_sync):
        parallax.check_composes(tensor_parallel, pipeline.get("pipeline_stages"), zero,
                                compression, sync, precision, hybrid, epoch_quorum)
        return _parallax(comm, unused, accumulate, straggler, compute_pace, micro_batches,
                         algorithm, bucket_mb, overlap, sparse_grads, sync_bn, ps_params,
                         pipeline, **ps_settings)
    tp = tp_part.check_degree(tensor_parallel, _size(comm))
    if tp > 1:
        check_tensor_parallel(tp, zero=zero, compression=compression, sync=sync,
                              precision=precision)
    accumulate = _micro_batches(accumulate, micro_batches)
    pp = _pipeline(comm, pipeline, accumulate, tp, zero=zero, zero_reuse=zero_reuse,
                   compression=compression, sync=sync, precision=precision, hybrid=hybrid,
                   straggler=straggler, sync_bn=sync_bn)
    refuse = None
    if compression not in (None, "none"):
        refuse = (f"--compression {compression}", "a compressor sends its own payload "
                  "format, not the 2-byte gradients mixed precision reduces")
    elif sync not in (None, "allreduce"):
        refuse = (f"--sync {sync}", "model averaging averages the working copies, not the "
                  "float32 master weights the optimizer steps")
    prec = _precision(precision, loss_scale, loss_scale_window, refuse)
    size = _size(comm)
    rank = 0 if comm is None else comm.rank
    sched = _schedule(accumulate, straggler, rank, list(range(size)), pace=compute_pace)
    algorithm = fused.check_algorithm(algorithm)
    sparse_mode = rowsparse.check_sparse_mode(sparse_grads)
    zero = zero_part.check_stage(zero or 0)
    if hybrid and comm is not None:  # (check_options refused what it cannot do)
        return hybrid_part.runtime(comm, unused, sched, algorithm, bucket_mb, overlap,
                                   sync_bn, accumulate)
    if pp is not None:
        sched = pp
    part = tp_part.TensorParallel(tp) if tp > 1 else None
    if zero:
        return _zero(comm, unused, sched, zero, algorithm, bucket_mb, overlap, sparse_mode,
                     sync_bn, pp, part, reuse=zero_reuse == "on", precision=prec)
    try:
        from mpidl.compress import build_compression  # noqa: PLC0415

        compressor = build_compression(compression, ratio)
    except ValueError as e:
        raise ConfigError(f"--compression {compression}: {e}" if compression else str(e)) \
            from None
    if compressor is not None and compressor.granularity == "tensor":
        syncs = [(_everything, compressed.PerTensorCompressed(
            compressor, algorithm=algorithm, overlap=fused.check_overlap(overlap)))]
    else:
        hook = compressed.BucketHook(compressor, algorithm) if compressor is not None else None
        dense = fused.FusedAllreduce(algorithm, bucket_mb, overlap, hook=hook)
        if sparse_mode == "allgather" and compressor is None:
            syncs = [(_NotSparse(), dense), (_Sparse(), rowsparse.RowSparseAllgather())]
        else:
            syncs = [(_everything, dense)]
    averaging = averaging_part.build_averaging(
        sync, period, warmup_steps, outer_lr, outer_momentum, algorithm=algorithm,
        bucket_mb=fused.check_bucket_mb(bucket_mb), verify=verify_averaging)
    rt = Runtime(comm, "allreduce" if averaging is None else f"allreduce+{averaging.name}",
                 sched, syncs, Replicated, sync_bn=sync_bn, unused=unused, averaging=averaging,
                 precision=prec, tensor_parallel=part, pipeline=pp)
    rt.compressor = compressor
    if prec is not None and sparse_mode == "allgather":
        rt.checks.append(lambda model, optimizer: precision_part.check_sparse_exchange(
            model, prec.format, sparse_mode))
    _add_checks(rt, part, pp)
    return rt


def _parallax(comm, unused, accumulate, straggler, compute_pace, micro_batches, algorithm,
              bucket_mb, overlap, sparse_grads, sync_bn, ps_params, pipeline, servers=None,
              mode=None, staleness=None, wait=None, staleness_aware_lr=None,
              epoch_quorum=None):
    """The allreduce preset with ``--sparse-sync ps`` (``sync/parallax.py``): ranks
    0..S-1 serve the remote parameters, the others train and all-reduce the rest."""
    from mpidl.runtime.server import ServerRole  # noqa: PLC0415

    split = parallax.Split(parallax.parse_patterns(ps_params))
    accumulate = _micro_batches(accumulate, micro_batches)
    _pipeline(comm, pipeline, accumulate, 1)  # (one stage: its flags' checks)
    size = _size(comm)
    num = pushpull.check_servers(servers, size, "allreduce --sparse-sync ps")
    server_ranks, trainer_ranks = list(range(num)), list(range(num, size))
    cfg = pushpull.mode_config(len(trainer_ranks), mode, staleness, wait, staleness_aware_lr,
                               epoch_quorum)
    algorithm = fused.check_algorithm(algorithm)
    sparse_mode = rowsparse.check_sparse_mode(sparse_grads)
    rank = comm.rank
    sched = _schedule(accumulate, straggler, rank, trainer_ranks, "trainer", compute_pace)
    roles = {"server": server_ranks, "trainer": trainer_ranks}
    name = "allreduce --sparse-sync ps"
    if rank in server_ranks:
        server = ServerRole(cfg, server_ranks, trainer_ranks, select=split)
        rt = Runtime(comm, name, sched, [], OnServers, role="server", server=server,
                     roles=roles, unused=unused)
    else:
        sync = parallax.Parallax(
            split, fused.FusedAllreduce(algorithm, bucket_mb, overlap),
            rowsparse.RowSparseAllgather() if sparse_mode == "allgather" else None,
            pushpull.PushPull(cfg, server_ranks, trainer_ranks))
        rt = Runtime(comm, name, sched, [(_everything, sync)], Replicated, sync_bn=sync_bn,
                     roles=roles, unused=unused)
    rt.mode_cfg = cfg
    rt.checks.append(split.check)
    rt.checkpoint_at_epoch_end = True
    return rt


def _add_checks(rt, tensor_parallel, pipeline):
    """The layouts' local checks of the model, run before any rank communicates."""
    for part in (tensor_parallel, pipeline):
        if part is not None:
            rt.checks.append(lambda model, optimizer, part=part: part.check(model))


def _micro_batches(accumulate, micro_batches):
    """``micro_batches`` is ``accumulate`` under the pipeline's name: one value."""
    if micro_batches is None:
        return accumulate
    if (accumulate or 1) not in (1, micro_batches):
        raise ConfigError(f"--micro-batches {micro_batches} and --accumulate {accumulate} are "
                          "the same setting (micro-batches per step): give one of them")
    return micro_batches


def _pipeline(comm, options, accumulate, tp, **given):
    """The ``Pipeline`` part for ``--pipeline-stages P > 1`` (None for P = 1), after
    one line for each setting that does not compose with it (yet)."""
    stages = options.get("pipeline_stages") or 1
    if stages == 1:  # (any schedule of one stage is plain accumulation)
        extra = [k for k in ("recompute", "emulate_compute", "stage_costs", "tied_exchange")
                 if options.get(k)]
        if extra:
            raise ConfigError(f"--{extra[0].replace('_', '-')} needs --pipeline-stages P > 1")
        pipeline_part.check_degree(stages, tp, _size(comm))
        kind, _ = pipeline_part.pipeline_schedule.parse(options.get("pipeline_schedule")
                                                        or "1f1b")
        if kind == "async":
            raise ConfigError("--schedule async needs --pipeline-stages P > 1 (its weights "
                              "run one step stale so the stages never flush; one stage is "
                              "plain accumulation: use 1f1b)")
        return None
    what = {"hybrid": given.get("hybrid") and f"--hybrid {given['hybrid']}",
            "straggler": given.get("straggler") and f"--straggler {given['straggler']}"}
    kind, _ = pipeline_part.pipeline_schedule.parse(options.get("pipeline_schedule")
                                                    or "1f1b")
    if kind == "async" and given.get("sync") not in (None, "allreduce"):
        what["sync"] = f"--schedule async and --sync {given['sync']}"
    for flag in what.values():
        if flag:
            raise ConfigError(f"--pipeline-stages {stages} with {flag} is not built yet: "
                              "drop one of them")
    zero_part.check_pipeline(given.get("zero"), stages, options.get("pipeline_schedule"),
                             options.get("emulate_compute"), given.get("zero_reuse"))
    pipeline_part.check_degree(stages, tp, _size(comm))
    return pipeline_part.Pipeline(stages, options.get("pipeline_schedule") or "1f1b",
                                  accumulate or 1, recompute=options.get("recompute", False),
                                  emulate_compute=options.get("emulate_compute", False),
                                  stage_costs=options.get("stage_costs"),
                                  tied_exchange=options.get("tied_exchange") or "micro-batch")


def check_tensor_parallel(tp, **given):
    """One line for what does not compose with tensor parallelism yet."""
    what = {"compression": given["compression"] not in (None, "none")
            and f"--compression {given['compression']}",
            "precision": given["precision"] not in (None, "fp32")
            and f"--precision {given['precision']}"}
    for flag in what.values():
        if flag:
            raise ConfigError(f"--tensor-parallel {tp} with {flag} is not built yet: drop one "
                              "of them")


def _zero(comm, unused, sched, zero, algorithm, bucket_mb, overlap, sparse_mode, sync_bn,
          pipeline=None, tensor_parallel=None, reuse=False, precision=None):
    """The allreduce preset with ZeRO stage ``zero`` (``zero.py``): every dense
    parameter in reduce-scattered buckets, the optimizer (with mixed precision's master
    weights) sharded."""
    from functools import partial  # noqa: PLC0415

    sync = zero_part.ZeroSync(zero, algorithm, bucket_mb, fused.check_overlap(overlap),
                              reuse=reuse)
    rt = Runtime(comm, f"allreduce+zero{zero}", sched, [(_everything, sync)],
                 partial(zero_part.Sharded, stage=zero), sync_bn=sync_bn, unused=unused,
                 pipeline=pipeline, tensor_parallel=tensor_parallel, precision=precision)
    rt.checks.append(partial(zero_part.check_setup, zero, sparse_mode=sparse_mode))
    if pipeline is not None:
        pipeline.zero_stage = zero
    _add_checks(rt, tensor_parallel, pipeline)
    rt.zero = zero
    return rt


def ps(comm, unused, accumulate=1, straggler=None, servers=None, mode=None, staleness=None,
       wait=None, staleness_aware_lr=None, epoch_quorum=None, compression=None, ratio=None,
       trace=False, poll_max_ms=None, precision=None, loss_scale=None,
       loss_scale_window=None, group_size=1, algorithm=None, bucket_mb=None, overlap=None,
       deal=None, portion_size=None, compute_pace=None):
    _precision(precision, loss_scale, loss_scale_window,
               ("--strategy ps", "the parameter servers step their own parameters in the "
                "format they receive, with no float32 master weights or loss scaling"))
    size = _size(comm)
    num = pushpull.check_servers(servers, size)
    server_ranks, worker_ranks = list(range(num)), list(range(num, size))
    # worker groups (groups.py): the servers know only each group's first rank
    group_size = groups.check_group_size(group_size, worker_ranks, num)
    pushers = groups.leaders(worker_ranks, group_size)
    if group_size == 1:  # the all-reduce inside a group is the only user of these
        unused = sorted(set(unused) | {k for k, v in (("algorithm", algorithm),
                                                       ("bucket_mb", bucket_mb),
                                                       ("overlap", overlap)) if v is not None})
    try:
        from mpidl.compress import build_compression  # noqa: PLC0415

        compressor = build_compression(compression, ratio)
    except ValueError as e:
        raise ConfigError(f"--compression {compression}: {e}" if compression else str(e)) \
            from None
    pushpull.check_compressor(compressor)
    dealt = dealing_part.check_deal(deal, portion_size, compressor, group_size, accumulate)
    cfg = pushpull.mode_config(len(pushers), mode, staleness, wait, staleness_aware_lr,
                               epoch_quorum, deal=dealt)
    rank = comm.rank
    sched = _schedule(accumulate, straggler, rank, worker_ranks, "worker", compute_pace)
    if dealt:  # every worker holds the global batch; the dealer says which part to do
        sched = dealing_part.DealtPortions(len(worker_ranks), portion_size,
                                           sched.straggler, sched.transient, rank,
                                           compute_pace)
    poll = (1.0 if poll_max_ms is None else poll_max_ms) * 1e-3  # 0: block inside MPI
    roles = {"server": server_ranks, "trainer": worker_ranks}
    if rank in server_ranks:
        from mpidl.runtime.server import ServerRole  # noqa: PLC0415

        server = ServerRole(cfg, server_ranks, pushers, compressor=compressor,
                            trace=bool(trace), poll_max_s=poll, group_size=group_size)
        rt = Runtime(comm, "ps", sched, [], OnServers, role="server", server=server,
                     roles=roles, unused=unused)
    else:
        sync = pushpull.PushPull(cfg, server_ranks, pushers, compressor=compressor,
                                 trace=bool(trace), poll_max_s=poll)
        if dealt:
            sched.dealer = sync
        if group_size > 1:
            sync = groups.WorkerGroups(group_size, sync, fused.FusedAllreduce(
                fused.check_algorithm(algorithm), bucket_mb, overlap or "auto"))
        rt = Runtime(comm, "ps", sched, [(_everything, sync)], OnServers, roles=roles,
                     unused=unused)
    rt.compressor = compressor
    rt.mode_cfg = cfg
    rt.whole_batches = dealt
    if dealt:
        rt.checks.append(lambda model, optimizer: dealing_part.check_model(model))
    rt.checkpoint_at_epoch_end = "ps" in EPOCH_END_CHECKPOINTS
    return rt


def hogwild(comm, unused, accumulate=1, straggler=None, servers=None, locks=False,
            precision=None, loss_scale=None, loss_scale_window=None):
    _precision(precision, loss_scale, loss_scale_window,
               ("--strategy hogwild", "its workers add -lr*g straight to the shared weights, "
                "with no float32 master copy"))
    size = _size(comm)
    num = pushpull.check_servers(servers, size, "hogwild")
    server_ranks, worker_ranks = list(range(num)), list(range(num, size))
    rank = comm.rank
    sched = _schedule(accumulate, straggler, rank, worker_ranks, "worker")
    roles = {"server": server_ranks, "trainer": worker_ranks}
    if rank in server_ranks:
        server = hogwild_part.HogwildServer(server_ranks, worker_ranks, locks=locks)
        rt = Runtime(comm, "hogwild", sched, [], OnServers, role="server", server=server,
                     roles=roles, unused=unused)
    else:
        sync = hogwild_part.HogwildSync(server_ranks, worker_ranks, locks=locks)
        rt = Runtime(comm, "hogwild", sched, [(_everything, sync)], OnServers, roles=roles,
                     unused=unused)
    rt.checkpoint_at_epoch_end = True
    return rt


def _everything(name):
    return True


class _Sparse:
    """Selects parameters with row-sparse gradients (decided at setup from the model)."""

    names = frozenset()

    def bind(self, model):
        self.names = rowsparse.sparse_param_names(model)

    def __call__(self, name):
        return name in self.names


class _NotSparse(_Sparse):
    def __call__(self, name):
        return name not in self.names


_COMMON = _names(schedule_part.OPTIONS) | _names(precision_part.OPTIONS)
_PS_SERVERS = _names(pushpull.OPTIONS)  # (allreduce: the servers of --sparse-sync ps)
_PIPELINE = _names(pipeline_part.OPTIONS)
PRESETS = {
    "local": (local, _COMMON | {"cuda_graph"} | _names(tp_part.OPTIONS) | _PIPELINE),
    "allreduce": (allreduce, _COMMON | _PIPELINE | _names(tp_part.OPTIONS) | _names(fused.OPTIONS) | _names(rowsparse.OPTIONS)
                  | _names(compressed.OPTIONS) | {"sync_bn"} | _names(averaging_part.OPTIONS)
                  | set(AVERAGING_CHECK) | _names(zero_part.OPTIONS)
                  | _names(hybrid_part.OPTIONS) | set(BENCH_TUNING)
                  | _names(parallax.OPTIONS) | _PS_SERVERS),
    "ps": (ps, _COMMON | _names(pushpull.OPTIONS) | _names(compressed.OPTIONS)
           | _names(groups.OPTIONS) | _names(fused.OPTIONS) | set(PS_TUNING)
           | _names(dealing_part.OPTIONS) | set(BENCH_TUNING)),
    "hogwild": (hogwild, _COMMON | {"servers"} | _names(hogwild_part.OPTIONS)),
}

"""``mpidl simulate``: predict a data-parallel run's traffic and time before running it.

It takes ``mpidl train``'s arguments (model, dataset, batch size, ``--algorithm``,
``--bucket-mb``, ``--overlap``, ``--accumulate``, ``--dtype``, ``--sparse-grads`` ...)
and a machine (``--machine FILE``, or the link flags), builds the model, lays out the
step as the runtime would (``mpidl.simulate.step``) and prints, for each rank count of
``--ranks``: the messages and bytes each rank sends per step (exactly what the
communicator's counters will show), the predicted time per step (communication,
compute, overlapped total) and per epoch, and the scaling efficiency.

``mpidl simulate --calibrate --machine FILE`` (under ``mpiexec -n 2`` or more) measures
the machine instead (``mpidl.simulate.calibrate``) and writes FILE for later runs.

Modelled: data parallelism (``--strategy allreduce``) with its fused all-reduce and
row-sparse gathers, ZeRO (``--zero 1|2|3``), model averaging (``--sync
local-sgd|diloco``, the steps after its warm-up), mixed precision's 2-byte buckets
(``--precision bf16|fp16``) and compression (``--compression``, the compressor run on
a real gradient), and ``--sync-bn``; the parameter server (``--strategy ps``,
``--servers``, every ``--mode``, ``--group-size``, ``--compression``: its pushes and
answers, worker groups' all-reduce and broadcast, ``mpidl.simulate.server``);
tensor parallelism with data parallelism (``--tensor-parallel T``,
``mpidl.simulate.tensor``); pipeline parallelism with data parallelism
(``--pipeline-stages P``, every ``--schedule``, with ``--tensor-parallel T`` too: 3-D,
``mpidl.simulate.pipeline``); the
conv-DP/FC-MP hybrid (``--hybrid conv-dp-fc-mp``, ``mpidl.simulate.hybrid``); Parallax
(``--sparse-sync ps``, ``mpidl.simulate.parallax``); Hogwild (``--strategy hogwild``: its
one-sided reads and adds, ``mpidl.simulate.hogwild``). Other
strategies, the parameter server's dealt portions, tensor parallelism with averaging,
mixed precision, compression or ``--sync-bn``, and pipelines with averaging or
compression are refused with one line until they are modelled.
"""

import argparse
import json
import os
import sys

from mpidl.errors import ConfigError, UserError

#: the parallelism settings the cost model follows; any other one set is refused
MODELLED = ("algorithm", "bucket_mb", "overlap", "accumulate", "micro_batches",
            "sparse_grads", "zero", "zero_reuse", "sync", "period", "warmup_steps", "outer_lr",
            "outer_momentum", "precision", "loss_scale", "loss_scale_window",
            "compression", "ratio", "sync_bn", "tensor_parallel", "hybrid")
#: ... and under --strategy hogwild
MODELLED_HOGWILD = ("accumulate", "micro_batches", "servers", "locks")
#: ... and with --sparse-sync ps (Parallax) these too
MODELLED_PARALLAX = ("sparse_sync", "ps_params", "servers", "mode", "staleness", "wait",
                     "staleness_aware_lr", "trace", "poll_max_ms")
#: ... of which --tensor-parallel combines with these only (the rest is refused)
MODELLED_TP = ("algorithm", "bucket_mb", "overlap", "accumulate", "micro_batches",
               "sparse_grads", "tensor_parallel", "zero", "zero_reuse")
#: ... and --pipeline-stages with these only
MODELLED_PP = ("algorithm", "bucket_mb", "overlap", "accumulate", "micro_batches",
               "sparse_grads", "pipeline_stages", "pipeline_schedule", "stage_costs",
               "recompute", "emulate_compute", "zero", "tied_exchange", "sync_bn",
               "precision", "loss_scale", "loss_scale_window")
#: ... and under --strategy ps (the servers' settings; the rest is refused)
MODELLED_PS = ("accumulate", "micro_batches", "servers", "mode", "staleness", "wait",
               "staleness_aware_lr", "epoch_quorum", "trace", "poll_max_ms", "group_size",
               "algorithm", "bucket_mb", "overlap", "compression", "ratio")
MAX_PER_RANK = 1024  # per-rank lists in --json up to this many ranks


def register(subparsers):
    from mpidl.cli import train  # noqa: PLC0415

    holder = argparse.ArgumentParser(add_help=False).add_subparsers()
    base = train.register(holder)  # mpidl train's flags, declared once
    p = subparsers.add_parser(
        "simulate", parents=[base], conflict_handler="resolve",
        help="predict messages, bytes and time per step of a data-parallel, "
        "parameter-server, tensor- or pipeline-parallel run (ZeRO, model averaging, mixed "
        "precision, compression)",
        description="Predict what mpidl train with the same arguments would send and how "
        "long its steps would take on a described machine, for one or many rank counts: "
        "messages and bytes per rank per step (exactly what the communicator's counters "
        "count), time per step (communication, compute, overlapped total) and per epoch, "
        "and the scaling efficiency. With --calibrate (under mpiexec -n 2 or more), "
        "measure this machine's alpha, beta, reduction speed and per-layer compute "
        "instead and write them to --machine FILE. Data parallelism (--strategy "
        "allreduce), with --zero, --sync local-sgd|diloco, --precision, --compression and "
        "--sync-bn; the parameter server (--strategy ps, --servers, --mode); tensor "
        "parallelism (--tensor-parallel) or pipeline parallelism (--pipeline-stages, "
        "--schedule, --micro-batches, --stage-costs) with data parallelism; the "
        "conv-DP/FC-MP hybrid (--hybrid); Parallax (--sparse-sync ps); Hogwild (--strategy "
        "hogwild).",
        epilog="examples:\n"
        "  mpiexec -n 2 mpidl simulate --calibrate --model mlp --machine here.json\n"
        "  mpidl simulate --model mlp --machine here.json --ranks 2 --algorithm ring\n"
        "  mpidl simulate --model cnn --machine bench/machines/gpu-cluster.json "
        "--ranks 1-4096 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("machine and scale (mpidl simulate)")
    g.add_argument("--ranks", default=None, metavar="P|A-B|P,Q",
                   help="rank counts to predict: one (8), the powers of two of a range and "
                   "its end (1-4096), or a list (2,3,4); default: this launch's size, or 2")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="consecutive ranks per node (default: the machine file's, else 1)")
    g.add_argument("--machine", default=None, metavar="FILE.json",
                   help="machine description to read (or, with --calibrate, to write)")
    for key, what in (("alpha-intra", "latency of a message inside a node (s)"),
                      ("beta-intra", "seconds per byte inside a node"),
                      ("alpha-inter", "latency of a message between nodes (s)"),
                      ("beta-inter", "seconds per byte between nodes (8e-9/G for G Gbit/s)"),
                      ("gamma", "seconds per byte of a local reduction")):
        g.add_argument("--" + key, type=float, default=None, metavar="S",
                       help=what + " (overrides the machine file)")
    g.add_argument("--compute-s-per-sample", type=float, default=None, metavar="S",
                   help="forward + backward seconds per sample, spread over the layers by "
                   "parameter count (default: the machine file's measured layers, else 0)")
    g.add_argument("--calibrate", action="store_true",
                   help="measure this machine (under mpiexec -n 2+) and write --machine FILE")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the scaling efficiency over --ranks")
    p.set_defaults(prepare=prepare)
    return p


def _refuse_unmodelled(cfg):
    from mpidl.config import strategy_kwargs  # noqa: PLC0415

    from mpidl.runtime.presets import ALIASES  # noqa: PLC0415

    strategy = ALIASES.get(cfg.strategy, cfg.strategy) or "allreduce"
    if strategy not in ("allreduce", "ps", "hogwild"):
        raise ConfigError(f"mpidl simulate: --strategy {strategy} is not modelled yet "
                          "(modelled: allreduce, ps, hogwild)")
    modelled = {"allreduce": MODELLED, "ps": MODELLED_PS,
                "hogwild": MODELLED_HOGWILD}[strategy]
    if strategy == "allreduce" and getattr(cfg, "sparse_sync", None) == "ps":
        modelled = MODELLED + MODELLED_PARALLAX
    stages, degree = cfg.pipeline_stages or 1, cfg.tensor_parallel or 1
    split = None
    if strategy == "allreduce" and stages > 1:  # (with or without tensor parallelism)
        modelled, split = MODELLED_PP + ("tensor_parallel",), "--pipeline-stages"
    elif strategy == "allreduce" and degree > 1:
        modelled, split = MODELLED_TP, "--tensor-parallel"
    if stages > 1 and degree > 1:  # (mpidl train's words)
        from mpidl.runtime.presets import check_tensor_parallel  # noqa: PLC0415

        check_tensor_parallel(degree, compression=cfg.compression, precision=cfg.precision)
    if stages > 1:
        from mpidl.runtime.zero import check_pipeline  # noqa: PLC0415

        check_pipeline(cfg.zero, stages, cfg.pipeline_schedule,
                       getattr(cfg, "emulate_compute", False),
                       getattr(cfg, "zero_reuse", None))
    for name, value in strategy_kwargs(cfg).items():
        if name == "group_size" and value in (None, 1):
            continue
        if split and name not in modelled and value not in (
                None, False, "none", "allreduce", "fp32", 0):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"mpidl simulate: {flag} {value} with {split} is not modelled "
                              "yet (with data parallelism's buckets: "
                              + ", ".join("--" + m.replace("_", "-") for m in modelled) + ")")
        if name not in modelled and value not in (None, False, "none", "allreduce", "fp32"):
            if strategy == "hogwild":
                raise ConfigError(f"mpidl simulate: --{name.replace('_', '-')} {value} with "
                                  "--strategy hogwild is not modelled yet (its one-sided "
                                  "reads and adds: " + ", ".join(
                                      "--" + m.replace("_", "-") for m in MODELLED_HOGWILD)
                                  + ")")
            if strategy == "ps":
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"mpidl simulate: {flag} {value} with --strategy ps is "
                                  "not modelled yet (the parameter server's pushes and "
                                  "answers: " + ", ".join("--" + m.replace("_", "-")
                                                          for m in MODELLED_PS) + ")")
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"mpidl simulate: {flag} {value} is not modelled yet (data "
                              "parallelism's settings modelled: "
                              f"{', '.join('--' + m.replace('_', '-') for m in modelled)}; "
                              "and --pipeline-stages, --sparse-sync ps)")
    from mpidl.runtime import build  # noqa: PLC0415

    if parallax_on(cfg):  # (its servers: checked for the rank counts, in prepare)
        from mpidl.runtime.sync.parallax import check_composes  # noqa: PLC0415

        check_composes(degree, stages, cfg.zero, cfg.compression, cfg.sync, cfg.precision,
                       cfg.hybrid, cfg.epoch_quorum)
    elif strategy == "allreduce" and degree == 1 and stages == 1:
        # (ps, tensor and pipeline parallelism: checked for the rank counts, in prepare)
        build(strategy, None, **strategy_kwargs(cfg))  # mpidl train's refusals, word for word
    return strategy


def _check_model(cfg, model, optimizer):
    """The runtime's own refusals at set-up, before any prediction: ZeRO's (an optimizer
    that is not elementwise, row-sparse gradients) and mixed precision's (a layer with
    no low-precision path)."""
    from mpidl.runtime import precision, zero  # noqa: PLC0415
    from mpidl.runtime.sync.rowsparse import check_sparse_mode  # noqa: PLC0415

    zero.check_setup(zero.check_stage(cfg.zero or 0), model, optimizer,
                     check_sparse_mode(cfg.sparse_grads))
    precision.check_model(model, cfg.precision)
    precision.check_sparse_exchange(model, cfg.precision, check_sparse_mode(cfg.sparse_grads))
    from mpidl.runtime.presets import ALIASES  # noqa: PLC0415

    if ALIASES.get(cfg.strategy, cfg.strategy) == "hogwild":  # (plain SGD only)
        from mpidl.runtime.hogwild import check_optimizer  # noqa: PLC0415

        check_optimizer(optimizer)


def machine_of(args):
    from mpidl.simulate import machine as machines  # noqa: PLC0415

    m = machines.load(args.machine) if args.machine else machines.Machine()
    for key in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma"):
        value = getattr(args, key)
        if value is not None:
            if not 0 <= value < float("inf"):
                raise ConfigError(f"--{key.replace('_', '-')} must be a number >= 0, got "
                                  f"{value}")
            if key != "gamma":
                _shift_curve(m, key, value)
            setattr(m, key, value)
    if args.ranks_per_node is not None:
        if args.ranks_per_node < 1:
            raise ConfigError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
        m.ranks_per_node = args.ranks_per_node
    return m


def _shift_curve(m, key, value):
    """A link's measured curve (a calibrated machine's) follows an override of its alpha
    or beta, keeping its measured shape (bursts, protocol switches): a new alpha moves
    every time by the change; a new beta scales what each size takes beyond the smallest
    message by the ratio of the rates."""
    kind, where = key.split("_")
    curve = ((m.info or {}).get("points") or {}).get(where)
    if not curve:
        return
    old, times = getattr(m, key), curve["seconds"]
    if kind == "alpha":
        moved = [t + value - old for t in times]
    elif old > 0:
        moved = [times[0] + (t - times[0]) * value / old for t in times]
    else:
        moved = [t + value * b for b, t in zip(curve["bytes"], times)]
    curve["seconds"] = [max(t, 0.0) for t in moved]


def prepare(args, world):
    """Phase 1: resolve and check everything (one clear line on a mistake)."""
    from mpidl.cli.train import (build_model_and_optimizer, dataset_options,  # noqa: PLC0415
                                 given_flags, planned_steps)
    from mpidl.config import resolve  # noqa: PLC0415
    from mpidl.data import load_dataset  # noqa: PLC0415
    from mpidl.simulate.step import parse_ranks  # noqa: PLC0415

    from mpidl.runtime.sync.fused import check_algorithm  # noqa: PLC0415

    cfg = resolve(given_flags(args), args.config)
    strategy = _refuse_unmodelled(cfg)
    check_algorithm(cfg.algorithm)
    from mpidl.simulate.collectives import ALGORITHMS  # noqa: PLC0415

    if cfg.algorithm not in (None, "auto") + ALGORITHMS:
        raise ConfigError(f"mpidl simulate: --algorithm {cfg.algorithm} is not modelled yet "
                          f"(modelled: auto, {', '.join(ALGORITHMS)})")
    if args.calibrate:
        if not args.machine:
            raise ConfigError("--calibrate writes the measurements to --machine FILE: give "
                              "one")
        if world.size < 2:
            raise ConfigError("--calibrate measures messages between ranks: run it under "
                              "mpiexec -n 2 (or more) mpidl simulate --calibrate ...")
        folder = os.path.dirname(os.path.abspath(args.machine))
        if not os.path.isdir(folder):
            raise ConfigError(f"--machine {args.machine}: the folder {folder} does not exist")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot}: give a .png file name")
    try:
        ranks = parse_ranks(args.ranks if args.ranks is not None else max(world.size, 2))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if max(ranks) > 1 << 20:
        raise ConfigError(f"--ranks: at most {1 << 20} ranks, got {max(ranks)}")
    degree = cfg.tensor_parallel or 1
    if degree > 1:  # (rank counts it does not divide are left out)
        from mpidl.runtime.tensor_parallel import check_degree  # noqa: PLC0415

        check_degree(degree, degree)
        if not any(p % degree == 0 for p in ranks):
            raise ConfigError(f"--ranks {args.ranks}: --tensor-parallel {degree} divides none "
                              "of these rank counts; give multiples of it")
        ranks = [p for p in ranks if p % degree == 0]
    stages = cfg.pipeline_stages or 1
    if stages > 1:  # (rank counts it does not divide are left out)
        width = stages * degree
        what = f"--pipeline-stages {stages}" + (f" x --tensor-parallel {degree}"
                                                if degree > 1 else "")
        if not any(p % width == 0 for p in ranks):
            raise ConfigError(f"--ranks {args.ranks}: {what} divides none of these rank "
                              "counts; give multiples of it")
        ranks = [p for p in ranks if p % width == 0]
    if strategy in ("ps", "hogwild") or parallax_on(cfg):  # (ranks without a worker: out)
        from mpidl.runtime.sync.pushpull import check_servers, mode_config  # noqa: PLC0415

        servers = check_servers(cfg.servers, 1 << 30)
        if max(ranks) <= servers:
            raise ConfigError(f"--ranks {args.ranks}: --strategy ps with --servers {servers} "
                              f"needs at least {servers + 1} ranks (the servers and a worker)")
        ranks = [p for p in ranks if p > servers]
        size = cfg.group_size or 1
        if size > 1:  # (worker groups: rank counts whose workers they do not divide too)
            from mpidl.runtime.sync.groups import check_group_size  # noqa: PLC0415

            fits = [p for p in ranks if (p - servers) % size == 0]
            if not fits:
                check_group_size(size, list(range(servers, ranks[0])), servers)
            ranks = fits
        if strategy != "hogwild":
            mode_config((min(ranks) - servers) // size, cfg.mode, cfg.staleness, cfg.wait,
                        cfg.staleness_aware_lr, cfg.epoch_quorum)  # (the servers see groups)
        if strategy == "ps" and cfg.compression not in (None, "none"):
            if size > 1:
                raise ConfigError(f"mpidl simulate: --compression {cfg.compression} with "
                                  f"--group-size {size} is not modelled yet (each alone is)")
            from mpidl.compress import build_compression  # noqa: PLC0415
            from mpidl.runtime.sync.pushpull import check_compressor  # noqa: PLC0415

            try:
                compressor = build_compression(cfg.compression, cfg.ratio)
            except ValueError as e:
                raise ConfigError(f"--compression {cfg.compression}: {e}") from None
            check_compressor(compressor)
    machine = machine_of(args) if not args.calibrate else None
    if args.compute_s_per_sample is not None and not 0 <= args.compute_s_per_sample < \
            float("inf"):
        raise ConfigError(f"--compute-s-per-sample must be a number >= 0, got "
                          f"{args.compute_s_per_sample}")
    dataset = load_dataset(cfg.dataset, cfg.data_dir, cfg.limit_train, cfg.limit_test,
                           **dataset_options(cfg))
    model, optimizer = build_model_and_optimizer(
        cfg, dataset, steps=planned_steps(cfg, dataset, max(ranks)))
    _check_model(cfg, model, optimizer)
    if degree > 1:  # the runtime's refusals at set-up (heads, widths narrower than T)
        from mpidl.runtime.tensor_parallel import TensorParallel  # noqa: PLC0415

        TensorParallel(degree).check(model)
    if stages > 1:  # ... and the pipeline's (the schedule, too few layers, tied weights)
        pipeline_of(cfg).check(model)
    if parallax_on(cfg):  # ... and Parallax's (no parameter, or every one, to serve)
        from mpidl.runtime.sync.parallax import Split, parse_patterns  # noqa: PLC0415

        Split(parse_patterns(cfg.ps_params)).check(model)
    if cfg.hybrid:  # ... and the hybrid's (no conv->FC boundary, FC narrower than p)
        from mpidl.runtime.hybrid import Hybrid  # noqa: PLC0415

        for p in ranks:
            if p > 1:
                Hybrid(p).check(model)

    if args.calibrate:
        return lambda: calibrate_job(args, cfg, world, model, optimizer, dataset)
    lr = getattr(optimizer, "lr", None)

    def make_model():  # (tensor parallelism cuts fresh models)
        return build_model_and_optimizer(cfg, dataset,
                                         steps=planned_steps(cfg, dataset, max(ranks)))[0]

    return lambda: predict_job(args, cfg, world, model, dataset, machine, ranks, lr,
                               make_model)


def _overlap(cfg):
    """``--overlap auto`` is on where it pays: on a GPU (a spare core per rank is not
    known here: a CPU run is taken to compute on every core, so off)."""
    from mpidl.runtime.sync.fused import check_overlap  # noqa: PLC0415

    mode = check_overlap(cfg.overlap)
    if mode == "auto":
        return cfg.device == "gpu"
    return mode == "on"


def draw_batch(dataset, rng, batch, dtype):
    """``(x, indices)``: ``batch`` random training samples (without replacement), ``x``
    on the device in the input dtype of a model of ``dtype``."""
    from mpidl.backend import to_device  # noqa: PLC0415
    from mpidl.data.loader import input_dtype  # noqa: PLC0415

    n = len(dataset.train_y)
    idx = rng.choice(n, size=min(batch, n), replace=False)
    x = dataset.train_x[idx]
    return to_device(x, dtype=input_dtype(x, dtype)), idx


def _param_dtype(model):
    return str(model.named_parameters()[0][1].data.dtype)


def estimate_rows(model, sparse, dataset, batch, seed, samples=4):
    """Rows each rank's batch touches, per row-sparse parameter: the mean over a few
    random batches of the training set (data-dependent: an estimate)."""
    import numpy as np  # noqa: PLC0415

    from mpidl.simulate.step import touched_rows  # noqa: PLC0415

    if not sparse:
        return {}
    rng = np.random.default_rng(seed)
    seen = {name: [] for name in sparse}
    for _ in range(samples):
        x, _ = draw_batch(dataset, rng, batch, _param_dtype(model))
        for name, rows in touched_rows(model, sparse, x).items():
            seen[name].append(rows)
    return {name: int(round(sum(v) / len(v))) for name, v in seen.items()}


def compute_of(args, cfg, model, machine):
    from mpidl.simulate.step import Compute, compute_from_pace  # noqa: PLC0415

    measured = machine.model_compute(cfg.model)
    if args.compute_s_per_sample is not None:  # (the update: measured, if it was)
        return compute_from_pace(model, args.compute_s_per_sample,
                                 float((measured or {}).get("update_s", 0.0)))
    if measured:
        keys = [k for k, _ in model.children()]
        if sorted(measured["layers"]) != sorted(keys):
            raise ConfigError(f"--machine {args.machine}: the compute measured for "
                              f"{cfg.model!r} has layers {sorted(measured['layers'])}, this "
                              f"model has {keys} (other model options?): calibrate again")
        layers = {k: tuple(measured["layers"][k]) for k in keys}
        return Compute(layers, float(measured.get("update_s", 0.0)),
                       f"measured at batch {measured.get('batch_size')} "
                       f"({measured.get('dtype', '?')}, {measured.get('device', 'cpu')})",
                       cv=machine.compute_cv, on_cores=measured.get("device", "cpu") == "cpu")
    return Compute({k: (0.0, 0.0) for k, _ in model.children()}, 0.0,
                   "none given: communication only")


def predict(args, cfg, model, dataset, machine, ranks, lr=None, make_model=None):
    """The prediction as a dict (what --json prints). ``lr``: the optimizer's (the
    parameter server's pushes carry it); ``make_model``: builds the model afresh (tensor
    parallelism cuts one per tp rank)."""
    from mpidl.data.loader import BatchLoader  # noqa: PLC0415
    from mpidl.runtime.sync.fused import check_bucket_mb  # noqa: PLC0415
    from mpidl.runtime.sync.rowsparse import check_sparse_mode, sparse_param_names  # noqa
    from mpidl.runtime.presets import ALIASES  # noqa: PLC0415
    from mpidl.simulate import collectives as col  # noqa: PLC0415
    from mpidl.simulate import hogwild, hybrid, parallax, pipeline, server  # noqa: PLC0415
    from mpidl.simulate import step as st  # noqa: PLC0415
    from mpidl.simulate import tensor  # noqa: PLC0415

    strategy = ALIASES.get(cfg.strategy, cfg.strategy) or "allreduce"
    accumulate = max(getattr(cfg, "accumulate", 1) or 1, getattr(cfg, "micro_batches", 1) or 1)
    bucket_mb = check_bucket_mb(cfg.bucket_mb)
    algorithm = cfg.algorithm or "auto"
    sparse = sorted(sparse_param_names(model)) \
        if check_sparse_mode(cfg.sparse_grads) == "allgather" else []
    rows = estimate_rows(model, sparse, dataset, cfg.batch_size * accumulate, cfg.seed)
    compute = compute_of(args, cfg, model, machine)
    overlap = _overlap(cfg)
    seg = st.segment_bytes()
    named = model.named_parameters()
    per_node = machine.ranks_per_node
    grads = sample_grads(model, dataset, cfg.batch_size * accumulate, cfg.seed) \
        if cfg.compression not in (None, "none") else None
    shape = layout_options(cfg, model, accumulate, grads)
    pushes = server_pushes(cfg, model, dataset, accumulate, lr)
    degree = cfg.tensor_parallel or 1
    stages = cfg.pipeline_stages or 1
    pieces = tensor_pieces(cfg, model, dataset, degree, make_model) \
        if degree > 1 and stages == 1 else None
    base = None
    out = []
    for p in sorted(set(ranks) | {1}):
        topo = col.Topology(p, min(per_node, p))
        watch = None if p <= MAX_PER_RANK else [0, p - 1]  # the ranks whose traffic is counted
        links = col.Links(machine, topo)
        if pieces is not None and p > 1:
            lay = tensor.layout(*pieces, p, algorithm, bucket_mb, accumulate,
                                sparse=bool(sparse), zero=int(cfg.zero or 0),
                                zero_keep=shape.get("zero_keep", ()),
                                clip=shape.get("clip", 0))
            t = tensor.step_time(lay, compute, cfg.batch_size, accumulate, machine, per_node,
                                 overlap, seg)
            counted = tensor.traffic(lay, per_node, ranks=watch, seg_bytes=seg)
        elif parallax_on(cfg) and p > 1:
            lay = parallax_step(cfg, model, dataset, p, algorithm, bucket_mb, accumulate, lr,
                                sparse, rows)
            t = parallax.step_time(lay, compute, cfg.batch_size, accumulate, machine,
                                   per_node, overlap, seg)
            counted = parallax.traffic(lay, per_node, ranks=watch, seg_bytes=seg)
        elif cfg.hybrid and p > 1:
            lay = hybrid_step(cfg, dataset, p, algorithm, bucket_mb, accumulate, make_model)
            t = hybrid.step_time(lay, compute, cfg.batch_size, accumulate, links, overlap, seg)
            counted = hybrid.traffic(lay, per_node, ranks=watch, seg_bytes=seg)
        elif stages > 1 and p > 1:
            lay = pipeline_step(cfg, model, dataset, compute, p, algorithm, bucket_mb,
                                sparse, rows, make_model)
            t = pipeline.step_time(lay, compute, cfg.batch_size, machine, per_node,
                                   recompute=bool(cfg.recompute), seg_bytes=seg)
            counted = pipeline.traffic(lay, per_node, ranks=watch, seg_bytes=seg)
        elif strategy == "hogwild" and p > 1:
            lay = hogwild.layout(named, p, int(cfg.servers or 1))
            t = hogwild.step_time(lay, compute, cfg.batch_size, accumulate, links,
                                  locks=bool(cfg.locks))
            counted = hogwild.traffic(lay, ranks=watch)
        elif pushes is not None and p > 1 and (cfg.group_size or 1) > 1:
            lay = server.grouped_layout(named, p, int(cfg.servers or 1), cfg.group_size,
                                        pushes, algorithm, bucket_mb)
            t = server.grouped_step_time(lay, compute, cfg.batch_size, accumulate, machine,
                                         per_node, overlap, seg)
            counted = server.grouped_traffic(lay, per_node, ranks=watch, seg_bytes=seg)
        elif pushes is not None and p > 1:
            lay, _ = server.layout(named, p, int(cfg.servers or 1), pushes)
            t = server.step_time(lay, compute, cfg.batch_size, accumulate, links)
            counted = server.traffic(lay, ranks=watch)
        else:
            lay = st.layout(named, p, algorithm, bucket_mb, sparse,
                            {n: [r] * p for n, r in rows.items()}, **shape)
            t = st.step_time(lay, compute, cfg.batch_size, accumulate, links, overlap, seg)
            counted = st.traffic(lay, topo.per_node, ranks=watch, seg_bytes=seg)
        if p == 1:
            base = t["total"]
            if 1 not in ranks:
                continue
        msgs = [c["total"]["messages"] for c in counted.values()]
        nbytes = [c["total"]["bytes"] for c in counted.values()]
        shards = (p - lay.servers) // (degree * stages if p > 1 else 1)  # (data shares)
        steps = BatchLoader(dataset.train_x, dataset.train_y, cfg.batch_size * accumulate,
                            shard=(0, shards), drop_last=cfg.drop_last).steps_per_epoch
        every = lay.every
        row = {"ranks": p, "nodes": topo.nodes,
               "calls": [{"kind": c.kind, "name": c.name, "algorithm": c.algorithm,
                          "bytes": c.nbytes(), "phase": c.phase} for c in lay.calls],
               "steps_per_layout": every,
               "messages_per_step": sum(msgs) / len(msgs) / every,
               "bytes_per_step": sum(nbytes) / len(nbytes) / every,
               "time_s": t, "step_s": t["total"], "steps_per_epoch": steps,
               "epoch_s": steps * t["total"],
               "efficiency": st.efficiency(base, t["total"]) * shards / p if base else None}
        if pieces is not None and p > 1:
            row["tp_calls"] = [{"kind": c.kind, "name": c.name, "algorithm": c.algorithm,
                                "bytes": c.nbytes(), "phase": c.phase}
                               for c in lay.pieces[0].calls]
        if stages > 1 and p > 1:
            row["pipeline"] = {"bounds": lay.bounds, "cost": lay.cost_source,
                               "bubble": t["bubble"],
                               "stage_messages": [sum(1 for m in lay.messages[0]
                                                      if m.src == s)
                                                  for s in range(stages)],
                               "boundary_bytes": lay.boundary_bytes[0]}
        if p <= MAX_PER_RANK:
            row["per_rank"] = {"messages": msgs, "bytes": nbytes}
            row["counters"] = counted[0]
        else:  # the mean above is rank 0's and the last rank's (the rest not counted)
            row["per_rank_note"] = f"over {p} ranks: mean of ranks 0 and {p - 1}"
        out.append(row)
    below = next((r["ranks"] for r in out if r["efficiency"] is not None
                  and r["efficiency"] < 0.5), None)
    result = {"model": cfg.model, "dataset": dataset.name, "batch_size": cfg.batch_size,
            "accumulate": accumulate, "dtype": cfg.dtype, "algorithm": algorithm,
            "layout": describe_layout(cfg),
            "bucket_mb": bucket_mb, "overlap": "on" if overlap else "off",
            "sparse_grads": sparse, "rows_per_rank": rows, "segment_bytes": seg,
            "compute": compute.source, "machine": {k: v for k, v in machine.to_dict().items()
                                                   if k != "compute"},
            "predictions": out, "efficiency_below_50pct_at": below}
    if len(out) == 1:  # one rank count: its figures at the top level too
        result.update({k: out[0][k] for k in ("ranks", "messages_per_step", "bytes_per_step",
                                              "step_s", "epoch_s", "efficiency")
                       if k in out[0]})
    return result


def layout_options(cfg, model, accumulate, grads=None):
    """``mpidl.simulate.step.layout``'s settings for ``--zero``, ``--sync``,
    ``--precision``, ``--compression`` (``grads``: ``sample_grads``) and ``--sync-bn``."""
    from mpidl.runtime.precision import Wire  # noqa: PLC0415
    from mpidl.runtime.sync.fused import check_overlap  # noqa: PLC0415

    out = {}
    if getattr(cfg, "sync_bn", False):
        from mpidl.simulate.step import sync_bn_layers  # noqa: PLC0415

        out.update(sync_bn=sync_bn_layers(model), micro=accumulate)
    if cfg.compression not in (None, "none"):
        from mpidl.compress import build_compression  # noqa: PLC0415

        tensorwise = build_compression(cfg.compression, cfg.ratio).granularity == "tensor"
        # (the per-tensor exchange overlaps backward only when asked: --overlap on)
        out["compression"] = {"spec": cfg.compression, "ratio": cfg.ratio, "grads": grads,
                              "overlap": check_overlap(cfg.overlap) == "on"
                              if tensorwise else True, "on_gpu": cfg.device == "gpu",
                              "momentum": cfg.momentum if cfg.optimizer == "sgd" else 0.0}
    if cfg.zero:
        out.update(zero=int(cfg.zero), micro=accumulate)
        if int(cfg.zero) == 3 and getattr(cfg, "zero_reuse", None) == "on":
            from mpidl.runtime.zero import boundary_params  # noqa: PLC0415

            out["zero_keep"] = boundary_params(model)
    if (cfg.sync or "allreduce") != "allreduce":
        out["period"] = int(cfg.period)
    if (cfg.precision or "fp32") != "fp32":
        out["wire"] = Wire(cfg.precision).dtype
    clip = clip_count(cfg, model)
    if clip:
        out["clip"] = clip
    return out


def clip_count(cfg, model):
    """``--clip-grad-norm``: the elements its norm counts (the whole model's, each once);
    0 without it."""
    if getattr(cfg, "clip_grad_norm", None) is None:
        return 0
    return sum(q.data.size for _, q in model.named_parameters())


def pipeline_of(cfg):
    """The runtime's ``Pipeline`` for the run's pipeline flags (its plan built: one line
    for a schedule that cannot run)."""
    from mpidl.runtime.pipeline import Pipeline  # noqa: PLC0415

    micro = max(getattr(cfg, "accumulate", 1) or 1, cfg.micro_batches or 1)
    pp = Pipeline(cfg.pipeline_stages, cfg.pipeline_schedule or "1f1b", micro,
                  stage_costs=cfg.stage_costs,
                  tied_exchange=getattr(cfg, "tied_exchange", None) or "micro-batch")
    pp.zero_stage = cfg.zero or 0
    return pp


def pipeline_step(cfg, model, dataset, compute, p, algorithm, bucket_mb, sparse, rows,
                  make_model):
    """``--pipeline-stages P``: ``mpidl.simulate.pipeline.layout`` for ``p`` ranks, cut by
    the costs the run would balance (``pipeline.stage_costs``: the machine's measured
    compute per layer by default) and messages of a training micro-batch's shape; with
    ``--tensor-parallel T`` each tp rank's piece cut chunk by chunk (its row-sparse rows
    those of a step's batch, in its slice)."""
    import numpy as np  # noqa: PLC0415

    from mpidl.backend import to_device  # noqa: PLC0415
    from mpidl.simulate import pipeline, tensor  # noqa: PLC0415
    from mpidl.training.tasks import task_for  # noqa: PLC0415

    plan = pipeline_of(cfg).plan
    measured = [f + b for f, b in compute.layers.values()]
    costs, source = pipeline.stage_costs(cfg.stage_costs, len(model.layers),
                                         measured if any(measured) else None)
    rng = np.random.default_rng(cfg.seed)
    x, idx = draw_batch(dataset, rng, cfg.batch_size, _param_dtype(model))
    T = cfg.tensor_parallel or 1
    d = p // (plan.P * T)
    zero = int(cfg.zero or 0)
    per_step = getattr(cfg, "tied_exchange", None) == "step"
    sync_bn = bool(getattr(cfg, "sync_bn", False))
    wire = None
    if (cfg.precision or "fp32") != "fp32":
        from mpidl.runtime.precision import Wire  # noqa: PLC0415

        wire = Wire(cfg.precision).dtype
    if T == 1:
        return pipeline.layout(model, p, plan, costs, x, algorithm, bucket_mb, sparse,
                               {0: {n: [r] * d for n, r in rows.items()}},
                               cost_source=source, zero=zero, recompute=bool(cfg.recompute),
                               tied_per_step=per_step, sync_bn=sync_bn, wire=wire,
                               clip=clip_count(cfg, model))
    loss = task_for(dataset).loss
    y = to_device(dataset.train_y[idx])
    xs, ids = draw_batch(dataset, rng, cfg.batch_size * plan.M, _param_dtype(model))
    ys = to_device(dataset.train_y[ids])
    tp_rows = {j: {n: [r] * d for n, r in tensor.cut(make_model, T, j, xs, ys, loss).rows
                   .items()} for j in range(T)} if sparse else {j: {} for j in range(T)}
    names = sorted({n for r in tp_rows.values() for n in r})
    return pipeline.layout(model, p, plan, costs, x, algorithm, bucket_mb, names, tp_rows,
                           cost_source=source, zero=zero, recompute=bool(cfg.recompute),
                           tied_per_step=per_step, sync_bn=sync_bn, clip=clip_count(cfg, model),
                           pieces=lambda bounds: tensor.pieces_of(make_model, T, (x, y), loss,
                                                                  chunks=bounds)[0])


def parallax_on(cfg):
    return getattr(cfg, "sparse_sync", None) == "ps"


def parallax_step(cfg, model, dataset, p, algorithm, bucket_mb, accumulate, lr, sparse, rows):
    """``--sparse-sync ps``: ``mpidl.simulate.parallax.layout`` for ``p`` ranks: the
    remote parameters as ``Split`` chooses them, pushed as one batch of the training set
    leaves their gradients (row-sparse ones coalesced, the same on every trainer: an
    estimate, as the row gathers'); row-sparse ones left on the trainers gathered."""
    from mpidl.runtime.sync.parallax import Split, parse_patterns  # noqa: PLC0415
    from mpidl.runtime.sync.rowsparse import as_rows  # noqa: PLC0415
    from mpidl.simulate import parallax, server  # noqa: PLC0415

    split = Split(parse_patterns(cfg.ps_params))
    split.bind(model)
    grads = sample_grads(model, dataset, cfg.batch_size * accumulate, cfg.seed, dense=False)
    named = dict(model.named_parameters())
    mine = {}
    for name in split.remote:
        mine[name] = grads[name]
        if name in split.rows:  # (the arrays as_rows makes of this gradient)
            q = named[name]
            q.grad = grads[name]
            mine[name] = as_rows(q)
            q.grad = None
    pushes = server.Pushes(server.pushed_arrays(mine), lr=lr, step=1,
                           mode=cfg.mode or "sync", wait=int(cfg.wait or 0))
    trainers = p - int(cfg.servers or 1)
    kept = {n: [rows[n]] * trainers for n in sparse if n not in split.remote}
    return parallax.layout(model.named_parameters(), p, int(cfg.servers or 1), pushes,
                           split.remote, algorithm, bucket_mb, kept)


def hybrid_step(cfg, dataset, p, algorithm, bucket_mb, accumulate, make_model):
    """``--hybrid conv-dp-fc-mp``: ``mpidl.simulate.hybrid.layout`` for ``p`` ranks, each
    with a micro-batch of the training set's shape."""
    import numpy as np  # noqa: PLC0415

    from mpidl.backend import to_device  # noqa: PLC0415
    from mpidl.simulate import hybrid  # noqa: PLC0415
    from mpidl.training.tasks import task_for  # noqa: PLC0415

    model = make_model()
    x, idx = draw_batch(dataset, np.random.default_rng(cfg.seed), cfg.batch_size,
                        _param_dtype(model))
    return hybrid.layout(make_model, p, x, to_device(dataset.train_y[idx]),
                         task_for(dataset).loss, algorithm, bucket_mb, accumulate,
                         sync_bn=bool(getattr(cfg, "sync_bn", False)),
                         clip=clip_count(cfg, model))


def tensor_pieces(cfg, model, dataset, degree, make_model):
    """``--tensor-parallel T``: ``mpidl.simulate.tensor.pieces_of`` for a micro-batch of the
    training set (its shape sets the all-reduces; its ids, the rows)."""
    import numpy as np  # noqa: PLC0415

    from mpidl.backend import to_device  # noqa: PLC0415
    from mpidl.simulate import tensor  # noqa: PLC0415
    from mpidl.training.tasks import task_for  # noqa: PLC0415

    x, idx = draw_batch(dataset, np.random.default_rng(cfg.seed), cfg.batch_size,
                        _param_dtype(model))
    return tensor.pieces_of(make_model, degree, (x, to_device(dataset.train_y[idx])),
                            task_for(dataset).loss)


def server_pushes(cfg, model, dataset, accumulate, lr):
    """``--strategy ps``: what a worker's push holds (``mpidl.simulate.server.Pushes``:
    the gradient arrays of one batch, row-sparse ones as the engine leaves them; a
    worker group's leader pushes its group's mean, every gradient dense), else None."""
    from mpidl.runtime.presets import ALIASES  # noqa: PLC0415

    if ALIASES.get(cfg.strategy, cfg.strategy) != "ps":
        return None
    from mpidl.simulate import server  # noqa: PLC0415

    grads = sample_grads(model, dataset, cfg.batch_size * accumulate, cfg.seed,
                         dense=(cfg.group_size or 1) > 1)
    if cfg.compression not in (None, "none"):  # (compressed by worker 0's compressor)
        from mpidl.simulate.compression import pushed  # noqa: PLC0415

        arrays = pushed(cfg.compression, cfg.ratio, grads)
    else:
        arrays = server.pushed_arrays(grads)
    return server.Pushes(arrays, lr=lr, step=1, mode=cfg.mode or "sync",
                         wait=int(cfg.wait or 0))


def sample_grads(model, dataset, batch, seed, dense=True):
    """Every parameter's gradient (dense, host; ``dense=False``: as the engine leaves
    them) for one batch of the training set under the dataset's own loss: what a
    compressor is given to compress, what a parameter server's worker pushes."""
    import numpy as np  # noqa: PLC0415

    from mpidl.backend import to_device, to_numpy  # noqa: PLC0415
    from mpidl.engine.module import SparseGrad  # noqa: PLC0415
    from mpidl.training.tasks import task_for  # noqa: PLC0415

    x, idx = draw_batch(dataset, np.random.default_rng(seed), batch, _param_dtype(model))
    loss = task_for(dataset).loss
    model.zero_grad()
    loss.forward(model(x), to_device(dataset.train_y[idx]))
    model.backward(loss.backward())
    out = {}
    for name, q in model.named_parameters():
        g = q.grad
        if not dense:
            out[name] = g
            continue
        if isinstance(g, SparseGrad):
            g = g.to_dense()
        out[name] = to_numpy(g) if g is not None else np.zeros(q.data.shape, q.data.dtype)
    model.zero_grad()
    return out


def describe_layout(cfg):
    from mpidl.runtime.presets import ALIASES  # noqa: PLC0415

    zero = f" (ZeRO stage {cfg.zero})" if cfg.zero else ""
    if (cfg.pipeline_stages or 1) > 1:
        M = max(getattr(cfg, "accumulate", 1) or 1, cfg.micro_batches or 1)
        tp = (f" x tensor parallelism {cfg.tensor_parallel}"
              if (cfg.tensor_parallel or 1) > 1 else "")
        return (f"pipeline {cfg.pipeline_stages} stages ({cfg.pipeline_schedule or '1f1b'}, "
                f"{M} micro-batches{', recomputing' if cfg.recompute else ''}){tp} x data "
                f"parallelism{zero}")
    if (cfg.tensor_parallel or 1) > 1:
        return f"tensor parallelism {cfg.tensor_parallel} x data parallelism{zero}"
    if cfg.hybrid:
        return ("hybrid conv-dp-fc-mp" + (", synchronized BatchNorm"
                                          if getattr(cfg, "sync_bn", False) else ""))
    if ALIASES.get(cfg.strategy, cfg.strategy) == "hogwild":
        return (f"hogwild ({cfg.servers or 1} server(s), "
                + ("exclusive locks" if cfg.locks else "lock-free") + ")")
    if ALIASES.get(cfg.strategy, cfg.strategy) == "ps":
        groups = (f", worker groups of {cfg.group_size}" if (cfg.group_size or 1) > 1
                  else "") + (f", compression {cfg.compression}"
                              if cfg.compression not in (None, "none") else "")
        return (f"parameter server ({cfg.mode or 'sync'}, {cfg.servers or 1} server(s)"
                f"{groups}; headers as at step 1)")
    if parallax_on(cfg):
        return (f"Parallax ({cfg.servers or 1} server(s) hold "
                + (cfg.ps_params or "the row-sparse parameters")
                + f", {cfg.mode or 'sync'}; the rest all-reduced among the trainers)")
    parts = []
    if cfg.compression not in (None, "none"):
        parts.append(f"compression {cfg.compression}"
                     + (f" ratio {cfg.ratio:g}" if cfg.ratio else ""))
    if cfg.zero:
        parts.append(f"ZeRO stage {cfg.zero}")
    if (cfg.sync or "allreduce") != "allreduce":
        warm = f" (after {cfg.warmup_steps} all-reduce steps)" if cfg.warmup_steps else ""
        parts.append(f"{cfg.sync} every {cfg.period} steps{warm}")
    if (cfg.precision or "fp32") != "fp32":
        parts.append(f"{cfg.precision} gradients")
    if getattr(cfg, "sync_bn", False):
        parts.append("synchronized BatchNorm")
    return ", ".join(parts) or "data parallelism"


def _table(result):
    collectives = "" if result["layout"].startswith(("parameter server", "hogwild")) else (
        f", algorithm {result['algorithm']}, buckets of {result['bucket_mb']:g} MiB, overlap "
        f"{result['overlap']}")
    lines = [f"mpidl simulate: {result['model']} on {result['dataset']}, batch "
             f"{result['batch_size']}/rank x accumulate {result['accumulate']}, "
             f"{result['dtype']}, {result['layout']}{collectives}; machine "
             f"{result['machine']['name']} ({result['machine']['ranks_per_node']} ranks/node); "
             f"compute {result['compute']}",
             f"{'ranks':>6} {'nodes':>5} {'msgs/rank':>10} {'bytes/rank':>12} "
             f"{'comm ms':>9} {'compute ms':>10} {'step ms':>9} {'epoch s':>9} "
             f"{'efficiency':>10}"]
    for r in result["predictions"]:
        t = r["time_s"]
        lines.append(f"{r['ranks']:>6} {r['nodes']:>5} {r['messages_per_step']:>10.1f} "
                     f"{r['bytes_per_step']:>12.0f} {1e3 * t['comm']:>9.3f} "
                     f"{1e3 * (t['forward'] + t['backward'] + t['update']):>10.3f} "
                     f"{1e3 * r['step_s']:>9.3f} {r['epoch_s']:>9.2f} "
                     + (f"{100 * r['efficiency']:>9.1f}%" if r["efficiency"] is not None
                        else f"{'-':>10}"))
    below = result["efficiency_below_50pct_at"]
    if result["predictions"][0]["efficiency"] is None:
        lines.append("efficiency: no compute described (--machine with measured compute, "
                     "or --compute-s-per-sample)")
    else:
        lines.append("efficiency falls below 50% at " + (f"{below} ranks" if below else
                                                         "none of these rank counts"))
    return "\n".join(lines)


def plot(result, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    xs = [r["ranks"] for r in result["predictions"]]
    ys = [100 * (r["efficiency"] or 0) for r in result["predictions"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    ax.axhline(50, color="grey", ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted scaling efficiency (%)")
    ax.set_title(f"{result['model']}, {result['algorithm']}, {result['machine']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def predict_job(args, cfg, world, model, dataset, machine, ranks, lr=None, make_model=None):
    result = predict(args, cfg, model, dataset, machine, ranks, lr, make_model)
    if world.rank == 0:
        if args.plot:
            plot(result, args.plot)
        print(json.dumps(result) if args.json else _table(result), flush=True)
    return 0


def calibrate_job(args, cfg, world, model, optimizer, dataset):
    """Collective: every rank measures; rank 0 writes and prints."""
    import numpy as np  # noqa: PLC0415

    from mpidl.comm.hierarchical import node_layout  # noqa: PLC0415
    from mpidl.simulate import calibrate as cal  # noqa: PLC0415
    from mpidl.simulate import machine as machines  # noqa: PLC0415
    from mpidl.threads import usable_cpus  # noqa: PLC0415

    comm = world.mpi
    nodes = node_layout(comm)
    links = cal.measure_links(comm, nodes)
    gamma = comm.allreduce(cal.measure_gamma()) / world.size
    x, _ = draw_batch(dataset, np.random.default_rng(cfg.seed + world.rank),
                      cfg.batch_size, cfg.dtype)
    comm.Barrier()
    layers, update, cv = cal.measure_compute(model, optimizer, x)
    everyone = comm.gather((layers, update, cv), root=0)
    if world.rank != 0:
        return 0
    mean = {k: [float(np.mean([e[0][k][i] for e in everyone])) for i in (0, 1)]
            for k in layers}
    counts = {node: nodes.count(node) for node in nodes}
    m = machines.Machine(
        alpha_intra=links.get("alpha_intra", links.get("alpha_inter", 0.0)),
        beta_intra=links.get("beta_intra", links.get("beta_inter", 0.0)),
        alpha_inter=links.get("alpha_inter", links.get("alpha_intra", 0.0)),
        beta_inter=links.get("beta_inter", links.get("beta_intra", 0.0)),
        gamma=gamma, ranks_per_node=max(counts.values()),
        cores_per_node=usable_cpus(),
        compute_cv=float(np.mean([e[2] for e in everyone])),
        name=f"calibrated on {world.size} ranks", info={
            "ranks": world.size, "nodes": len(counts), "points": links["points"],
            "inter_measured": "alpha_inter" in links})
    if args.machine and os.path.exists(args.machine):  # keep other models' compute
        try:
            m.compute = machines.load(args.machine).compute
        except UserError:
            pass
    m.compute[cfg.model] = {"batch_size": cfg.batch_size, "dtype": cfg.dtype,
                            "device": cfg.device or "cpu",
                            "ranks_computing": world.size, "layers": mean,
                            "update_s": float(np.mean([e[1] for e in everyone]))}
    machines.save(m, args.machine)
    fwd = sum(v[0] for v in mean.values()) * cfg.batch_size
    bwd = sum(v[1] for v in mean.values()) * cfg.batch_size
    text = (f"mpidl simulate --calibrate: {world.size} ranks on {len(counts)} node(s): "
            f"alpha {links.get('alpha_intra', 0) * 1e6:.2f} us, beta "
            f"{links.get('beta_intra', 0) * 1e9:.4f} ns/byte "
            f"({1 / max(links.get('beta_intra', 0), 1e-30) / 1e9:.2f} GB/s) inside a node"
            + (f"; alpha {links['alpha_inter'] * 1e6:.2f} us, beta "
               f"{links['beta_inter'] * 1e9:.4f} ns/byte between nodes"
               if "alpha_inter" in links else "; between nodes: not measured (one node), "
               "taken equal") +
            f"; gamma {gamma * 1e9:.4f} ns/byte; {cfg.model} at batch {cfg.batch_size}: "
            f"forward {fwd * 1e3:.2f} ms, backward {bwd * 1e3:.2f} ms, update "
            f"{m.compute[cfg.model]['update_s'] * 1e3:.2f} ms, spread {100 * m.compute_cv:.1f} %; "
            f"{m.cores_per_node} cores per node; written to {args.machine}")
    print(json.dumps(m.to_dict()) if args.json else text, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: mpidl simulate ...")

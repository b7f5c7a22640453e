"""``mpidl train``: build everything from the configuration, then run the Trainer.

Two phases, so that no rank is ever left waiting on another that failed:

1. ``prepare`` (inside the ranks' agreement on user errors, no communication): resolve the
   configuration, pick the device, load the data, build and check the model, optimizer,
   schedule and strategy.
2. the returned job (collective): agree on the output folder, then ``Trainer.fit``.
"""

import argparse
import inspect
import os
import sys
import tempfile
import time

from mpidl import config
from mpidl.config import OPTIONS, resolve, strategy_kwargs
from mpidl.errors import AgreedUserError, ConfigError, UserError
from mpidl.threads import blas_threads_note
from mpidl.training.preempt import STOPPED_STATUS

GROUPS = ["model and data", "training", "precision", "parallelism", "outputs"]


def register_options():
    """The runtime's parts declare their settings; they become flags and config keys."""
    from mpidl.runtime import cli_options  # noqa: PLC0415

    return config.register(cli_options())


def register(subparsers):
    register_options()
    p = subparsers.add_parser(
        "train", help="train a model (one process, or many under mpiexec/srun)",
        description="Train a model on a dataset. Values come from, lowest to highest: "
        "built-in defaults, the model's recommended settings, --config FILE.toml, these "
        "flags. Under mpiexec -n N every rank runs this same command; --batch-size is per "
        "rank.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE.toml", default=None,
                   help="TOML file of settings (keys are these flags' names, e.g. "
                   "batch_size = 64); flags given here override it")
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        g = groups[o.group]
        default = "" if o.default is None else f" (default: {o.default})"
        if o.type is config.resume_mode:  # --resume alone, or --resume auto
            g.add_argument(flag, dest=o.name, nargs="?", const=True, type=_resume_arg,
                           default=argparse.SUPPRESS, metavar=o.metavar, help=o.help)
        elif o.type is bool and o.default is True:
            g.add_argument("--no-" + o.name.replace("_", "-"), dest=o.name,
                           action="store_false", default=argparse.SUPPRESS, help=o.help)
        elif o.type is bool:
            g.add_argument(flag, dest=o.name, action="store_true", default=argparse.SUPPRESS,
                           help=o.help)
        else:
            g.add_argument(flag, dest=o.name, type=o.type, default=argparse.SUPPRESS,
                           metavar=o.metavar or o.name.split("_")[-1].upper(),
                           help=o.help + default)
        if o.name == "overlap":  # the older spelling
            g.add_argument("--no-overlap", dest="overlap", action="store_const", const="off",
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(prepare=prepare)
    return p


def _resume_arg(text):
    try:
        return config.resume_mode(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _epilog():
    lines = ["examples:",
             "  mpidl train --model mlp --epochs 10 --seed 1",
             "  mpidl train --model cnn --dataset fashion-mnist --data-dir ~/data/fashion",
             "  mpiexec -n 4 mpidl train --model mlp --scale-lr --warmup-epochs 1",
             "  mpidl train --config run.toml --lr 0.01 --out-dir runs/try1",
             "",
             "model defaults (override the built-in defaults above):"]
    try:
        from mpidl.engine.models import MODEL_DEFAULTS  # noqa: PLC0415

        for name, d in MODEL_DEFAULTS.items():
            lines.append(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in d.items()))
    except Exception:  # noqa: BLE001 - help must work even with a half-built engine
        lines.append("  (unavailable)")
    lines += ["",
              "uneven data: every rank always runs the same number of steps; the last "
              "global batch of an epoch is padded by wrapping around to the epoch's first "
              "samples, or dropped with --drop-last.",
              "checkpoints: --checkpoint-every K writes one every K steps and at the end; "
              "--resume continues from the newest, bitwise as if never stopped.",
              f"preemption: SIGTERM, SIGINT or SIGUSR1 (to mpiexec, srun or any rank) makes "
              "every rank finish its step, write a checkpoint (in --checkpoint-dir, default "
              "OUT_DIR/checkpoints, even when checkpoints are off) and exit with status "
              f"{STOPPED_STATUS}: stopped, resumable with --resume (a parameter server stops "
              "at the end of the epoch). --resume auto resumes when there is a checkpoint "
              "and starts fresh otherwise."]
    return "\n".join(lines)


def given_flags(args):
    names = {o.name for o in OPTIONS}
    return {k: v for k, v in vars(args).items() if k in names}


def default_strategy(size):
    return "local" if size == 1 else "allreduce"


def make_comm(world):
    """The project's Communicator over MPI_COMM_WORLD (None on one process without MPI)."""
    if world.mpi is None:
        return None
    from mpidl.comm import Communicator  # noqa: PLC0415

    return Communicator(world.mpi)


def _local_rank(world):
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return world.rank


def layout_note(cfg, ranks):
    """How the ranks are laid out, when it is more than data parallelism."""
    if getattr(cfg, "hybrid", None) and ranks > 1:
        return (f" (hybrid {cfg.hybrid}: convolutions data parallel, fully connected "
                f"layers tensor parallel, over {ranks} ranks)")
    t = getattr(cfg, "tensor_parallel", 1) or 1
    p = getattr(cfg, "pipeline_stages", 1) or 1
    if p > 1:
        return (f" (pipeline {p} stages, {getattr(cfg, 'pipeline_schedule', '1f1b')}, x "
                f"tensor parallel {t} x data parallel {ranks // (t * p)})")
    return "" if t == 1 else f" (tensor parallel {t} x data parallel {ranks // t})"


def prepare(args, world):
    """Phase 1 (local): everything that can go wrong because of the input. Returns phase 2."""
    from mpidl import backend  # noqa: PLC0415
    from mpidl import runtime as runtimes  # noqa: PLC0415
    from mpidl.data import load_dataset  # noqa: PLC0415
    from mpidl.training.log import setup_logging  # noqa: PLC0415

    # from now on a stop signal is a request to stop at the next step boundary (with a
    # checkpoint), not an exception in whatever is running (see mpidl.training.preempt)
    from mpidl.training.preempt import StopSignals  # noqa: PLC0415

    stop_signals = StopSignals().install()
    flags = given_flags(args)
    cfg = resolve(flags, args.config)
    log = setup_logging(world.rank, cfg.verbose)
    init = None
    if cfg.init:
        init = read_init(cfg.init)
        saved = init[1].get("model")
        if saved != cfg.model:
            if "model" in cfg.given:
                raise ConfigError(f"--init {cfg.init} holds a {saved!r} model, but --model "
                                  f"is {cfg.model!r}; drop --model or pick another file")
            flags["model"] = saved  # and that model's recommended settings
            cfg = resolve(flags, args.config)
    if cfg.resume and not (cfg.checkpoint_dir or cfg.out_dir or cfg.name):
        raise ConfigError("--resume needs to know where the checkpoints are: give "
                          "--checkpoint-dir DIR, --out-dir DIR or --name NAME")
    try:
        backend.use(cfg.device, local_rank=_local_rank(world))
    except backend.BackendError as e:
        raise ConfigError(f"--device {cfg.device}: {e}") from None

    dataset = load_dataset(cfg.dataset, cfg.data_dir, cfg.limit_train, cfg.limit_test,
                           **dataset_options(cfg))

    model, optimizer = build_model_and_optimizer(cfg, dataset, init,
                                                 planned_steps(cfg, dataset, world.size),
                                                 lazy=builds_lazily(cfg))
    from mpidl.runtime.precision import check_model  # noqa: PLC0415

    check_model(model, getattr(cfg, "precision", "fp32"))
    from mpidl.training.trainer import schedule_factory  # noqa: PLC0415

    lr_schedule = schedule_factory(cfg.schedule)

    name = runtimes.canonical(cfg.strategy or default_strategy(world.size))
    if cfg.optimizer == "lbfgs":  # full-batch iterations: a loop of their own
        if cfg.clip_grad_norm is not None:
            raise ConfigError("--clip-grad-norm scales the gradient steps of sgd, adam and "
                              "adamw; --optimizer lbfgs steps along its own line search: "
                              "drop --clip-grad-norm")
        from mpidl.cli import lbfgs  # noqa: PLC0415

        return lbfgs.prepare(cfg, world, name, model, optimizer, dataset, stop_signals)
    runtimes.presets.check_optimizer(name, optimizer)
    if cfg.checkpoint_every and name in runtimes.presets.EPOCH_END_CHECKPOINTS:
        from mpidl.training.trainer import epoch_end_checkpoints_only  # noqa: PLC0415

        raise ConfigError(epoch_end_checkpoints_only(name))
    options = strategy_kwargs(cfg)
    if cfg.clip_grad_norm is not None:
        options["clip_grad_norm"] = cfg.clip_grad_norm
    cfg.strategy = name
    meta = {"model": cfg.model, "dataset": dataset.name,
            "input_shape": list(dataset.input_shape), "num_classes": dataset.num_classes,
            "dtype": cfg.dtype, "seed": cfg.seed, "model_options": model_options(cfg),
            "task": dataset.task, "mpidl_config": cfg.to_dict()}
    if dataset.vocab is not None:  # what mpidl sample needs to turn ids into text
        meta["vocab"] = dataset.vocab

    first = {"model": model, "optimizer": optimizer}
    outputs = {}  # the run's output folder, chosen once (an elastic run keeps it)

    def start(world, state=None, later=False):
        """Build the communicator, runtime and trainer over ``world`` (collective); the
        model and optimizer of phase 1 the first time, new ones for an elastic run's
        ``later`` generations, which begin from ``state`` (or from the last checkpoint on
        disk, or from scratch, when no commit survived)."""
        from mpidl.cli.errors import Agreement  # noqa: PLC0415
        from mpidl.training.trainer import Trainer  # noqa: PLC0415

        if first:
            model, optimizer = first.pop("model"), first.pop("optimizer")
        else:
            model, optimizer = build_model_and_optimizer(
                cfg, dataset, init, planned_steps(cfg, dataset, world.size),
                lazy=builds_lazily(cfg))
        with Agreement(world):
            comm = make_comm(world) if world.size > 1 or name != "local" else None
            runtime = runtimes.build(name, comm, strict=False, **options)
            trainer = Trainer(model, optimizer, dataset, runtime=runtime, config=cfg,
                              lr_schedule=lr_schedule, model_meta=meta,
                              preemption=stop_signals)
            if cfg.elastic:
                from mpidl.training import elastic  # noqa: PLC0415

                elastic.check(runtime, world.size)
        trainer.initial_state = state
        strategy = runtime
        if not outputs:
            stamp = strategy.bcast(time.strftime("%Y%m%d-%H%M%S") if strategy.is_root
                                   else None)
            outputs["dir"] = cfg.out_dir or os.path.join("runs", cfg.name or stamp)
        out_dir = outputs["dir"]
        ckpt_on = bool(cfg.checkpoint_dir or cfg.checkpoint_every or cfg.resume)
        ckpt_dir = cfg.checkpoint_dir or os.path.join(out_dir, "checkpoints")
        trainer.paths = {
            "metrics": cfg.metrics or os.path.join(out_dir, "metrics.jsonl"),
            "save": cfg.save or os.path.join(out_dir, "model.npz"),
            "checkpoint_dir": ckpt_dir if ckpt_on else None,
            "stop_checkpoint_dir": ckpt_dir,  # a stop signal checkpoints in any case
        }
        if later:  # an elastic run's later generation: all was checked and said before
            return trainer
        # the outputs must be writable before any training time is spent (the root
        # writes them; every rank agrees on the answer)
        with Agreement(world):
            if strategy.is_root:
                check_output_paths(trainer.paths, {
                    "metrics": "--metrics" if cfg.metrics else "--out-dir",
                    "save": "--save" if cfg.save else "--out-dir",
                    "checkpoint_dir": "--checkpoint-dir" if cfg.checkpoint_dir else "--out-dir"},
                    resume=cfg.resume)
        if strategy.is_root:
            log.info(
                f"training {cfg.model} on {dataset.name} ({len(dataset.train_y)} train / "
                f"{len(dataset.test_y)} test, input {dataset.input_shape}) | {world.size} "
                f"rank(s), strategy {runtime.name}{layout_note(cfg, world.size)}, device "
                f"{backend.device()}, {cfg.dtype} | batch "
                f"{cfg.batch_size}/rank = {trainer.loader.global_batch_size} global, "
                f"{trainer.steps_per_epoch} steps/epoch x {cfg.epochs} epochs | "
                f"{cfg.optimizer} lr {trainer.base_lr:g} ({cfg.schedule}, warm-up "
                f"{trainer.warmup_steps} steps){updates_note(optimizer)} | "
                f"{blas_threads_note()} | outputs in {out_dir}")
            unused = runtime.unused_options  # one command line runs on 1 and N ranks
            if unused:
                flags = ", ".join("--" + k.replace("_", "-") for k in unused)
                where = ("one process: " if name == "local" else f"--strategy {name}: ")
                log.info(f"{where}{flags} apply to other layouts and have no effect here"
                         if name != "local" else
                         f"{where}{flags} apply to several ranks and have no effect here")
            if cfg.elastic and world.size == 1:
                log.info("one process: --elastic applies to several ranks and has no "
                         "effect here")
            if "server_replicas" in cfg.given and not (cfg.elastic and name == "ps"):
                log.info("--server-replicas applies to --elastic --strategy ps and has no "
                         "effect here")
        import socket  # noqa: PLC0415

        index, count = strategy.shard()
        log.debug(f"on {socket.gethostname()} (local rank {_local_rank(world)}), device "
                  f"{backend.device()}{'' if backend.gpu_id() is None else ' ' + str(backend.gpu_id())}"
                  f", {'shard %d of %d' % (index, count) if strategy.trains_on_data else 'server'}"
                  f", strategy {name}")
        return trainer

    def job():
        check_ranks_agree(world, cfg, dataset)
        # The Communicator's constructor is collective, so it is built only now that every
        # rank got through phase 1; the runtime's and loader's checks agree once more.
        if world.mpi is not None:
            from mpidl.comm import stall  # noqa: PLC0415

            stall.configure(cfg.stall_warning, cfg.stall_timeout)
        if cfg.elastic and world.size > 1:
            from mpidl.training.elastic import ElasticRun  # noqa: PLC0415

            trainer = ElasticRun(world, start, cfg.elastic_commit_every,
                                 cfg.server_replicas).run()
        else:
            trainer = start(world)
            trainer.fit()
        if trainer.stopped:
            if trainer.is_root:
                print(f"mpidl: {trainer.stop_message()}", file=sys.stderr, flush=True)
            return STOPPED_STATUS
        return 0

    return job


#: settings that may differ between ranks: where each node finds or writes its files, and
#: how chatty it is (everything else must be the same on every rank)
PER_RANK_KEYS = ("data_dir", "config", "given", "verbose", "progress", "out_dir", "name",
                 "metrics", "save", "checkpoint_dir", "init")


def data_fingerprint(dataset):
    """Sizes and a checksum of the data a rank loaded (a strided sample of the images and
    every label): ranks that read different files disagree here."""
    import zlib  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    crc = 0
    for a in (dataset.train_y, dataset.test_y, dataset.train_x.reshape(-1)[::997],
              dataset.test_x.reshape(-1)[::997]):
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return (len(dataset.train_y), len(dataset.test_y), tuple(dataset.train_x.shape[1:]), crc)


def check_ranks_agree(world, cfg, dataset):
    """Collective, before anything else collective: every rank resolved the same settings
    and loaded the same data. A difference (an MPMD launch with other flags on some ranks,
    another data folder on one node) is one line naming the setting, the values and the
    ranks, on every rank, instead of replicas that silently diverge or ranks that hang."""
    if world.size == 1:
        return
    mine = {k: v for k, v in cfg.to_dict().items() if k not in PER_RANK_KEYS}
    mine["__data__"] = data_fingerprint(dataset)
    everyone = world.mpi.allgather(mine)
    keys = sorted(set().union(*everyone), key=lambda k: (k == "__data__", k))
    for key in keys:  # the settings first: a different --limit-train explains the data
        values = [row.get(key) for row in everyone]
        if all(v == values[0] for v in values):
            continue
        groups = {}
        for rank, v in enumerate(values):
            groups.setdefault(repr(v), []).append(rank)
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                         for v, r in groups.items())
        if key == "__data__":
            raise AgreedUserError(f"ranks loaded different data (training/test sizes, input "
                                  f"shape, checksum: {said}); give every rank the same "
                                  "--dataset and data files")
        raise AgreedUserError(f"ranks disagree on --{key.replace('_', '-')} ({said}); every "
                              "rank must run the same command with the same settings")


def check_output_paths(paths, flags, resume=False):
    """ConfigError when an output cannot be written: a metrics or model path that is a
    folder, a folder that cannot be made (a file in the way) or written in. ``flags``
    names, per path, the flag the user would change ("--out-dir" for derived ones). A new
    run (not ``resume``) refuses a checkpoint folder holding an earlier run's checkpoints:
    they would shadow its own at a resume, and pruning would delete its own first."""
    for key in ("metrics", "save"):
        path = paths.get(key)
        if path and os.path.isdir(path):
            raise ConfigError(f"{flags[key]} {path}: that is a folder; give a file name")
    folders = [(os.path.dirname(os.path.abspath(paths[k])), flags[k])
               for k in ("metrics", "save") if paths.get(k)]
    if paths.get("checkpoint_dir"):
        folders.append((os.path.abspath(paths["checkpoint_dir"]), flags["checkpoint_dir"]))
        if not resume:
            from mpidl.training.checkpoint import list_checkpoints  # noqa: PLC0415

            earlier = list_checkpoints(paths["checkpoint_dir"])
            if earlier:
                raise ConfigError(
                    f"{flags['checkpoint_dir']}: {paths['checkpoint_dir']} already holds "
                    f"{len(earlier)} checkpoint(s) of an earlier run (newest: step "
                    f"{earlier[-1][0]}); continue that run with --resume, or give this one "
                    "another --checkpoint-dir or --out-dir")
    for folder, flag in folders:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{flag}: cannot make the folder {folder} "
                              f"({e.strerror or e})") from None
        try:  # a real write: permissions, a read-only mount, a full disk
            fd, probe = tempfile.mkstemp(prefix=".mpidl-write-test-", dir=folder)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"{flag}: cannot write in the folder {folder} "
                              f"({e.strerror or e})") from None


def read_init(path):
    """(arrays, meta) of a model file saved by ``mpidl train``; errors name the file."""
    from mpidl.training.checkpoint import read_model_file  # noqa: PLC0415

    arrays, meta = read_model_file(path, "--init")
    if not meta.get("model") or "input_shape" not in meta:
        raise ConfigError(f"--init {path}: the file has no mpidl metadata (model name, input "
                          "shape); save models with mpidl train --save")
    return arrays, meta


def planned_steps(cfg, dataset, ranks):
    """About how many optimizer steps each rank will make: the epochs times the training
    set over the global batch, counting every rank as a data-parallel replica (so a lower
    bound under tensor or pipeline parallelism)."""
    per_step = cfg.batch_size * getattr(cfg, "accumulate", 1) * ranks
    return cfg.epochs * -(-len(dataset.train_y) // per_step)


def build_model_and_optimizer(cfg, dataset, init=None, steps=None, lazy=False):
    """Model and optimizer; a model that does not fit the data is a UserError.

    With ``init`` (from ``read_init``) the model is built as it was saved and its weights
    loaded, so data of another shape fails the fit check below with the layer named.
    ``lazy``: build it lazily (``builds_lazily``; not with ``init``).
    """
    from mpidl.engine import ShapeError  # noqa: PLC0415
    from mpidl.engine.models import MODELS, build_model, model_builder  # noqa: PLC0415

    input_shape, num_classes = dataset.input_shape, dataset.num_classes
    if init is not None:
        input_shape = tuple(init[1]["input_shape"])
        num_classes = int(init[1].get("num_classes", num_classes))
    where = (f"model {cfg.model!r}" + (f" from {cfg.init} (built for input {input_shape})"
                                      if init is not None else "") +
             f" does not fit dataset {dataset.name!r} (input shape {dataset.input_shape}, "
             f"{dataset.num_classes} classes)")
    options = model_options(cfg)
    if init is not None and "model_options" in init[1]:  # rebuilt as saved, unless flags say
        options = {**init[1]["model_options"],
                   **{k: v for k, v in options.items() if k in cfg.given}}
    try:
        builder = model_builder(cfg.model)
    except ValueError as e:
        raise ConfigError(f"--model {cfg.model}: {e}") from None
    takes = inspect.signature(builder).parameters
    for name in options:
        if name not in takes:
            flag = "--" + name.replace("_", "-")
            if name == "dropout":
                raise ConfigError(f"--dropout: model {cfg.model!r} has no dropout layers "
                                  f"(models with dropout: {', '.join(_taking(MODELS, name))})")
            raise ConfigError(f"{flag}: model {cfg.model!r} has no such option (models that "
                              f"take {flag}: {', '.join(_taking(MODELS, name))})")
    try:
        model = build_model(cfg.model, input_shape=input_shape, num_classes=num_classes,
                            seed=cfg.seed, dtype=cfg.dtype,
                            lazy=lazy and init is None, **options)
    except (ShapeError, ValueError) as e:  # the model's arguments come from the user
        raise UserError(f"{where}: {e}") from None
    if init is not None:
        try:
            model.load_state_dict(init[0])
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--init {cfg.init}: weights do not fit model {cfg.model!r}: "
                              f"{e}") from None
    check_model_fits(model, dataset, where, cfg.dtype)
    return model, make_optimizer(cfg, model, steps)


def builds_lazily(cfg):
    """Whether the model is built lazily, each rank drawing only what it keeps
    (``mpidl.engine.lazy``): a zoo model under a layout that keeps only part of it on a
    rank (tensor or pipeline parallelism, the conv-DP/FC-MP hybrid, ZeRO stage 3 in
    fp32). A model of your own (``FILE.py:FUNC``) is built as it is written: its builder
    may read the values it draws."""
    from mpidl.engine.models import MODELS  # noqa: PLC0415

    zero3 = (getattr(cfg, "zero", 0) or 0) == 3 and \
        getattr(cfg, "precision", "fp32") in (None, "fp32")
    return cfg.model in MODELS and ((getattr(cfg, "tensor_parallel", 1) or 1) > 1
                                    or (getattr(cfg, "pipeline_stages", 1) or 1) > 1
                                    or bool(getattr(cfg, "hybrid", None)) or zero3)


def _taking(models, option):
    return [n for n, f in models.items() if option in inspect.signature(f).parameters]


def model_options(cfg):
    """The model builder's keyword arguments among the settings: those that are set."""
    from mpidl.config import MODEL_OPTIONS  # noqa: PLC0415

    return {name: getattr(cfg, name) for name in MODEL_OPTIONS
            if getattr(cfg, name, None) not in (None, False)}


def dataset_options(cfg):
    """Keyword arguments of ``load_dataset`` that come from the settings: a text
    dataset's windows are the model's context."""
    if cfg.dataset.lower() == "text":
        return {"context": cfg.context}
    return {}


def check_model_fits(model, dataset, where, dtype):
    """Run two test samples through the model (eval mode): a ShapeError is the user's."""
    from mpidl.backend import to_device  # noqa: PLC0415
    from mpidl.data.loader import input_dtype  # noqa: PLC0415
    from mpidl.engine import ShapeError  # noqa: PLC0415
    from mpidl.engine.lazy import shape_only  # noqa: PLC0415

    x = dataset.test_x[:2] if len(dataset.test_x) else dataset.train_x[:2]
    x = to_device(x, dtype=input_dtype(x, dtype))
    model.eval()
    try:
        with shape_only(model):  # a lazily built model's parameters read as zeros
            out = model(x)
    except ShapeError as e:
        raise UserError(f"{where}: {e}") from None
    finally:
        model.train()
    per_sample = tuple(dataset.train_y.shape[1:]) + (dataset.num_classes,)
    if tuple(out.shape[1:]) != per_sample:
        what = "class scores" if len(per_sample) == 1 else "scores per position"
        raise UserError(f"{where}: the model outputs shape {tuple(out.shape[1:])} per "
                        f"sample, expected {per_sample} {what}")


def make_optimizer(cfg, model, steps=None):
    """The optimizer of ``cfg``; ``steps`` (planned per rank) lets ``--fused-optimizer
    auto`` skip the Numba kernels on CPU for a run too short to repay loading them."""
    from mpidl.engine import optim  # noqa: PLC0415

    if cfg.optimizer == "lbfgs":  # its settings; the run is mpidl.cli.lbfgs's
        from mpidl.engine.lbfgs import LbfgsSettings  # noqa: PLC0415

        return LbfgsSettings(history=cfg.lbfgs_history, iterations=cfg.lbfgs_iterations)
    params = model.named_parameters()
    fused = fused_updates(cfg, sum(p.data.size for _, p in params), steps)
    if cfg.optimizer == "sgd":
        return optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                         weight_decay=cfg.weight_decay, fused=fused)
    cls = {"adam": optim.Adam, "adamw": optim.AdamW}[cfg.optimizer]
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def updates_note(optimizer):
    """For the start line: how the optimizer updates, when it is not the fused kernels."""
    return ", NumPy updates" if optimizer.fused is False else ""


def fused_updates(cfg, parameters, steps):
    """The optimizer's ``fused`` argument for ``--fused-optimizer``: None (the fused kernels
    where they exist) or False (NumPy's operations). ``auto`` is None on a GPU (CuPy's
    kernels cost nothing to load) and on CPU when the run repays loading Numba."""
    from mpidl import backend  # noqa: PLC0415
    from mpidl.engine import _fused  # noqa: PLC0415

    choice = getattr(cfg, "fused_optimizer", "auto")
    if choice == "auto":
        long_run = steps is None or _fused.pays_back(parameters, steps)
        return None if long_run or backend.device() == "gpu" else False
    return None if choice == "on" else False

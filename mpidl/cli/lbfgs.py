"""``mpidl train --optimizer lbfgs``: the set-up and the job of a full-batch L-BFGS run.

``mpidl.cli.train.prepare`` hands over here once the data and the model are built (the
same two phases: local checks inside the ranks' agreement on user errors, then the
collective job). What L-BFGS cannot serve is one line (``mpidl.runtime.lbfgs.check``);
settings that only the mini-batch optimizers read are named in the log as having no
effect.
"""

import os
import time

from mpidl.errors import ConfigError


def given_settings(cfg):
    """({parallelism setting: value} that differ from their defaults, {training
    setting: value} given on the command line or in the file)."""
    from mpidl.config import OPTIONS_BY_NAME, strategy_kwargs  # noqa: PLC0415

    training = {name: getattr(cfg, name) for name in getattr(cfg, "given", ())
                if name in OPTIONS_BY_NAME
                and OPTIONS_BY_NAME[name].group not in ("parallelism", "precision")}
    return strategy_kwargs(cfg), training


def prepare(cfg, world, name, model, settings, dataset, stop_signals):
    """Phase 1 (local) for ``--optimizer lbfgs``; returns phase 2 (the job)."""
    from mpidl.cli.train import model_options  # noqa: PLC0415
    from mpidl.runtime import lbfgs as part  # noqa: PLC0415

    given, training = given_settings(cfg)
    part.check(name, given, world.size, training)
    if name == "local" and world.size > 1:
        raise ConfigError(f"strategy 'local' trains on one process, but {world.size} ranks "
                          "were started: use --strategy ps for L-BFGS on several ranks")
    part.check_model(model)
    portion_size = cfg.portion_size or part.default_portion_size(len(dataset.train_y))
    ignored = sorted(k for k in training if k in part.IGNORED)
    options = {k: v for k, v in given.items() if k in part.PS_SETTINGS and k != "deal"}
    options.pop("portion_size", None)
    meta = {"model": cfg.model, "dataset": dataset.name,
            "input_shape": list(dataset.input_shape), "num_classes": dataset.num_classes,
            "dtype": cfg.dtype, "seed": cfg.seed, "model_options": model_options(cfg),
            "task": dataset.task, "mpidl_config": cfg.to_dict()}
    if stop_signals is not None:  # no checkpoints: a stop signal ends it as any program
        stop_signals.uninstall()

    def job():
        from mpidl.cli.errors import Agreement  # noqa: PLC0415
        from mpidl.cli.train import check_output_paths  # noqa: PLC0415
        from mpidl.cli.train import check_ranks_agree, make_comm  # noqa: PLC0415
        from mpidl.training import checkpoint as ckpt  # noqa: PLC0415
        from mpidl.training.lbfgs import LbfgsTrainer  # noqa: PLC0415
        from mpidl.training.log import get_logger  # noqa: PLC0415

        check_ranks_agree(world, cfg, dataset)
        if world.mpi is not None:
            from mpidl.comm import stall  # noqa: PLC0415

            stall.configure(cfg.stall_warning, cfg.stall_timeout)
        with Agreement(world):
            runtime = None
            if name == "ps":
                runtime = part.build(make_comm(world), settings, portion_size, **options)
        root = runtime is None or runtime.is_root
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if runtime is not None:
            stamp = runtime.bcast(stamp if root else None)
        out_dir = cfg.out_dir or os.path.join("runs", cfg.name or stamp)
        paths = {"metrics": cfg.metrics or os.path.join(out_dir, "metrics.jsonl"),
                 "save": cfg.save or os.path.join(out_dir, "model.npz")}
        with Agreement(world):
            if root:
                check_output_paths(paths, {"metrics": "--metrics" if cfg.metrics
                                           else "--out-dir",
                                           "save": "--save" if cfg.save else "--out-dir"})
        trainer = LbfgsTrainer(model, dataset, settings, runtime=runtime,
                               portion_size=portion_size, dtype=cfg.dtype,
                               eval_batch_size=cfg.eval_batch_size,
                               paths={"metrics": paths["metrics"]})
        log = get_logger()
        if root:
            n = len(dataset.train_y)
            where = ("one process" if runtime is None else
                     f"{world.size} ranks: {len(runtime.roles['server'])} server(s) "
                     f"(server 0 coordinates), {len(runtime.trainer_ranks)} worker(s)")
            log.info(f"training {cfg.model} on {dataset.name} ({n} train / "
                     f"{len(dataset.test_y)} test) with full-batch L-BFGS | {where}, "
                     f"device {_device()}, {cfg.dtype} | memory m = {settings.history}, "
                     f"at most {settings.iterations} iterations | each evaluation: "
                     f"{-(-n // portion_size)} portions of {portion_size} samples | "
                     f"outputs in {out_dir}")
            if ignored:
                flags = ", ".join("--" + k.replace("_", "-") for k in ignored)
                log.info(f"--optimizer lbfgs: {flags} apply to the mini-batch optimizers "
                         "and have no effect here")
        final = trainer.fit()
        if root:
            ckpt.save_model(paths["save"], model, dict(meta, iterations=final["iterations"],
                                                      test_acc=final.get("test_acc")))
            log.info(f"saved the model to {paths['save']}")
        return 0

    return job


def _device():
    from mpidl import backend  # noqa: PLC0415

    return backend.device()

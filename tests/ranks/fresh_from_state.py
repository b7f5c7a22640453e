"""A fresh ``mpidl train`` run on this launch's ranks that starts from a checkpoint's
state: the reference a resume on another number of ranks must equal
(tests/test_elastic.py, growing from 2 to 3 ranks).

    mpiexec -n N python -m mpi4py fresh_from_state.py CHECKPOINT.npz SAVE.npz FLAGS...

FLAGS are ``mpidl train`` flags. The run is built as ``mpidl train`` builds it (the same
configuration, model, optimizer, runtime and trainer over N ranks); before its first
step a callback loads the checkpoint's model and optimizer state into it and sets the
epoch (the checkpoint must be at an epoch's end). Nothing of the checkpoint-resume code
runs: no ``--resume``, no ``Trainer.restore``/``load_state``, so the comparison checks
that code against a run that never needed it.
"""

import sys

from mpi4py import MPI

from mpidl.cli.main import build_parser
from mpidl.cli.train import build_model_and_optimizer, given_flags, planned_steps
from mpidl.comm import Communicator
from mpidl.config import resolve, strategy_kwargs
from mpidl.data import load_dataset
from mpidl.runtime import build
from mpidl.training import checkpoint as ckpt
from mpidl.training.callbacks import Callback
from mpidl.training.trainer import Trainer, schedule_factory


class StartFrom(Callback):
    def __init__(self, state):
        self.state = state

    def on_fit_start(self, trainer):
        p = self.state["progress"]
        assert int(p["position"]) == 0, "the checkpoint must be at an epoch's end"
        trainer.runtime.load_full_state(trainer.model, trainer.optimizer,
                                        self.state["model"], self.state["optimizer"])
        trainer.epoch = int(p["epoch"])


def main(path, save, flags):
    args = build_parser().parse_args(["train", *flags])
    cfg = resolve(given_flags(args))
    world = MPI.COMM_WORLD
    dataset = load_dataset(cfg.dataset, cfg.data_dir)
    dataset = dataset.limit(cfg.limit_train, cfg.limit_test)
    model, optimizer = build_model_and_optimizer(cfg, dataset, None,
                                                 planned_steps(cfg, dataset, world.size))
    runtime = build("allreduce", Communicator(world), strict=False, **strategy_kwargs(cfg))
    trainer = Trainer(model, optimizer, dataset, runtime=runtime, config=cfg,
                      lr_schedule=schedule_factory(cfg.schedule), quiet=True,
                      callbacks=[StartFrom(ckpt.load(path))])
    trainer.paths = {"save": save}
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

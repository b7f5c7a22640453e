"""The Trainer from Python: callbacks see every step, evaluation, epoch end and
checkpoint; a callback can end training; the task decides what is measured."""

import numpy as np

from mpidl.data import load_dataset
from mpidl.engine import SGD, build_model
from mpidl.training.callbacks import Callback
from mpidl.training.trainer import Trainer


class Recorder(Callback):
    def __init__(self, stop_after=None):
        self.events, self.stop_after = [], stop_after

    def on_fit_start(self, trainer):
        self.events.append("fit_start")

    def on_step_start(self, trainer):
        self.events.append(f"start{trainer.step}")

    def on_step_end(self, trainer, loss):
        assert np.isfinite(loss)
        self.events.append(f"end{trainer.step}")
        if self.stop_after is not None and trainer.step == self.stop_after:
            trainer.stop()

    def on_evaluate(self, trainer, results):
        self.events.append(f"eval{sorted(results)}")

    def on_epoch_end(self, trainer, record):
        self.events.append(f"epoch{record['epoch']}")

    def on_checkpoint(self, trainer, path):
        self.events.append("checkpoint" if path else "checkpoint?")

    def on_fit_end(self, trainer):
        self.events.append("fit_end")


def _trainer(tmp_path, callbacks, **settings):
    data = load_dataset("synthetic").limit(128, 32)
    model = build_model("mlp", hidden=(16,), seed=0)
    return Trainer(model, SGD(model.named_parameters(), lr=0.1), data, callbacks=callbacks,
                   batch_size=32, progress=False, quiet=True,
                   paths={"checkpoint_dir": str(tmp_path / "ck")}, **settings)


def test_callbacks_see_the_loop_in_order(tmp_path, capsys):
    rec = Recorder()
    last = _trainer(tmp_path, [rec], epochs=2).fit()
    steps = [e for e in rec.events if e.startswith(("start", "end"))]
    # on_step_start sees the steps done so far, on_step_end counts the step just done
    assert steps == [e for i in range(8) for e in (f"start{i}", f"end{i + 1}")]
    assert rec.events[0] == "fit_start" and rec.events[-1] == "fit_end"
    assert rec.events.count("epoch1") == rec.events.count("epoch2") == 1
    assert "eval['test_acc', 'test_loss']" in rec.events
    assert rec.events[-2] == "checkpoint"          # the final checkpoint, then the end
    assert last["epoch"] == 2 and last["step"] == 8
    assert capsys.readouterr().out == ""           # quiet: no metrics lines on stdout


def test_a_callback_can_stop_training(tmp_path):
    rec = Recorder(stop_after=3)
    last = _trainer(tmp_path, [rec], epochs=5).fit()
    assert last["step"] == 3 and last["epoch"] == 1  # the epoch still ends (evaluated)
    assert rec.events.count("epoch1") == 1 and "start3" not in rec.events


def test_evaluation_keeps_no_activations(tmp_path):
    """An evaluation's forwards keep nothing for a backward that never comes: after
    ``evaluate`` (and so after training) the model holds no saved activations."""
    trainer = _trainer(tmp_path, [], epochs=1)
    trainer.fit()
    assert trainer.model.activation_nbytes() == 0
    trainer.model(np.zeros((8,) + trainer.dataset.train_x.shape[1:], np.float32))
    assert trainer.model.activation_nbytes() > 0  # (a forward does keep them)
    trainer.evaluate()
    assert trainer.model.activation_nbytes() == 0

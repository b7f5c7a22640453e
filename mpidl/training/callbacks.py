"""Callbacks: code that runs at fixed points of the training loop, on every rank.

Subclass ``Callback`` and override what you need; give instances to the ``Trainer``
(``callbacks=[...]``). They are called in order on every rank (check
``trainer.is_root`` for rank-0-only work); a callback must not communicate unless
every rank calls it the same way. Benchmarks use them to take parameter snapshots or
time steps instead of copying the loop.
"""


class Callback:
    """Hooks of the training loop; every method is optional."""

    def on_fit_start(self, trainer):
        """After the runtime's set-up (and a resume), before the first epoch; also on
        ranks that serve (``trainer.runtime.trains_on_data`` False), before serving."""

    def on_step_start(self, trainer):
        """Before every training step (its batch is loaded; the lr is set)."""

    def on_step_end(self, trainer, loss):
        """After every training step (``trainer.step`` already counts it)."""

    def on_evaluate(self, trainer, results):
        """After the epoch's evaluation: ``results`` is the task's metrics."""

    def on_epoch_end(self, trainer, record):
        """After the epoch's metrics line (``record``) is written."""

    def on_checkpoint(self, trainer, path):
        """After a checkpoint is written (``path`` on the root, None elsewhere)."""

    def on_fit_end(self, trainer):
        """After training (also on ranks that only served)."""


class CallbackList(Callback):
    """Several callbacks called in order."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)

    def _each(self, method, *args):
        for cb in self.callbacks:
            getattr(cb, method)(*args)

    def on_fit_start(self, trainer):
        self._each("on_fit_start", trainer)

    def on_step_start(self, trainer):
        self._each("on_step_start", trainer)

    def on_step_end(self, trainer, loss):
        self._each("on_step_end", trainer, loss)

    def on_evaluate(self, trainer, results):
        self._each("on_evaluate", trainer, results)

    def on_epoch_end(self, trainer, record):
        self._each("on_epoch_end", trainer, record)

    def on_checkpoint(self, trainer, path):
        self._each("on_checkpoint", trainer, path)

    def on_fit_end(self, trainer):
        self._each("on_fit_end", trainer)

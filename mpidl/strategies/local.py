"""One process, no communication: forward, loss, backward, optimizer step."""

from mpidl.errors import ConfigError
from mpidl.strategies.base import Strategy


class LocalStrategy(Strategy):
    """Plain single-process training (the reference the parallel strategies must match).

    Communication options (``algorithm``, ``bucket_mb``, ...) are accepted and ignored,
    so the same command line runs on one rank and on many.
    """

    name = "local"

    def __init__(self, comm=None, **options):
        super().__init__(comm, **options)
        if self.size > 1:
            raise ConfigError(f"strategy 'local' trains on one process, but {self.size} ranks "
                              "were started: use --strategy allreduce (the default for more "
                              "than one rank) or run without mpiexec")

    def train_step(self, x, y):
        self.optimizer.zero_grad()
        logits = self.model.forward(x)
        loss = self.loss.forward(logits, y)
        self.model.backward(self.loss.backward())
        self.optimizer.step()
        return float(loss)


STRATEGY = LocalStrategy

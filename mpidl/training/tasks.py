"""What is learned and how it is measured: the trainer's *task*.

A task gives the loss a step minimizes (``loss``, a fresh object per task: losses keep
the state of their last forward) and turns evaluation batches into sums that add up
over ranks (``eval_sums``) and those totals into the epoch's metrics (``eval_metrics``).
Classification is the one task today; language modelling (loss in nats per token) and
reinforcement learning (returns) are tasks with other losses and metrics, under the
same trainer.
"""

import math

from mpidl.engine.losses import SoftmaxCrossEntropy


class ClassificationTask:
    """Softmax cross-entropy over class scores; reports ``test_loss`` and ``test_acc``."""

    name = "classification"

    def __init__(self, loss=None, eval_loss=None):
        self.loss = loss if loss is not None else SoftmaxCrossEntropy()
        self.eval_loss = eval_loss if eval_loss is not None else SoftmaxCrossEntropy()

    def eval_sums(self, model, x, y):
        """{name: number} for one evaluation batch; summed over batches and ranks."""
        logits = model(x)
        return {"loss_sum": float(self.eval_loss.forward(logits, y)) * len(y),
                "correct": self.eval_loss.correct(logits, y), "n": len(y)}

    def eval_metrics(self, totals):
        n = totals.get("n", 0)
        if not n:
            return {"test_loss": math.nan, "test_acc": math.nan}
        return {"test_loss": totals["loss_sum"] / n, "test_acc": totals["correct"] / n}

"""What is learned and how it is measured: the trainer's *task*.

A task gives the loss a step minimizes (``loss``, a fresh object per task: losses keep
the state of their last forward) and turns evaluation batches into sums that add up
over ranks (``eval_sums``) and those totals into the epoch's metrics (``eval_metrics``).
Classification and language modelling (loss in nats and bits per token) are the tasks
today; ``task_for(dataset)`` picks the one a dataset's labels call for.
"""

import math

from mpidl.engine.losses import SoftmaxCrossEntropy, TokenCrossEntropy


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


class LanguageModelTask:
    """Next-token cross-entropy over logits ``(B, T, vocab)`` and ids ``(B, T)``; reports
    the validation loss per token in nats (``test_loss`` and ``test_nats_per_char``) and
    bits (``test_bits_per_char``), and ``test_acc``, the share of tokens whose most
    likely next token is the right one. Every token of the evaluation set counts once,
    however the batches and ranks cut it."""

    name = "language-model"

    def __init__(self, loss=None, eval_loss=None):
        self.loss = loss if loss is not None else TokenCrossEntropy()
        self.eval_loss = eval_loss if eval_loss is not None else TokenCrossEntropy()

    def eval_sums(self, model, x, y):
        logits = model(x)
        tokens = int(y.size)
        return {"loss_sum": float(self.eval_loss.forward(logits, y)) * tokens,
                "correct": self.eval_loss.correct(logits, y), "n": tokens}

    def eval_metrics(self, totals):
        n = totals.get("n", 0)
        nats = totals["loss_sum"] / n if n else math.nan
        return {"test_loss": nats, "test_nats_per_char": nats,
                "test_bits_per_char": nats / math.log(2),
                "test_acc": totals["correct"] / n if n else math.nan}


TASKS = {"classification": ClassificationTask, "language-model": LanguageModelTask}


def task_for(dataset):
    """A fresh task for ``dataset``'s ``task`` attribute (classification when it has none)."""
    return TASKS[getattr(dataset, "task", None) or "classification"]()

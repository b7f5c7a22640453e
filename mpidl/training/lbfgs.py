"""Full-batch L-BFGS training (``--optimizer lbfgs``): iterations instead of epochs.

Not the ``Trainer``'s loop: an L-BFGS iteration is a line search over evaluations of the
whole training set, decided from scalars by a coordinator, not a batch in and an update
out, and it keeps no per-step state worth checkpointing yet. What it shares with the
trainer: the task (loss and test metrics), the metrics lines (one JSON object per
iteration, then a final one with the test accuracy) and the saved model.

One process: ``mpidl.engine.lbfgs.minimize`` over the training set cut into portions of
``portion_size`` samples (``dealing.sum_of_portions``). Parameter servers
(``runtime``, from ``mpidl.runtime.lbfgs.build``): the servers serve (server 0
coordinates), the workers evaluate dealt portions until the coordinator says stop; its
records reach the first worker with the parameters and are written there.
"""

import math
import time

from mpidl.backend import to_device
from mpidl.training.metrics import MetricsWriter
from mpidl.training.tasks import task_for


class LbfgsTrainer:
    """Run L-BFGS (``settings``: ``LbfgsSettings``) on ``dataset``'s training set.

    ``runtime``: None for one process, else this rank's ``Runtime`` from
    ``mpidl.runtime.lbfgs.build``. ``portion_size``: samples per portion (the same on
    every layout). ``paths``: {"metrics": file or None}. ``quiet``: no lines on stdout.
    ``fit()`` returns the final record on the root (the first worker), None elsewhere;
    ``records`` holds every iteration's record there.
    """

    def __init__(self, model, dataset, settings, runtime=None, task=None, portion_size=None,
                 dtype="float32", eval_batch_size=500, paths=None, quiet=False):
        from mpidl.runtime.lbfgs import default_portion_size  # noqa: PLC0415

        self.model, self.dataset, self.settings = model, dataset, settings
        self.runtime = runtime
        self.task = task if task is not None else task_for(dataset)
        self.portion_size = portion_size or default_portion_size(len(dataset.train_y))
        self.dtype = dtype
        self.eval_batch_size = eval_batch_size
        self.paths = dict(paths or {})
        self.quiet = quiet
        self.records = []
        self.evaluations = 0  # evaluations this rank took part in
        self.final = None

    @property
    def is_root(self):
        return self.runtime is None or self.runtime.is_root

    def _data(self):
        from mpidl.data.loader import input_dtype  # noqa: PLC0415

        x, y = self.dataset.train_x, self.dataset.train_y
        return to_device(x, dtype=input_dtype(x, self.dtype)), to_device(y)

    def fit(self):
        self.t0 = time.perf_counter()
        self.writer = (MetricsWriter(self.paths.get("metrics"), stdout=not self.quiet)
                       if self.is_root else None)
        self.model.train()
        if self.runtime is None:
            return self._fit_alone()
        rt = self.runtime
        rt.setup(self.model, None, self.task.loss)
        if rt.trains_on_data:
            self._work()
        else:
            rt.serve()
            rt.finish()
        return self._summarize()

    def _write(self, record):
        record = dict(record, elapsed=time.perf_counter() - self.t0)
        self.records.append(record)
        if self.writer is not None:
            self.writer.write(record)

    def _fit_alone(self):
        from mpidl.engine.lbfgs import minimize  # noqa: PLC0415
        from mpidl.runtime.dealing import sum_of_portions  # noqa: PLC0415

        x, y = self._data()
        loss, size = self.task.loss, self.portion_size

        def evaluate():
            self.evaluations += 1
            return sum_of_portions(self.model, loss, x, y, size)

        lbfgs = minimize(self.model.named_parameters(), evaluate, self.settings,
                         on_iteration=self._write)
        return self._finish(lbfgs.stop_reason, lbfgs.iteration, lbfgs.evaluations,
                            {"evaluations_per_rank": {"0": self.evaluations}})

    def _work(self):
        """A worker: one ``train_step`` per evaluation (the dealt portions of it), until
        the coordinator's answer says done."""
        rt = self.runtime
        x, y = self._data()
        sync = rt.syncs[0][1]
        done = False
        while not done:
            rt.train_step(x, y)
            self.evaluations += 1
            said = sync.dealer_reply().get("lbfgs") or {}
            if self.is_root:
                for record in said.get("records", ()):
                    self._write(record)
            done = bool(said.get("done"))
        if self.is_root:
            self.test = self._evaluate()
        rt.finish()

    def _evaluate(self):
        from mpidl.data.loader import eval_batches  # noqa: PLC0415

        self.model.eval()
        sums = {}
        try:
            for bx, by in eval_batches(self.dataset.test_x, self.dataset.test_y,
                                       self.eval_batch_size, dtype=self.dtype):
                for k, v in self.task.eval_sums(self.model, bx, by).items():
                    sums[k] = sums.get(k, 0) + v
        finally:
            self.model.train()
        return self.task.eval_metrics(sums or {"loss_sum": 0, "correct": 0, "n": 0})

    def _summarize(self):
        """Collective over every rank: each one's evaluations (and a server's exchange
        counts) to the root, which writes the final record."""
        rt = self.runtime
        mine = {"rank": rt.rank, "role": rt.role, "evaluations": self.evaluations}
        if rt.role == "server":
            mine.update(rt.server.summary or {})
        with rt.comm.waiting("in L-BFGS's summary at the end"):
            everyone = rt.comm.mpi.gather(mine, root=rt.trainer_ranks[0])
        if not self.is_root:
            return None
        servers = [r for r in everyone if r["role"] == "server"]
        head = servers[0]
        extra = {"evaluations_per_rank": {str(r["rank"]): r["evaluations"]
                                          for r in everyone},
                 "servers": len(servers), "workers": len(everyone) - len(servers),
                 "coordinator_bytes": sum(r["group_bytes"] for r in servers),
                 "coordinator_messages": sum(r["group_messages"] for r in servers),
                 "portions_dealt": head["deals"],
                 "ps_pushed": sum(r["pushed"] for r in servers),
                 "ps_dropped": sum(r["dropped"] for r in servers)}
        return self._finish(head["stop_reason"], head["iterations"],
                            head["coordinator_evaluations"], extra, test=self.test)

    def _finish(self, reason, iterations, evaluations, extra, test=None):
        test = test if test is not None else self._evaluate()
        last = self.records[-1] if self.records else {}
        self.final = {"final": True, "iterations": iterations, "evaluations": evaluations,
                      "loss": last.get("loss", math.nan),
                      "grad_max": last.get("grad_max", math.nan), **test, "stop": reason,
                      "portion_size": self.portion_size,
                      "portions": -(-len(self.dataset.train_y) // self.portion_size),
                      **extra}
        self._write(self.final)
        return self.final

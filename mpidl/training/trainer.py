"""The training loop: epochs of sharded batches driven through a parallel ``Runtime``.

The trainer owns data order, the learning-rate schedule, evaluation, metrics, the
progress bar and checkpoints; the runtime (``mpidl.runtime``) owns what a step does
across ranks, and the *task* (``mpidl.training.tasks``) what is learned and measured
(classification or language modelling). Callbacks (``mpidl.training.callbacks``) see every step end,
evaluation, epoch end and checkpoint, so benchmarks and experiments extend the loop
instead of copying it. A checkpoint holds everything the loop needs to continue at the exact batch
where it stopped — model (with buffers such as BatchNorm statistics and Dropout's mask
counter), optimizer state, step, epoch, position in the epoch, the epoch's running
metrics, every rank's RNG states and the runtime's state — so a resumed run ends
bitwise equal to an uninterrupted one with the same seed and rank count.

Preemption (``mpidl.training.preempt``): with ``preemption`` on, a SIGTERM, SIGINT or
SIGUSR1 on any rank makes every rank finish the step in flight, agree on stopping at the
same step, write a checkpoint of that exact position and leave ``fit`` with
``trainer.stopped`` saying where; ``mpidl train`` then exits with status 75.
"""

import math
import time
import uuid
from types import SimpleNamespace

import numpy as np

from mpidl import backend, env
from mpidl.data import BatchLoader
from mpidl.errors import AgreedUserError, ConfigError, TrainingDiverged, UserError
from mpidl.training import checkpoint as ckpt
from mpidl.training.callbacks import CallbackList
from mpidl.training.log import get_logger
from mpidl.training.metrics import EpochStats, MetricsWriter, truncate_metrics
from mpidl.training.progress import Progress
from mpidl.training.tasks import task_for

FAIL_ENV = "MPIDL_FAIL_AT"
KILL_ENV = "MPIDL_KILL_AT"
CRASH_IN_CHECKPOINT_ENV = "MPIDL_CRASH_IN_CHECKPOINT"


class InjectedFailure(RuntimeError):
    """Raised by the MPIDL_FAIL_AT test hook."""


# -- RNG states outside the model's buffers (layers holding Generators, NumPy's global one)

def _walk(layer, path=""):
    yield path, layer
    for name, child in getattr(layer, "children", lambda: [])():
        yield from _walk(child, f"{path}.{name}" if path else name)


def rng_states(model):
    """Every numpy Generator/RandomState a layer holds, plus NumPy's global state."""
    states = {"numpy_global": np.random.get_state(legacy=False)}
    for path, layer in _walk(model):
        for attr, value in sorted(vars(layer).items()):
            if isinstance(value, np.random.Generator):
                states[f"{path}:{attr}"] = value.bit_generator.state
            elif isinstance(value, np.random.RandomState):
                states[f"{path}:{attr}"] = value.get_state(legacy=False)
    return states


def set_rng_states(model, states):
    np.random.set_state(states["numpy_global"])
    for path, layer in _walk(model):
        for attr, value in vars(layer).items():
            key = f"{path}:{attr}"
            if key not in states:
                continue
            if isinstance(value, np.random.Generator):
                value.bit_generator.state = states[key]
            elif isinstance(value, np.random.RandomState):
                value.set_state(states[key])


class Trainer:
    """Runs ``epochs`` epochs of ``runtime``'s steps on ``dataset``; see the module doc.

    ``model``, ``optimizer``: an mpidl ``Layer`` and an engine optimizer over its
    parameters. ``dataset``: any object with ``train_x, train_y, test_x, test_y`` host
    arrays (``mpidl.data.Dataset``). ``runtime``: an ``mpidl.runtime.Runtime`` (default:
    one process). ``task``: what is learned (default: ``task_for(dataset)``, the
    dataset's ``task``, classification when it names none).
    ``config``: an object with settings as attributes (``mpidl train``'s resolved
    configuration); ``settings`` keywords override it, and anything not given takes the
    command line's default (``epochs``, ``batch_size``, ``lr``, ``schedule``,
    ``warmup_epochs``, ``scale_lr``, ``seed``, ``drop_last``, ``dtype``,
    ``eval_batch_size``, ``checkpoint_every``, ``keep_checkpoints``, ``resume``,
    ``progress``). ``paths``: {"metrics", "save", "checkpoint_dir"} (None to skip each).
    ``lr_schedule``: a factory (base_lr, total_steps, warmup_steps) -> schedule(step);
    default from ``schedule``. ``callbacks``: ``mpidl.training.callbacks.Callback``s;
    one may end training early with ``trainer.stop()`` (every rank at the same step: the
    epoch then ends as usual, evaluation and metrics included). ``quiet``: no metrics
    lines on stdout (the metrics file, if any, is still written). ``preemption``: stop
    with a checkpoint on SIGTERM, SIGINT and SIGUSR1 (see the module doc): True installs
    ``mpidl.training.preempt.StopSignals`` for the time of ``fit`` (main thread), or give
    an installed one (the command line installs it before loading the data); every rank
    must give the same. A stop writes to ``paths["checkpoint_dir"]``, or when checkpoints
    are off to ``paths["stop_checkpoint_dir"]``; ``trainer.stopped`` is then
    {"signal", "epoch", "step", "checkpoint"} (None when training ran to its end).
    """

    def __init__(self, model, optimizer, dataset, runtime=None, task=None, config=None,
                 callbacks=(), paths=None, lr_schedule=None, model_meta=None, quiet=False,
                 preemption=None, **settings):
        self.cfg = _settings(config, settings)
        cfg = self.cfg
        if runtime is None:
            from mpidl.runtime import build  # noqa: PLC0415

            runtime = build("local")
        self.model, self.optimizer = model, optimizer
        self.runtime = runtime
        if hasattr(runtime, "check"):  # before any communication (ConfigError)
            runtime.check(model, optimizer)
        self.task = task if task is not None else task_for(dataset)
        self.dataset = dataset
        self.paths = dict(paths or {})
        self.model_meta = dict(model_meta or {})
        self.callbacks = CallbackList(callbacks)
        self.quiet = bool(quiet)
        self._stop = False
        self.preemption = preemption or None
        self.stopped = None  # where a stop signal ended training (see the class doc)
        self._last_checkpoint = (None, None)  # (step, path on the root) of the newest
        self.log = get_logger()
        if runtime.checkpoint_at_epoch_end and cfg.checkpoint_every:
            raise ConfigError(epoch_end_checkpoints_only(runtime.name))
        self.index, self.count = runtime.shard()
        # a run that changes its number of ranks keeps its global batch (resize.py)
        self.keeps_global_batch = keeps_global_batch(runtime, getattr(cfg, "keep_batch", None))
        if getattr(cfg, "keep_batch", None) == "global" and not self.keeps_global_batch:
            raise ConfigError(f"--keep-batch global keeps a data-parallel run's global batch; "
                              f"--strategy {runtime.name} (or --accumulate) keeps the "
                              "per-rank batch when the ranks change: drop --keep-batch, or "
                              "use --keep-batch rank")
        self._lr_schedule = lr_schedule
        self.use_global_batch(None)
        self.fail_at = env.rank_steps(FAIL_ENV).get(runtime.rank, set())
        world_rank = getattr(runtime.comm, "world_rank", 0)
        self.kill_at = env.rank_steps(KILL_ENV).get(world_rank, set())
        self.elastic = None  # an elastic run's commits (mpidl.training.elastic)
        self.initial_state = None  # state to start from (an elastic run's commit)
        crash = env.get(CRASH_IN_CHECKPOINT_ENV)  # "N" or "N:BYTES": test hook
        self.crash_in_checkpoint = tuple(int(v) for v in crash.split(":")) if crash else None
        self.checkpoints_written = 0
        # where the loop stands: the next step's epoch, the steps done in it and the
        # samples of its permutation they consumed (its position), steps done so far
        self.step = 0
        self.epoch = 0
        self.batch = 0
        self.position = 0
        self._last_sched = None  # the schedule step of the last step taken
        self.stats = EpochStats()
        self.epoch_start = time.perf_counter()  # set again as each epoch starts
        self.seconds_before = 0.0  # time spent in earlier (interrupted) runs
        self.last = {}
        # this run's identity, in every checkpoint it writes (a resume keeps the old one)
        self.run_id = uuid.uuid4().hex

    def use_global_batch(self, global_batch):
        """The loader, the steps and the learning-rate schedule for a global batch of
        ``global_batch`` samples cut over this run's ranks (None: the batch size times the
        ranks, the usual). A run that keeps its global batch on another number of ranks
        gets the same steps and schedule as on its first; a rank whose piece is not the
        mean piece weighs its gradient by its share, so the all-reduce's mean is still
        the mean over the global batch."""
        cfg, runtime = self.cfg, self.runtime
        micro = getattr(runtime.schedule, "k", 1)
        per_rank = cfg.batch_size * micro
        # --deal portions: every worker loads the whole global batch (micro = workers)
        self.loader = BatchLoader(self.dataset.train_x, self.dataset.train_y, per_rank,
                                  shard=(0, 1) if runtime.whole_batches
                                  else (self.index, self.count), seed=cfg.seed,
                                  drop_last=cfg.drop_last, dtype=cfg.dtype,
                                  global_batch=global_batch)
        G = self.loader.global_batch_size
        weight = self.loader.batch_size * self.count / G if global_batch else 1.0
        if hasattr(runtime.schedule, "grad_weight"):
            runtime.schedule.grad_weight = weight
        elif weight != 1.0:  # (every step schedule has one; a new one must too)
            raise RuntimeError(f"{type(runtime.schedule).__name__} cannot weigh a piece "
                               "of the global batch (no grad_weight)")
        ranks = G // per_rank if global_batch else self.count  # what --scale-lr scales by
        self.steps_per_epoch = len(self.loader)
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.base_lr = cfg.lr * (ranks if cfg.scale_lr else 1)
        warmup_epochs = cfg.warmup_epochs
        if cfg.scale_lr and ranks > 1 and "warmup_epochs" not in getattr(cfg, "given", ()):
            warmup_epochs = 1.0  # a scaled lr needs a warm-up (Goyal et al. 2017)
        self.warmup_steps = int(round(warmup_epochs * self.steps_per_epoch))
        factory = self._lr_schedule or schedule_factory(cfg.schedule)
        self.schedule = factory(self.base_lr, self.total_steps, self.warmup_steps)

    # -- helpers
    @property
    def strategy(self):
        """The runtime (the name earlier versions used)."""
        return self.runtime

    @property
    def is_root(self):
        return self.runtime.is_root

    @property
    def checkpointing(self):
        return self.paths.get("checkpoint_dir") is not None

    def lr_at(self, step):
        return float(self.schedule(step))

    def schedule_step(self):
        """Where the next step stands in the learning-rate schedule: ``epoch *
        steps_per_epoch + position / global_batch`` (this rank count's steps). With one
        rank count all along it is the step count itself (an int); after a change of
        rank count mid-epoch (an elastic run, a resume on other ranks) it goes on from the
        samples consumed, so the schedule neither jumps nor replays."""
        g = self.loader.global_batch_size
        whole, part = divmod(self.position, g)
        base = self.epoch * self.steps_per_epoch + whole
        return base if part == 0 else base + part / g

    def stop(self):
        """End training after the current step (a callback calls it on every rank)."""
        self._stop = True

    # -- the loop
    def fit(self):
        self.t_start = time.perf_counter()
        own_signals = None
        if self.preemption is True:
            from mpidl.training.preempt import StopSignals  # noqa: PLC0415

            self.preemption = own_signals = StopSignals().install()
        try:
            return self._fit()
        finally:
            if own_signals is not None:
                own_signals.uninstall()
                self.preemption = True

    def _fit(self):
        cfg, rt = self.cfg, self.runtime
        # a parameter server's checkpoint needs the servers' state from each epoch barrier
        rt.checkpoints = self.checkpointing or self.elastic is not None or (
            self.preemption is not None and self.paths.get("stop_checkpoint_dir") is not None)
        if getattr(rt, "pp", None) is not None and rt.trains_on_data:
            # the pipeline times each layer on one micro-batch to balance its stages
            _, x, y = next(iter(self.loader.epoch(0)))
            rt.sample_batch = (x[:cfg.batch_size], y[:cfg.batch_size])
        rt.setup(self.model, self.optimizer, self.task.loss)
        rt.adapt_task(self.task)
        if self.is_root:
            for line in rt.start_lines(cfg.batch_size):
                self.log.info(line)
        if self.initial_state is not None:
            self.load_state(self.initial_state)
            if self.is_root:  # epochs done after the state was taken are done again
                truncate_metrics(self.paths.get("metrics"), self.epoch)
        elif cfg.resume:
            self.restore()
        self.callbacks.on_fit_start(self)
        if not rt.trains_on_data:
            rt.serve()
            rt.finish()
            self.share_stop()
            self.callbacks.on_fit_end(self)
            return self.last
        self.metrics = (MetricsWriter(self.paths.get("metrics"), stdout=not self.quiet)
                        if self.is_root else None)
        self.progress = Progress(cfg.progress and self.is_root)
        self.model.train()
        images_per_step = self.loader.global_batch_size
        diverged = False
        try:
            while self.epoch < cfg.epochs and not diverged and not self._stop:
                epoch = self.epoch
                left = self.loader.steps_from(self.position)
                if left > 0:
                    self.progress.start_epoch(epoch + 1, cfg.epochs, self.batch + left,
                                              self.batch)
                t = self.epoch_start = time.perf_counter()
                for at, x, y in self.loader.from_position(epoch, self.position):
                    if self.elastic is not None:
                        self.elastic.before_step(self)
                    if self.step in self.kill_at:
                        env.kill_now()
                    if self.step in self.fail_at:
                        raise InjectedFailure(f"{FAIL_ENV}: injected failure on rank "
                                              f"{rt.rank} at step {self.step}")
                    self._last_sched = self.schedule_step()
                    lr = self.lr_at(self._last_sched)
                    self.optimizer.lr = lr
                    self.callbacks.on_step_start(self)
                    loss = rt.train_step(x, y)
                    self.step += 1
                    self.batch += 1
                    self.position = at + images_per_step
                    now = time.perf_counter()
                    self.stats.add(loss, images_per_step, now - t)
                    self.progress.update(self.stats.loss_sum / self.stats.steps,
                                         self.stats.images / max(self.stats.seconds, 1e-9), lr)
                    self.callbacks.on_step_end(self, loss)
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save_checkpoint()
                    t = time.perf_counter()  # checkpoint time does not count as training
                    if not rt.checkpoint_at_epoch_end and self.stop_signalled(mid_epoch=True):
                        break  # mid-epoch: the checkpoint holds the exact position
                    if rt.epoch_cut() or self._stop:
                        break
                if self.stopped is not None:
                    break
                # a rank that ended its epoch early counts the steps it skipped, as the
                # rest do
                if not self._stop:
                    self.step += self.loader.steps_from(self.position)
                self.progress.close()
                self.end_epoch()
                diverged = not math.isfinite(self.last["train_loss"])
                if (self.checkpointing and rt.checkpoint_at_epoch_end
                        and self.epoch < cfg.epochs and not diverged):
                    self.save_checkpoint()  # (the last one is written below)
                if (self.elastic is not None and rt.checkpoint_at_epoch_end
                        and self.epoch < cfg.epochs and not diverged):
                    self.elastic.commit_epoch(self)
                if (rt.checkpoint_at_epoch_end and self.epoch < cfg.epochs and not diverged
                        and self.stop_signalled(mid_epoch=False)):
                    break  # a parameter server: between epochs only
            if not diverged and self.stopped is None:
                if self.checkpointing:
                    self.save_checkpoint()
                self.save_model()
        finally:
            self.progress.close()
        rt.finish()
        self.share_stop()
        self.callbacks.on_fit_end(self)
        if diverged:
            raise self.divergence()
        return self.last

    # -- preemption
    def stop_signalled(self, mid_epoch):
        """Collective over the training ranks (when preemption is on): whether any rank
        received a stop signal. If so, write the checkpoint of this exact position (unless
        one was just written at this step), set ``self.stopped`` and return True."""
        if self.preemption is None:
            return False
        signum = self.runtime.agree_max(self.preemption.received)
        if not signum:
            return False
        from mpidl.training.preempt import signal_name  # noqa: PLC0415

        step, path = self._last_checkpoint
        if step != self.step:
            if not self.checkpointing:
                self.paths["checkpoint_dir"] = self.paths.get("stop_checkpoint_dir")
            if self.paths.get("checkpoint_dir") is None:
                raise ConfigError("a stop signal came, but there is no folder to write its "
                                  "checkpoint in: give the Trainer paths['checkpoint_dir'] "
                                  "or paths['stop_checkpoint_dir']")
            path = self.save_checkpoint()
        self.stopped = {"signal": signal_name(signum), "step": self.step,
                        "epoch": self.epoch + 1 if mid_epoch else self.epoch,
                        "mid_epoch": mid_epoch, "checkpoint": path}
        self.log.debug(f"stopping: {self.stopped}")
        return True

    def share_stop(self):
        """Collective over every rank, servers included (when preemption is on): the
        root's ``stopped`` on every rank, so all of them exit with the same status."""
        if self.preemption is not None:
            self.stopped = self.runtime.bcast(self.stopped if self.is_root else None)

    def stop_message(self):
        """One line for the user about the stop (None when training was not stopped)."""
        s = self.stopped
        if not s:
            return None
        where = (f"at epoch {s['epoch']} step {s['step']}" if s["mid_epoch"] else
                 f"after epoch {s['epoch']} (step {s['step']})")
        return (f"stopped by {s['signal']} {where}; checkpoint {s['checkpoint']}; resume "
                "with --resume (or --resume auto)")

    def divergence(self):
        """The error for a NaN or infinite training loss: what happened and what to try."""
        r = self.last
        hint = "lower --lr or add --warmup-epochs"
        mode = getattr(getattr(self.runtime, "mode_cfg", None), "mode", None)
        if mode in ("async", "ssp"):
            hint += (f"; with --mode {mode}, stale gradients act as extra momentum: "
                     "try --momentum 0 (the README's parameter-server section has a recipe)")
        saved = (f"; checkpoints written before it are in {self.paths['checkpoint_dir']}"
                 if self.checkpointing else "")
        return TrainingDiverged(
            f"training diverged: the mean training loss of epoch {r['epoch']} is "
            f"{r['train_loss']} (step {r['step']}, lr {r['lr']:.4g}); {hint}. Nothing was "
            f"saved for this epoch{saved}", report=self.is_root)

    def end_epoch(self):
        """Evaluate, print the epoch's metrics, move to the next epoch."""
        self.log.debug(f"epoch {self.epoch + 1}: local train loss "
                       f"{self.stats.loss_sum / max(self.stats.steps, 1):.4f} over "
                       f"{self.stats.steps} step(s)")
        train = self.runtime.reduce({"loss_sum": self.stats.loss_sum,
                                     "steps": self.stats.steps}, "sum")
        wall = time.perf_counter() - self.epoch_start  # every rank is done by now
        results = self.evaluate()
        seconds = self.stats.seconds
        record = {
            "epoch": self.epoch + 1,
            "step": self.step,
            "lr": self.lr_at(max(self.step - 1, 0) if self._last_sched is None
                             else self._last_sched),
            "train_loss": train["loss_sum"] / max(train["steps"], 1),
            **results,
            "images_per_sec": self.stats.images / seconds if seconds > 0 else 0.0,
            "epoch_time": seconds,
            "epoch_wall": wall,
            "elapsed": self.elapsed(),
            "ranks": self.count,
            "global_batch": self.loader.global_batch_size,
        }
        record.update(self.runtime.metrics() or {})
        if self.elastic is not None and self.elastic.events:
            record["elastic_failures"] = list(self.elastic.events)
        self.last = record
        if self.metrics is not None:
            self.metrics.write(record)
        self.epoch += 1
        self.batch = 0
        self.position = 0
        self.stats = EpochStats()
        self.callbacks.on_epoch_end(self, record)

    def elapsed(self):
        return self.seconds_before + time.perf_counter() - self.t_start

    def evaluate(self):
        """The task's metrics on the test set: each rank takes a contiguous piece, the
        task's sums are added over the ranks."""
        self.runtime.prepare_eval()
        self.model.eval()
        sums = {}
        try:
            for x, y in self.runtime.eval_batches(self.dataset.test_x, self.dataset.test_y,
                                                  self.cfg.eval_batch_size,
                                                  dtype=self.cfg.dtype):
                for k, v in self.task.eval_sums(self.model, x, y).items():
                    sums[k] = sums.get(k, 0) + v
        finally:
            # (what the forwards kept for a backward that never comes: freed now, not
            # when the next step's forwards replace it, nor held after training ends)
            self.model.discard_saved()
            self.model.train()
        if not sums:  # an empty test piece: the same keys, zero
            sums = {k: 0 for k in ("loss_sum", "correct", "n")}
        results = self.task.eval_metrics(self.runtime.reduce(sums, "sum"))
        self.callbacks.on_evaluate(self, results)
        return results

    # -- checkpoints
    def resume_config(self):
        from mpidl.config import RESUME_KEYS  # noqa: PLC0415

        out = {k: getattr(self.cfg, k, None) for k in RESUME_KEYS}
        out["ranks"] = self.count
        out["resizable"] = self.runtime.resumes_resized  # (not compared: check_compatible)
        return out

    def checkpoint_state(self):
        """Collective: (the state a checkpoint of this step holds, on the root, None
        elsewhere; this rank's ``Runtime.checkpoint_parts``)."""
        mine = {"rng": rng_states(self.model), "epoch_stats": self.stats.state_dict()}
        per_rank = self.runtime.gather(mine)
        runtime_state, own = self.runtime.checkpoint_state(self.step)
        parts = self.runtime.checkpoint_parts(self.model, self.optimizer)
        parts.own = own  # this rank's own arrays, for its rank shard
        if not self.is_root:
            return None, parts
        state = {
            "run": self.run_id,
            "config": self.resume_config(),
            "progress": self.position_state(),
            "model": parts.model,
            "optimizer": parts.optimizer,
            "ranks": per_rank,
            "runtime": runtime_state,
        }
        if parts.shards is not None:
            state["shards"] = dict(parts.shards, files=[
                ckpt.shard_name(self.step, i, parts.count) for i in range(parts.count)])
        if own.flat:
            state["rank_shards"] = {"files": own.files, "flat": own.flat}
        return state, parts

    def position_state(self):
        """Where the run is: a checkpoint's or an elastic commit's ``progress`` entry."""
        return {"step": self.step, "epoch": self.epoch, "batch": self.batch,
                "position": self.position, "global_batch": self.loader.global_batch_size,
                "elapsed": self.elapsed(), "last": dict(self.last)}

    def save_checkpoint(self):
        """Collective: gather every rank's RNG state, then the root writes atomically (the
        ranks holding pieces of the model write theirs first: shards)."""
        state, parts = self.checkpoint_state()
        self.checkpoints_written += 1
        crash = None
        if self.crash_in_checkpoint and self.crash_in_checkpoint[0] == self.checkpoints_written:
            crash = (self.crash_in_checkpoint[1] if len(self.crash_in_checkpoint) > 1
                     else 4096)
        directory = self.paths["checkpoint_dir"]
        # (the ranks writing shards agree first, so that no shard of a diverged run is
        # written; without shards the root checks the parameters it holds)
        finite = (self.runtime.parameters_finite(self.model, parts)
                  if parts.shard is not None or self.is_root else True)
        own = parts.own
        if own.flat:  # every rank writes its own state (residuals, ...) if the root will
            finite = self.runtime.bcast(finite if self.is_root else None)
        if parts.shard is not None and finite:  # the pieces first, then the index
            ckpt.save_shard(directory, self.step, parts.index, parts.count, parts.shard,
                            crash_after_bytes=crash)
            self.runtime.shards_written(parts)
        if own.flat and finite:
            if own.arrays:  # (the test hook's crash: in the first file this rank writes)
                ckpt.save_shard(directory, self.step, own.index, own.count, {"pieces": [
                    [place, 0, a.reshape(-1)] for place, a in own.arrays]}, kind="rank",
                    crash_after_bytes=crash if parts.shard is None else None)
            self.runtime.rank_shards_written()
        path = None
        if self.is_root and not finite:
            self.log.warning(f"not writing a checkpoint at step {self.step}: the parameters "
                             "are not finite (training diverged); the last finite "
                             f"checkpoint stays the newest in {directory}")
        elif self.is_root:
            for shards in ("shards", "rank_shards"):
                if shards in state:
                    ckpt.check_shards_visible(directory, state[shards]["files"])
            path = ckpt.save(self.paths["checkpoint_dir"], self.step, state,
                             keep=self.cfg.keep_checkpoints, crash_after_bytes=crash)
            self.log.debug(f"checkpoint {path}")
        self._last_checkpoint = (self.step, path)
        self.callbacks.on_checkpoint(self, path)
        return path

    def local_state(self):
        """This rank's state at this step, in a checkpoint's layout, without communicating
        (an elastic run's commit, ``mpidl.training.elastic``, which copies it; only for
        runtimes whose ranks each hold the whole state, ``Runtime.resizable``). The model's
        and optimizer's arrays are the live ones, not copies."""
        rt = self.runtime
        rt.gather_params()  # (mixed precision: the 2-byte working copies decoded)
        return {
            "run": self.run_id,
            "config": self.resume_config(),
            "progress": self.position_state(),
            "model": dict(self.model.state_dict()),
            "optimizer": self.optimizer.state_dict(copy=False),
            "ranks": [{"rng": rng_states(self.model), "epoch_stats": self.stats.state_dict()}],
            "runtime": rt.local_state(),
        }

    def _usable(self, path, state):
        """CheckpointError unless ``state`` is a training checkpoint that fits this model
        (names and shapes)."""
        ckpt.check_training_state(path, state)
        own = self.runtime.full_shapes(self.model)
        saved = state.get("model") or {}
        if set(saved) != set(own):
            raise ckpt.CheckpointError(f"{path}: its model has other parameters than this one")
        for k, shape in own.items():
            if tuple(np.shape(saved[k])) != shape:
                raise ckpt.CheckpointError(f"{path}: its {k!r} has shape "
                                           f"{tuple(np.shape(saved[k]))}, this model's {shape}")

    @property
    def _split(self):
        """Whether this rank holds only part of the model or of the optimizer state
        (tensor or pipeline parallelism, ZeRO's shards): then it needs only part of a
        checkpoint."""
        rt = self.runtime
        return (getattr(rt, "tp", None) is not None or getattr(rt, "pp", None) is not None
                or getattr(rt, "shards_checkpoints", False))

    def restore(self):
        """Collective: the root finds the newest checkpoint, every rank loads it (a split
        model's: the root checks it, each rank reads its own part from disk)."""
        directory = self.paths.get("checkpoint_dir")
        payload = None
        if self.is_root:
            try:
                ckpt.remove_stale_temporaries(directory)
                skipped = []
                # left on disk: a split model's tensors (each rank reads its part) and
                # every rank's own state (its rank shard); the rest is read here
                path, state = ckpt.latest(directory, warn=skipped.append,
                                          check=self._usable, read=False)
                for why in skipped:
                    self.log.warning(why)
                if path is not None:
                    self.check_compatible(path, state["config"])
                    if not self._split:
                        state = ckpt.read_shared(state)
                elif skipped:  # starting over there would mix two runs in one folder
                    raise ConfigError(
                        f"--resume: none of the {len(skipped)} checkpoint(s) in {directory} "
                        f"can continue this run (newest: {skipped[0].split(': ', 1)[-1]}); "
                        "use another --out-dir or --checkpoint-dir, or move them away")
                payload = ("ok", path, state)
            except UserError as e:  # (found on the root alone: every rank says it)
                payload = ("error", str(e), None)
        kind, path, state = self.runtime.bcast(payload)
        if kind == "error":
            raise AgreedUserError(path)
        if path is None:
            self.log.info(f"--resume: no checkpoint in {directory}; starting from scratch")
            return False
        self.load_state(state)
        if self.is_root:  # the epochs this run replays must not appear twice
            truncate_metrics(self.paths.get("metrics"), self.epoch)
        saved, resized = state["config"].get("ranks"), ""
        if saved is not None and saved != self.count:
            resized = (f"; written by {saved} data-parallel rank(s), continued on "
                       f"{self.count}: the "
                       f"epoch's other samples are dealt in global batches of "
                       f"{self.loader.global_batch_size}")
        # a padded last global batch takes the position past the epoch's end
        done = min(self.position, self.loader.num_samples)
        self.log.info(f"resumed from {path}: step {self.step}, epoch {self.epoch + 1}, "
                      f"position {done}/{self.loader.num_samples}{resized}")
        return True

    def load_state(self, state):
        """Take a checkpoint's state (read by ``restore``, or an elastic run's commit):
        model, optimizer, this rank's RNGs and running sums, the runtime's state, where
        the loop stands. Collective over the runtime's ranks."""
        self.runtime.load_full_state(self.model, self.optimizer, state["model"],
                                     state["optimizer"])
        per_rank = state["ranks"]
        saved_count = state["config"].get("ranks", len(per_rank))
        index = self.shard_rank_index()
        if saved_count == self.count and len(per_rank) == len(self.runtime.trainer_ranks):
            mine = per_rank[index]
        else:  # resized: rank i takes the RNGs of the i-th saved rank (the first ones
            #   when there are more now), its running sums only if there was one
            mine = dict(per_rank[index % len(per_rank)])
            if index >= len(per_rank):
                mine["epoch_stats"] = None
        set_rng_states(self.model, mine["rng"])
        self.runtime.load_state_dict(state.get("runtime"))
        self.run_id = state.get("run") or self.run_id
        p = state["progress"]
        self.step, self.epoch, self.batch = int(p["step"]), int(p["epoch"]), int(p["batch"])
        saved_global = p.get("global_batch")
        if (self.keeps_global_batch and saved_global
                and saved_global != self.loader.global_batch_size):
            self.use_global_batch(saved_global)
        # (checkpoints before positions were saved: the same rank count, a batch's worth)
        self.position = int(p.get("position", self.batch * self.loader.global_batch_size))
        self.stats = EpochStats.from_state(mine["epoch_stats"])  # this rank's own sums
        self.seconds_before = float(p["elapsed"])
        self.last = p.get("last") or {}

    def shard_rank_index(self):
        """This rank's entry in the checkpoint's per-rank list (the order of ``gather``:
        every training rank, each of a tensor-parallel group and of a pipeline too)."""
        rt = self.runtime
        return rt.trainer_ranks.index(rt.rank) if rt.trains_on_data else 0

    def check_compatible(self, path, saved):
        now = self.resume_config()
        ignore = {"resizable"}
        if self.runtime.resumes_resized and saved.get("resizable"):
            # continues on any number of ranks; data parallelism on one process too
            ignore.add("ranks")
            one = {"local": "allreduce"}
            if one.get(saved.get("strategy"), saved.get("strategy")) == \
                    one.get(now["strategy"], now["strategy"]):
                ignore.add("strategy")
        now = {k: v for k, v in now.items() if k not in ignore}
        label = {"ranks": "data-parallel ranks"}  # (the replicas: tp and pp ranks apart)
        diff = [f"{label.get(k, k)}: checkpoint {saved.get(k)!r}, now {now[k]!r}"
                for k in now if saved.get(k) != now[k]]
        if diff:
            raise ConfigError(f"cannot resume from {path}: it was written with other settings "
                              f"({'; '.join(diff)}); use the same settings or another "
                              "--checkpoint-dir")

    def save_model(self):
        path = self.paths.get("save")
        if not path:
            return None
        # collective, every rank is here: the whole model's tensors come to the root one
        # at a time, each written before the next
        tensors = self.runtime.whole_tensors(self.model)
        if not self.is_root:
            for _ in tensors:
                pass
            return None
        meta = dict(self.model_meta, step=self.step, epochs=self.epoch,
                    test_acc=self.last.get("test_acc"))
        try:
            ckpt.save_model(path, tensors, meta)
        except OSError as e:  # the final checkpoint (written just before) holds the model
            for _ in tensors:  # (the other ranks are still sending theirs)
                pass
            kept = (f"; the final checkpoint in {self.paths['checkpoint_dir']} holds the "
                    "trained model: mpidl train --resume with the same settings and another "
                    "--save writes it again" if self.checkpointing else
                    "; with --checkpoint-dir a checkpoint would have kept it")
            raise ckpt.CheckpointWriteError(f"cannot write the final model {path} "
                                            f"({e.strerror or e}){kept}") from None
        self.log.info(f"saved the model to {path}")
        return path


def keeps_global_batch(runtime, keep_batch):
    """Whether ``runtime``'s run keeps its global batch when its number of ranks changes
    (``--keep-batch global``, the default for data parallelism: the steps, schedule and
    results of the run without the change, up to rounding), rather than its per-rank
    batch (``--keep-batch rank``; local SGD and the parameter server always do that:
    their ranks step alone or push alone)."""
    if keep_batch == "rank":
        return False
    zero = runtime.name.startswith("allreduce+zero")  # (its pieces are cut anew)
    return ((runtime.name in ("local", "allreduce") or zero) and runtime.resumes_resized
            and getattr(runtime.schedule, "k", 1) == 1)


def epoch_end_checkpoints_only(strategy):
    """The one-line refusal of --checkpoint-every for a strategy that cannot honour it."""
    return (f"--checkpoint-every is not supported with --strategy {strategy}: its "
            "checkpoints are written at the end of every epoch, the only moment the servers "
            "and all workers agree on the parameters (drop --checkpoint-every; "
            "--checkpoint-dir turns them on)")


def _settings(config, settings):
    """The trainer's settings: the core options' defaults < ``config`` < ``settings``."""
    from mpidl.config import CORE_OPTIONS  # noqa: PLC0415

    values = {o.name: o.default for o in CORE_OPTIONS}
    values["given"] = ()
    if config is not None:
        values.update(vars(config))
    unknown = sorted(k for k in settings if k not in values)
    if unknown:
        raise TypeError(f"Trainer got unknown setting(s) {unknown}; settings are the "
                        f"options of mpidl train: {', '.join(o.name for o in CORE_OPTIONS)}")
    values.update(settings)
    return SimpleNamespace(**values)


def schedule_factory(kind):
    """A function (base_lr, total_steps, warmup_steps) -> lr schedule of ``kind``
    (constant, step: 10x down at half and three quarters, cosine, linear); the kind is
    checked now (ConfigError)."""
    from mpidl.engine.schedules import make_schedule  # noqa: PLC0415

    def factory(base_lr, total_steps, warmup_steps):
        extra = {}
        if kind == "step":  # decay by 10x at half and at three quarters
            extra["milestones"] = [max(1, total_steps // 2), max(1, total_steps * 3 // 4)]
        return make_schedule(kind, base_lr, max(total_steps, 1), warmup_steps=warmup_steps,
                             **extra)

    try:
        factory(0.1, 100, 0)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--schedule {kind!r}: {e}") from None
    return factory


def device_summary():
    dev = backend.device()
    return f"gpu {backend.gpu_id()}" if dev == "gpu" else "cpu"

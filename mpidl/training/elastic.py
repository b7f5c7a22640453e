"""Elastic training (``--elastic``): a rank dies, the others go on, exactly.

With ULFM (``mpidl.comm.ft``) a dead rank is an error the survivors see instead of the
end of the job. A run then goes through *generations*: each one builds the communicator,
the model, the runtime and the trainer over the ranks alive, and trains until it ends or
a rank dies. On a failure every survivor

1. revokes every communicator it holds, so that no survivor stays blocked in a call
   that waits for a live rank which has already left it;
2. shrinks the world to the survivors (in their old order) and learns who died;
3. agrees with the others on the *commit* to go back to: every K-th step
   (``--elastic-commit-every``) each rank keeps in memory the state at that step's start
   (model, optimizer, where the loop stands, its RNGs and running sums), the last two of
   them. A failure can leave survivors one step apart (a rank that got its all-reduce's
   result before the death went on to the next step), so they take the newest commit
   all of them have (the smallest newest step), and check that their replicas of it are
   bitwise the same;
4. starts the next generation from that commit, through the same code that resumes a
   checkpoint on another number of ranks (``Trainer.load_state``): the samples of the
   epoch not yet consumed are dealt over the survivors, so every sample is still seen
   once that epoch. Data parallelism keeps its global batch (``--keep-batch global``, the
   survivors take larger pieces), so it goes on with the updates of the run without the
   failure; with ``--keep-batch rank`` the global batch and ``--scale-lr`` follow the
   ranks.

So a run that loses rank k at step s continues exactly as a fresh run resumed from a
checkpoint of step s on the remaining ranks would (the test compares the two bitwise),
and with the global batch kept, within 1e-12 of the run that lost nobody.
The commit costs a copy of the model and optimizer state every K steps; a failure
repeats at most K - 1 steps.

What it covers (``Runtime.resizable``): data parallelism, where every replica holds the
whole state; local SGD / DiLoCo, whose commits are the starts of periods (the one moment
the replicas agree; each rank's inner optimizer state is its own), so the next averaging
is over the survivors; and the parameter server, whose ranks each hold a piece: its
commits are its checkpoints' state at the end of every epoch (the one moment servers and
workers agree), built on the root worker and handed to every worker, so that any death,
a server's included, goes back to the last epoch's end and the survivors (the first of
them serving) redo the epoch. Layouts whose ranks hold pieces no other rank has a copy of
(ZeRO, tensor and pipeline parallelism, compression with error feedback, worker groups,
dealt portions) are refused with one line.
"""

import time
import zlib

import numpy as np

from mpidl.comm import ft
from mpidl.errors import AgreedUserError, ConfigError, UserError
from mpidl.training.log import get_logger

#: generations after which the run gives up (every one of them lost a rank)
MAX_GENERATIONS = 64


def check(runtime, size):
    """ConfigError when this launch cannot run ``--elastic`` (before training)."""
    if size == 1:
        return
    why = ft.why_not_elastic()
    if why is not None:
        raise ConfigError(f"--elastic: {why}")
    if not runtime.resizable:
        raise ConfigError(
            f"--elastic goes on without the dead rank's state, so it needs ranks whose "
            f"state another rank holds too (data parallelism, local SGD, DiLoCo, the "
            f"parameter server); --strategy {runtime.name} with these settings keeps "
            "state on one rank only (refused: --zero, --tensor-parallel, --pipeline-stages, "
            "--hybrid, --compression, --group-size, --deal, hogwild): drop --elastic, or "
            "those")


class Commits:
    """This rank's last commits: ``(step, state)``, the state at a step's start in the
    layout of a checkpoint. A *local* commit (data parallelism, local SGD: taken by every
    rank alone, the last two kept) holds this rank's own entry under ``"ranks"``; an
    *epoch* commit (the parameter server, whose ranks each hold a piece: taken at the end
    of every epoch like its checkpoints, on the root, and handed to every worker; the
    last one kept) is the whole checkpoint state."""

    def __init__(self, every=10, replicas=2):
        self.every = int(every)
        self.replicas = int(replicas)  # workers keeping an epoch commit (--server-replicas)
        self.kept = []  # [(step, state, whole)]
        self.events = []  # one record per failure survived (for the metrics)
        self._watch = None  # (event, step gone back to): report its first step done

    def before_step(self, trainer):
        watch = self._watch
        if watch is not None and watch[1] < 0:  # back to disk or the start: now we know
            event = watch[0]
            event["step"] = trainer.step
            event["steps_repeated"] = max(event["steps_repeated"] - trainer.step, 0)
            watch = self._watch = (event, trainer.step)
        if watch is not None and trainer.step > watch[1]:
            watch[0]["went_on_s"] = round(time.time() - watch[0]["detected_at"], 4)
            self._watch = None
            if trainer.is_root:
                get_logger().info(
                    f"elastic: step {watch[1] + 1} done on {trainer.count} rank(s), "
                    f"{watch[0]['went_on_s']:.3f} s after the failure was seen")
        if (not trainer.runtime.commit_point(trainer.step, self.every)
                or (self.kept and self.kept[-1][0] == trainer.step)):
            return
        # the older commit's arrays are reused (allocating them anew each time cost as
        # much as the copy)
        reuse = self.kept[0][1] if len(self.kept) == 2 else None
        state = _copy(trainer.local_state(), reuse)
        self.kept = self.kept[-1:] + [(trainer.step, state, False)]

    def commit_epoch(self, trainer):
        """Collective over the training ranks, at the end of an epoch of a runtime that
        checkpoints only there: the checkpoint's state, built on the root, kept by the
        first ``replicas`` workers (the root first; the servers learn it back when a rank
        dies). With no replica nothing is kept: a death goes back to the last checkpoint
        on disk."""
        if self.replicas < 1:
            return
        state, _ = trainer.checkpoint_state()
        if state is not None:  # the root's holds live arrays (a checkpoint writes at once)
            state = _copy(state)
        state = trainer.runtime.share(state, copies=self.replicas)
        self.kept = [] if state is None else [(trainer.step, state, True)]

    def agree(self, comm):
        """Collective over the survivors' ``comm`` (mpi4py): (step, the state to go on
        from). The newest commit every survivor that keeps commits has; a local commit
        with every survivor's own entry gathered under ``"ranks"`` (in rank order) after
        checking the replicas agree, an epoch commit sent from the first survivor that
        holds it to those that do not (servers). (-1, None) when nobody holds one."""
        kept = comm.allgather([s for s, _, _ in self.kept])
        offers = [steps[-1] for steps in kept if steps]
        if not offers:  # a rank died before the first commit: start again
            self.kept = []
            return -1, None
        step = min(offers)
        holders = [r for r, steps in enumerate(kept) if step in steps]
        found = [(state, whole) for s, state, whole in self.kept if s == step]
        whole = comm.bcast(found[0][1] if comm.Get_rank() == holders[0] else None,
                           root=holders[0])
        if whole:
            state = comm.bcast(found[0][0] if comm.Get_rank() == holders[0] else None,
                               root=holders[0])
            self.kept = [(step, state, True)]
            return step, state
        if len(holders) != comm.Get_size():
            missing = sorted(set(range(comm.Get_size())) - set(holders))
            raise RuntimeError(f"elastic: ranks {missing} hold no commit of step {step} "
                               f"(they kept {kept}); cannot go on")
        mine = found[0][0]
        digests = comm.allgather(_digest(mine["model"]))
        if len(set(digests)) != 1:
            raise RuntimeError(f"elastic: the survivors' copies of step {step}'s model differ "
                               f"(digests {digests}); replicas were not in step")
        self.kept = [(step, mine, False)]  # (with this rank's own entry, for a later death)
        return step, dict(mine, ranks=comm.allgather(mine["ranks"][0]))


def _copy(obj, reuse=None):
    """A deep copy of ``obj`` (dicts, lists, arrays, plain values), writing each array
    into the matching one of ``reuse`` (an earlier copy of the same layout) when its
    shape and dtype fit."""
    if isinstance(obj, dict):
        reuse = reuse if isinstance(reuse, dict) else {}
        return {k: _copy(v, reuse.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        reuse = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) \
            else [None] * len(obj)
        return type(obj)(_copy(v, r) for v, r in zip(obj, reuse))
    if hasattr(obj, "shape") and hasattr(obj, "dtype") and getattr(obj, "ndim", 0):
        if (type(reuse) is type(obj) and reuse.shape == obj.shape
                and reuse.dtype == obj.dtype):
            reuse[...] = obj
            return reuse
        return obj.copy()
    return obj


def _digest(model_state):
    crc = 0
    for name in sorted(model_state):
        crc = zlib.crc32(np.ascontiguousarray(model_state[name]).view(np.uint8), crc)
    return crc


def _death_explains(error):
    """Whether ``error`` comes of a rank's death: an MPI failure error, or any error but
    the user's raised while a death is known (``ft.died_meanwhile``)."""
    return ft.is_failure(error) or (not isinstance(error, UserError) and ft.died_meanwhile())


def _survive(mpi_comm, agree):
    """Revoke, shrink to the survivors and call ``agree(comm)`` over them; all again if a
    rank dies meanwhile. Returns (the survivors' communicator, the dead world ranks,
    what ``agree`` returned)."""
    dead = []
    while True:
        mpi_comm, lost = ft.survivors(mpi_comm)
        dead += lost
        try:
            return mpi_comm, dead, agree(mpi_comm)
        except Exception as e:
            if not ft.is_failure(e):
                raise


class ElasticRun:
    """Runs ``start(world, state, later) -> Trainer`` generation after generation (see the
    module doc). ``world``: the command line's ``World``; ``start`` builds a generation's
    trainer over a ``World`` (the model and optimizer anew for every ``later``
    generation) and makes it begin from ``state`` (None: from scratch, or from disk)."""

    def __init__(self, world, start, every=10, replicas=2):
        self.world = world
        self.start = start
        self.commits = Commits(every, replicas)
        self.from_disk = False  # no commit survived: the next generation resumes from disk
        self.log = get_logger()

    def run(self):
        world, state = self.world, None
        mpi_world = world.mpi
        for generation in range(MAX_GENERATIONS):
            trainer = None
            try:
                trainer = self.start(world, state, later=generation > 0)
                trainer.elastic = self.commits
                if self.from_disk and trainer.paths.get("checkpoint_dir"):
                    trainer.cfg.resume = True
                trainer.fit()
                return trainer
            except AgreedUserError as e:  # said once, by the survivors' first rank
                if e.report is None:
                    e.report = world.rank == 0
                raise
            except Exception as e:
                if not _death_explains(e):
                    raise
                at = (trainer.step if trainer is not None and trainer.runtime.trains_on_data
                      else -1)
                mpi_world, state = self.recover(mpi_world, e, at)
                world = type(world).over(mpi_world)
        raise RuntimeError(f"elastic: {MAX_GENERATIONS} failures; giving up")

    def recover(self, mpi_world, error, at=-1):
        """Revoke, shrink, agree on the commit; again if a rank dies meanwhile.
        ``at``: the step this rank was in (-1: none, a server). Returns (the survivors'
        communicator, the state to go on from)."""
        detected = time.time()
        mpi_world, dead, ((step, state), furthest) = _survive(
            mpi_world, lambda c: (self.commits.agree(c), max(c.allgather(at))))
        self.from_disk = state is None
        event = {"failed_ranks": sorted(dead), "step": step, "ranks": mpi_world.Get_size(),
                 # (when no commit survived: the steps done; the first step says from where)
                 "steps_repeated": max(furthest - max(step, 0), 0),
                 "detected_at": round(detected, 4),
                 "recovered_s": round(time.time() - detected, 4)}
        self.commits.events.append(event)
        self.commits._watch = (event, step)
        if mpi_world.Get_rank() == 0:
            what = str(error).split("\n")[0]
            if state is None:
                where = ("from the last checkpoint on disk, if any, else from the start (no "
                         "commit in memory: it died before the first one, every worker "
                         "that kept the parameter server's died, or it keeps none, "
                         "--server-replicas 0)")
            else:
                p = state["progress"]
                where = (f"from step {step} (epoch {int(p['epoch']) + 1}, "
                         f"{int(p['position'])} samples of it done; "
                         f"{event['steps_repeated']} step(s) to do again)")
            self.log.warning(
                f"elastic: rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} "
                f"died ({what}); {mpi_world.Get_size()} rank(s) go on {where}, recovered in "
                f"{event['recovered_s']:.3f} s")
        return mpi_world, state


# -- a loop of your own (Horovod's elastic state, for mpidl's Communicator)

class State:
    """What a training loop of your own goes back to when a rank dies (``run``): an
    mpidl ``model`` and ``optimizer`` (either may be None) and any values given as
    keywords (``epoch=0, batch=0``, arrays...), read and set as attributes
    (``state.epoch += 1``).

    ``commit()`` keeps a copy of all of it in this rank's memory (the last two commits;
    it costs a copy of the model and optimizer state). After a death every survivor goes
    back to the newest commit all of them hold (they may be one commit apart), checks
    that their models agree, and ``fn(state)`` is called again. ``state.comm`` is the
    mpidl Communicator of the ranks alive (a new one after each death);
    ``state.failures`` lists what was survived (dead world ranks, the commit gone back to).
    """

    def __init__(self, model=None, optimizer=None, **values):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "comm", None)
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "failures", [])
        object.__setattr__(self, "_kept", [])

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"State has no value {name!r}: give it as a keyword "
                                 f"(State(model, optimizer, {name}=...))") from None

    def __setattr__(self, name, value):
        if name in ("model", "optimizer", "comm", "commits", "failures"):
            object.__setattr__(self, name, value)
        else:
            self._values[name] = value

    def commit(self):
        """Keep the state of this moment to go back to (local, no communication)."""
        self.commits += 1
        snap = {"model": dict(self.model.state_dict()) if self.model is not None else {},
                "optimizer": (self.optimizer.state_dict(copy=False)
                              if self.optimizer is not None else None),
                "values": self._values}
        reuse = self._kept[0][1] if len(self._kept) == 2 else None
        self._kept[:] = self._kept[-1:] + [(self.commits, _copy(snap, reuse))]

    def _go_back(self, comm):
        """Collective over the survivors (mpi4py ``comm``): restore the newest commit
        every one of them holds; returns its number (0: none, the initial state kept)."""
        kept = comm.allgather([n for n, _ in self._kept])
        newest = min((numbers[-1] if numbers else 0) for numbers in kept)
        if newest == 0:
            raise RuntimeError("elastic: a rank died before the first State.commit(); "
                               "commit once before the loop starts")
        snap = next((s for n, s in self._kept if n == newest), None)
        if snap is None or not all(newest in numbers for numbers in kept):
            raise RuntimeError(f"elastic: the survivors hold commits {kept}; no commit all "
                               "of them hold (commit at the same points on every rank)")
        digests = comm.allgather(_digest(snap["model"]))
        if len(set(digests)) != 1:
            raise RuntimeError(f"elastic: the survivors' models of commit {newest} differ "
                               f"(digests {digests}); commit where the replicas agree")
        if self.model is not None:
            self.model.load_state_dict(snap["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(snap["optimizer"])
        object.__setattr__(self, "_values", _copy(snap["values"]))
        self._kept[:] = [(newest, snap)]
        self.commits = newest
        return newest


def run(fn, state, comm=None):
    """Call ``fn(state)`` until it returns, and return what it returns; when a rank
    dies, the survivors revoke and shrink their communicators, go back to the newest
    commit of ``state`` they all hold, and call ``fn(state)`` again with ``state.comm``
    over them. ``comm``: the mpi4py communicator to start from (default
    ``MPI.COMM_WORLD``); it needs an MPI whose survivors go on (Open MPI 5 with
    ``mpiexec --with-ft ulfm``: ``ConfigError`` otherwise). ``fn`` must reach its commits
    in the same order on every rank and take its data's share from ``state.comm`` (rank,
    size), which changes after a death."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.comm import Communicator  # noqa: PLC0415

    mpi = MPI.COMM_WORLD if comm is None else comm
    if mpi.Get_size() > 1:
        why = ft.why_not_elastic()
        if why is not None:
            raise ConfigError(f"mpidl.training.elastic.run: {why}")
    mpi.Set_errhandler(MPI.ERRORS_RETURN)
    if not state.commits:
        state.commit()  # the state at the start: something to go back to
    for _ in range(MAX_GENERATIONS):
        state.comm = Communicator(mpi, label="world")
        try:
            return fn(state)
        except Exception as e:
            if not _death_explains(e):
                raise
            detected = time.time()
            mpi, dead, back_to = _survive(mpi, state._go_back)
            state.failures.append({"failed_ranks": sorted(dead), "commit": back_to,
                                   "ranks": mpi.Get_size(),
                                   "recovered_s": round(time.time() - detected, 4)})
    raise RuntimeError(f"elastic: {MAX_GENERATIONS} failures; giving up")

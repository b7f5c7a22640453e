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
   epoch not yet consumed are dealt in global batches of the new size, so every sample
   is still seen once that epoch, and what depends on the number of ranks (the global
   batch, ``--scale-lr``) follows it.

So a run that loses rank k at step s continues exactly as a fresh run resumed from a
checkpoint of step s on the remaining ranks would (the test compares the two bitwise).
The commit costs a copy of the model and optimizer state every K steps; a failure
repeats at most K - 1 steps.

What it covers (``Runtime.resizable``): data parallelism, where every replica holds the
whole state; and local SGD / DiLoCo, whose commits are the starts of periods (the one
moment the replicas agree; each rank's inner optimizer state is its own), so the next
averaging is over the survivors. Layouts whose ranks hold different pieces (ZeRO, tensor
and pipeline parallelism, the parameter server) are refused with one line.
"""

import time
import zlib

import numpy as np

from mpidl.comm import ft
from mpidl.errors import ConfigError
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
            f"--elastic goes on without the dead rank's state, so it needs ranks that each "
            f"hold the whole model (data parallelism, local SGD, DiLoCo); --strategy "
            f"{runtime.name} spreads state over the ranks (also refused: --zero, "
            "--tensor-parallel, --pipeline-stages, --hybrid, --compression): drop "
            "--elastic, or those")


class Commits:
    """This rank's last two commits: ``(step, state)``, the state at a step's start in
    the layout of a checkpoint (with this rank's own entry under ``"ranks"``)."""

    def __init__(self, every=10):
        self.every = int(every)
        self.kept = []
        self.events = []  # one record per failure survived (for the metrics)
        self._watch = None  # (event, step gone back to): report its first step done

    def before_step(self, trainer):
        watch = self._watch
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
        self.kept = self.kept[-1:] + [(trainer.step, _copy(trainer.local_state(), reuse))]

    def agree(self, comm):
        """Collective over the survivors' ``comm`` (mpi4py): the commit every survivor
        has, with every survivor's own entry gathered under ``"ranks"`` (in rank order)."""
        from mpi4py import MPI  # noqa: PLC0415

        newest = self.kept[-1][0] if self.kept else -1
        step = comm.allreduce(newest, op=MPI.MIN)
        if step < 0:  # a rank died before the first step: start again
            self.kept = []
            return step, None
        found = [state for s, state in self.kept if s == step]
        if not found:
            raise RuntimeError(f"elastic: no commit of step {step} on this rank (it kept "
                               f"{[s for s, _ in self.kept]}); cannot go on")
        mine = found[0]
        digests = comm.allgather(_digest(mine["model"]))
        if len(set(digests)) != 1:
            raise RuntimeError(f"elastic: the survivors' copies of step {step}'s model differ "
                               f"(digests {digests}); replicas were not in step")
        self.kept = [(step, mine)]  # (with this rank's own entry, for a later failure)
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


class ElasticRun:
    """Runs ``start(world, state) -> Trainer`` generation after generation (see the
    module doc). ``world``: the command line's ``World``; ``start`` builds a generation's
    trainer over a ``World`` (the model and optimizer anew for every generation but the
    first) and makes it begin from ``state`` (None: from scratch, or ``--resume``)."""

    def __init__(self, world, start, every=10):
        self.world = world
        self.start = start
        self.commits = Commits(every)
        self.log = get_logger()

    def run(self):
        world, state = self.world, None
        mpi_world = world.mpi
        for generation in range(MAX_GENERATIONS):
            try:
                trainer = self.start(world, state)
                trainer.elastic = self.commits
                trainer.fit()
                return trainer
            except Exception as e:
                if not ft.is_failure(e):
                    raise
                mpi_world, state = self.recover(mpi_world, e)
                world = type(world).over(mpi_world)
        raise RuntimeError(f"elastic: {MAX_GENERATIONS} failures; giving up")

    def recover(self, mpi_world, error):
        """Revoke, shrink, agree on the commit; again if a rank dies meanwhile.
        Returns (the survivors' communicator, the state to go on from)."""
        detected = time.time()
        dead = []
        while True:
            ft.revoke_all(mpi_world)
            ft.abandon_all()
            mpi_world, lost = ft.shrink(mpi_world)
            dead += lost
            try:
                step, state = self.commits.agree(mpi_world)
                break
            except Exception as e:
                if not ft.is_failure(e):
                    raise
        event = {"failed_ranks": sorted(dead), "step": step, "ranks": mpi_world.Get_size(),
                 "detected_at": round(detected, 4),
                 "recovered_s": round(time.time() - detected, 4)}
        self.commits.events.append(event)
        self.commits._watch = (event, step)
        if mpi_world.Get_rank() == 0:
            what = str(error).split("\n")[0]
            if state is None:
                where = "from the start (it died before the first step)"
            else:
                p = state["progress"]
                where = (f"from step {step} (epoch {int(p['epoch']) + 1}, "
                         f"{int(p['position'])} samples of it done)")
            self.log.warning(
                f"elastic: rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} "
                f"died ({what}); {mpi_world.Get_size()} rank(s) go on {where}, recovered in "
                f"{event['recovered_s']:.3f} s")
        return mpi_world, state

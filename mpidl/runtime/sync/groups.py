"""Worker groups of a parameter server (``--strategy ps --group-size G``, as SINGA's).

The workers (ranks ``S ..``) form consecutive groups of G; a group trains synchronously,
the groups asynchronously (or under SSP, sync, backup: the servers' ``--mode``). A step
of a group, on every one of its ranks:

1. the gradients are averaged over the group with the fused all-reduce of data
   parallelism (``fused.FusedAllreduce`` over the group's communicator: the same buckets,
   algorithms and overlap with backward; ``--algorithm``, ``--bucket-mb``, ``--overlap``);
2. the group's first rank, its *leader*, pushes that mean to the servers and pulls the
   parameters they answer with: the unchanged worker side (``pushpull.PushPull``), whose
   worker list is the leaders, so the servers see one worker per group;
3. the leader broadcasts the parameters to its group.

So the servers' modes, counts, barriers and checkpoints are about groups, and nothing on
a server knows a group has more than one rank. Every rank still trains on its own piece
of the data (the sharding over all workers does not change). The end-of-epoch barrier
(before evaluation and the trainer's collectives) is the leader's, followed by the same
broadcast, so every worker evaluates the barrier's parameters. ``--epoch-quorum`` ends a
group's epoch for all its ranks: the leader's "stop" travels with the broadcast.

``--group-size 1`` builds no group: the preset uses ``PushPull`` alone, as before groups.
With one group of every worker and ``--mode sync``, a step is data parallelism's (the
same all-reduce over as many ranks) followed by the same element-wise update on the
servers, so the training equals ``--strategy allreduce`` bit for bit.
"""

import time
from types import SimpleNamespace

from mpidl.backend import array_module
from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.fusion import MiB, plan
from mpidl.runtime.sync.base import GradSync

OPTIONS = [
    Option("group_size", int, 1, "--strategy ps: the workers form consecutive groups of G "
           "(SINGA's worker groups): gradients all-reduced inside a group, the group's first "
           "rank pushes to and pulls from the servers for it; --mode then applies across "
           "groups. G must divide the number of workers; default 1 (no groups)",
           "parallelism", metavar="G",
           check=lambda v: None if v >= 1 else "must be at least 1 (1: no groups)"),
]


def check_group_size(group_size, worker_ranks, servers):
    """The group size, checked against the worker ranks: a ``ConfigError`` naming what
    to change unless G >= 1 divides the number of workers."""
    g = 1 if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ConfigError(f"--group-size must be a whole number of workers, at least 1 (1: "
                          f"no groups), got {group_size!r}")
    w = len(worker_ranks)
    if w % g:
        serve = "rank 0 serves" if servers == 1 else f"ranks 0..{servers - 1} serve"
        fits = [d for d in range(1, w + 1) if w % d == 0]
        raise ConfigError(
            f"--group-size {g} does not divide the {w} worker(s) (ranks {worker_ranks[0]}.."
            f"{worker_ranks[-1]}; {serve}): use a group size that "
            f"divides {w} ({', '.join(map(str, fits))}), or start {servers} + a multiple of "
            f"{g} ranks (e.g. mpiexec -n {servers + g * -(-w // g)})")
    return g


def leaders(worker_ranks, group_size):
    """The first rank of every group: the only workers the servers know."""
    return list(worker_ranks)[::group_size]


class WorkerGroups(GradSync):
    """One worker of a group (module doc): all-reduce in the group, the leader's
    push/pull (``leader_sync``, a ``PushPull`` whose workers are the leaders), then a
    broadcast of the parameters from the leader."""

    name = "ps-worker-groups"
    updates_remotely = True

    def __init__(self, group_size, leader_sync, allreduce):
        super().__init__()
        self.group_size = int(group_size)
        self.leader_sync = leader_sync  # used on the leader only
        self.allreduce = allreduce      # a FusedAllreduce, set up over the group
        self.comm = None                # the group's Communicator
        self.group_index = None
        self.is_leader = False
        self.checkpoints = False
        self._pulled = False
        self._pushes_since_barrier = 0
        self._epoch_over = False
        self._wait = 0.0
        self._buffers = []

    @property
    def wants_hooks(self):
        return self.allreduce.wants_hooks

    def setup(self, ctx, named_params):
        """Collective over the workers: the groups are split from the data-parallel group
        (every worker, in rank order), then the all-reduce and the leader's worker side."""
        super().setup(ctx, named_params)
        dp = ctx.group
        g = self.group_size
        if dp.size % g:  # (the preset checked it against the same worker list)
            raise ConfigError(f"--group-size {g} does not divide the {dp.size} workers")
        self.group_index = dp.rank // g
        self.comm = dp.split(self.group_index, dp.rank, label=f"ps-group{self.group_index}")
        self.is_leader = self.comm.rank == 0
        self.allreduce.setup(SimpleNamespace(group=self.comm, named_params=named_params,
                                             precision=None), named_params)
        if self.is_leader:
            rank = ctx.ps_comm.rank
            if rank not in self.leader_sync.worker_ranks:
                raise RuntimeError(f"worker rank {rank} leads group {self.group_index}, but "
                                   "the servers were given the leaders "
                                   f"{self.leader_sync.worker_ranks}")
            self.leader_sync.checkpoints = self.checkpoints
            self.leader_sync.setup(ctx, named_params)
        # the parameters travel from the leader in flat buffers laid out like the
        # gradient buckets; the last one carries one more element, the leader's
        # --epoch-quorum "stop" (0 or 1), so a group leaves an epoch together
        self._buffers = []
        layout = plan(named_params, int(self.allreduce.bucket_mb * MiB))
        for i, pairs in enumerate(layout):
            first = pairs[0][1].data
            xp = array_module(first)
            extra = 1 if i == len(layout) - 1 else 0
            buf = xp.zeros(sum(p.data.size for _, p in pairs) + extra, dtype=first.dtype)
            self._buffers.append((f"params{i}", pairs, buf))

    # -- a step
    def begin_step(self):
        first = not self._pulled
        self._pulled = True
        if self.is_leader:
            self.leader_sync.begin_step()  # the first step pulls the servers' parameters
        if first:
            self._share_parameters()
        self.allreduce.begin_step()

    def on_grads_ready(self, names):
        self.allreduce.on_grads_ready(names)

    def finish(self):
        t = time.perf_counter()
        for _ in self.allreduce.finish():  # the group's mean gradient (bucket views)
            pass
        if self.is_leader:
            for _ in self.leader_sync.finish():  # push it, take the servers' answer
                pass
        self._share_parameters()
        self._pushes_since_barrier += 1
        self._wait = time.perf_counter() - t
        return iter(())  # the servers applied the update; nothing to step here

    def wait_seconds(self):
        return self._wait

    def _share_parameters(self):
        """The leader's parameters (and its "stop") to every rank of the group."""
        if not self._buffers:
            return
        leader = self.is_leader
        stop = leader and self.leader_sync.epoch_cut()
        last = len(self._buffers) - 1
        for i, (name, pairs, buf) in enumerate(self._buffers):
            if leader:
                offset = 0
                for _, p in pairs:
                    n = p.data.size
                    buf[offset:offset + n] = p.data.reshape(-1)
                    offset += n
                if i == last:
                    buf[-1] = 1 if stop else 0
            if self.comm.size > 1:
                self.comm.bcast(buf, root=0, name=name)
            if not leader:
                offset = 0
                for _, p in pairs:
                    n = p.data.size
                    p.data[...] = buf[offset:offset + n].reshape(p.data.shape)
                    offset += n
        self._epoch_over = bool(self._buffers[last][2][-1])

    def epoch_cut(self):
        """True once ``--epoch-quorum`` groups finished this epoch (the leader heard it
        from the servers; the broadcast told the group)."""
        return self._epoch_over

    # -- the epoch barrier
    def prepare_eval(self):
        self._epoch_barrier()

    def before_collective(self):
        self._epoch_barrier()

    def _epoch_barrier(self):
        """The leader meets the other groups at the servers' barrier and the group takes
        its parameters (once after any pushes: the same decision on every rank of the
        group, which pushed the same number of times)."""
        if self.comm is None or (self._pulled and self._pushes_since_barrier == 0):
            return
        self._pulled = True
        if self.is_leader:
            self.leader_sync.before_collective()
        self._pushes_since_barrier = 0
        self._share_parameters()

    # -- reporting
    def metrics(self):
        """The servers' counts (per group: one push per group and step), on the leaders;
        the root worker, which writes the metrics, leads the first group."""
        out = self.allreduce.metrics()
        if self.is_leader:
            out.update(self.leader_sync.metrics())
        return out

    def describe(self):
        ls = self.leader_sync
        groups = len(ls.worker_ranks)
        c = f", compression {ls.compressor.name}" if ls.compressor is not None else ""
        return [f"parameter server: {len(ls.server_ranks)} server(s), {groups} worker "
                f"group(s) of {self.group_size} (all-reduce inside a group, its first rank "
                f"pushes and pulls), mode {ls.mode_cfg.mode}{c}"] + self.allreduce.describe()

    def memory(self, ledger):
        self.allreduce.memory(ledger)
        ledger.add("mem_comm", [buf for _, _, buf in self._buffers])
        if self.comm is not None:  # the group's scratch (the runtime counts its own group's)
            ledger.extra("mem_comm", self.comm.buffer_nbytes())

    # -- checkpoints
    def state_dict(self):
        """The leader's worker state (on the root leader, with the servers' state); the
        other ranks of a group hold none (no compressor memory: the leader compresses)."""
        if self._pushes_since_barrier:
            raise RuntimeError("a parameter-server checkpoint can only be taken between "
                               "epochs (after the servers' barrier)")
        return self.leader_sync.state_dict() if self.is_leader else {"worker": None}

    def load_state_dict(self, state):
        if self.is_leader:
            self.leader_sync.load_state_dict(state)

    def finish_training(self):
        if self.is_leader:
            self.leader_sync.finish_training()

"""Gradients pushed to parameter servers, parameters pulled back (``--strategy ps``).

The workers' side of ``mpidl.ps``: ranks ``0 .. S-1`` are servers (``--servers S``), the
others workers. The parameters are sharded over the servers by size
(``mpidl.ps.sharding``); each server runs the optimizer for its shard only, so the
optimizer is *placed on the servers* (``mpidl.runtime.placement.OnServers``) and a
worker never steps one. ``--mode`` picks how pushes become updates (``mpidl.ps.modes``):
``sync``, ``async`` (Downpour), ``ssp --staleness s``, ``backup --wait k``, ``softsync
--wait c`` (n-softsync: every c gradients, each weighted by 1/staleness, make an update);
``--staleness-aware-lr`` divides async/SSP updates by the gradient's staleness.

A step: the first one pulls the servers' parameters; after backward, ``finish`` pushes
each server its shard's gradients (dense, row-sparse for Embedding, or compressed with
the same ``--compression`` as data parallelism, momentum correction included) and takes
the parameters the servers answer with.

Before evaluation and before any collective among the workers, every worker waits at
the servers' end-of-epoch barrier and takes the current parameters, so all workers
evaluate the same model whatever the mode; the barrier's answer also carries the servers'
counts (``ps_pushed = ps_applied + ps_dropped``). A worker sitting in a collective pushes
nothing, and the servers must know that, or a backup-mode quorum could wait for it
forever. ``--epoch-quorum K`` (async/ssp/backup): once K workers wait at that barrier,
the servers' answers tell the others to stop (``epoch_cut``).

Worker groups (``--group-size G``, ``groups.py``): the workers' gradients are first
all-reduced in groups of G, and this class runs on each group's first rank only, its
``worker_ranks`` being those leaders: the servers see one worker per group.

Checkpoints: the servers' optimizer state and the workers' parameters agree only at the
epoch barrier, so the trainer writes a checkpoint at the end of every epoch
(``checkpoint_at_epoch_end``); the root worker's barrier request then asks each server
for its shard's optimizer state, which ``state_dict`` merges (by parameter name, so a
resume may use another ``--servers``).
"""

import time

from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.ps.modes import MODES, ModeConfig
from mpidl.runtime.sync.base import GradSync

OPTIONS = [
    Option("servers", int, None, "--strategy ps or hogwild, or --sparse-sync ps: number of "
           "server ranks (ranks 0..S-1; parameters sharded over them); default 1",
           "parallelism", metavar="S",
           check=lambda v: None if v >= 1 else "must be at least 1"),
    Option("mode", str, None, "--strategy ps (or the servers' part of --sparse-sync ps): "
           "sync, async (Downpour), ssp (bounded "
           "staleness), backup (first k of n gradients) or softsync (each c gradients make "
           "an update, each weighted by 1/staleness); default sync", "parallelism",
           choices=(None,) + MODES),
    Option("staleness", int, None, "--mode ssp: a worker may run at most this many clocks "
           "ahead of the slowest", "parallelism", metavar="S",
           check=lambda v: None if v >= 0 else "must be at least 0"),
    Option("wait", int, None, "--mode backup: use the first K gradients of each step, drop "
           "the late ones (default: workers - 1); --mode softsync: gradients per update "
           "(default: workers)", "parallelism", metavar="K",
           check=lambda v: None if v >= 1 else "must be at least 1 (leave it out for the "
           "default)"),
    Option("epoch_quorum", int, None, "--mode async/ssp/backup: an epoch ends once K "
           "workers finished their share; the others skip the rest of theirs (default: "
           "all workers, so the slowest sets every epoch's length)", "parallelism",
           metavar="K", check=lambda v: None if v >= 1 else "must be at least 1 (leave it "
           "out for the default, all workers)"),
    Option("staleness_aware_lr", bool, False, "--mode async/ssp: divide the learning rate "
           "by each gradient's staleness", "parallelism"),
]


def mode_config(num_workers, mode=None, staleness=None, wait=None, staleness_aware_lr=None,
                epoch_quorum=None, deal=False):
    """The checked ``ModeConfig`` (the same on every rank)."""
    mode = mode or "sync"
    if wait is not None and mode not in ("backup", "softsync"):
        raise ConfigError(f"--wait applies to --mode backup or softsync (got --mode {mode})")
    if staleness is not None and mode != "ssp":
        raise ConfigError(f"--staleness applies to --mode ssp (got --mode {mode})")
    return ModeConfig(mode=(mode or "sync"), staleness=int(staleness or 0),
                      wait=int(wait or 0), staleness_aware_lr=bool(staleness_aware_lr),
                      epoch_quorum=int(epoch_quorum or 0), deal=bool(deal)).check(num_workers)


def check_servers(servers, size, strategy="ps"):
    num = 1 if servers is None else int(servers)
    if num < 1:
        raise ConfigError(f"--servers must be at least 1, got {num}")
    if size < num + 1:
        raise ConfigError(
            f"--strategy {strategy} with {num} server(s) needs at least {num + 1} ranks "
            f"(servers + at least one worker), but {size} were started: run under mpiexec -n "
            f"{num + 1} or more")
    return num


def check_compressor(compressor):
    if compressor is not None and compressor.multi_round:
        raise ConfigError(f"--compression {compressor.name} needs all-reduces between the "
                          "workers (its factors are averaged in rounds): use it with "
                          "--strategy allreduce; with ps use topk, dgc, onebit, qsgd, ...")


class PushPull(GradSync):
    """A worker's side of the parameter server (module doc)."""

    name = "ps-pushpull"
    updates_remotely = True

    def __init__(self, mode_cfg, server_ranks, worker_ranks, compressor=None, trace=False,
                 poll_max_s=1e-3):
        super().__init__()
        self.mode_cfg = mode_cfg
        self.server_ranks, self.worker_ranks = list(server_ranks), list(worker_ranks)
        self.compressor = compressor
        self.trace = trace
        self.poll_max_s = poll_max_s
        self.worker = None
        self.checkpoints = False
        self.is_root = False
        self.latest_stats = {}
        self.final_stats = None
        self._server_states = None
        self._pulled = False
        self._pushes_since_barrier = 0
        self._wait = 0.0
        self.dealing = mode_cfg.deal  # --deal portions

    def setup(self, ctx, named_params):
        from mpidl.ps.protocol import Poller  # noqa: PLC0415
        from mpidl.ps.sharding import shard_parameters  # noqa: PLC0415
        from mpidl.ps.worker import PSWorker  # noqa: PLC0415

        super().setup(ctx, named_params)
        self.optimizer = ctx.optimizer
        self.group = ctx.group
        self.model = ctx.model
        rank = ctx.ps_comm.rank
        self.is_root = rank == self.worker_ranks[0]
        layout = shard_parameters(named_params, len(self.server_ranks))
        memory = None
        if self.compressor is not None:  # per-worker random streams
            self.compressor.bind(self.worker_ranks.index(rank), len(self.worker_ranks))
            memory = self.compressor.memory
        poller = Poller(ctx.ps_comm, longest=self.poll_max_s, who=f"worker rank {rank}")
        self.worker = PSWorker(ctx.ps_comm, named_params, layout, self.server_ranks,
                               compressor=self.compressor, memory=memory, poller=poller)

    # -- a step
    def begin_step(self):
        if not self._pulled:  # every worker starts from the servers' parameters
            self._pulled = True
            self.worker.pull()
        self.worker.begin_step()

    def finish(self):
        if self.dealing:  # the schedule pushed each portion and took the update
            return iter(())
        t = time.perf_counter()
        self.worker.push(lr=getattr(self.optimizer, "lr", None))
        self._wait = time.perf_counter() - t
        self._pushes_since_barrier += 1
        return iter(())  # the servers applied the update; nothing to step here

    def start(self):
        """``finish`` in two halves: start sending this step's gradients (Parallax does
        its all-reduce before ``complete``)."""
        t = time.perf_counter()
        self.worker.send_push(lr=getattr(self.optimizer, "lr", None))
        self._wait = time.perf_counter() - t

    def complete(self):
        """Wait for the servers' answer and take the parameters."""
        t = time.perf_counter()
        self.worker.take_answer()
        self._wait += time.perf_counter() - t
        self._pushes_since_barrier += 1

    # -- dealt portions (``mpidl.runtime.dealing``): the schedule calls these
    def deal(self, portions):
        """The first portion of this step for this worker (or None: the update is taken)."""
        return self.worker.deal(portions)

    def push_portion(self, portion, portions, loss=None):
        """Push a computed portion (``loss``: its term of the batch's mean loss, which
        travels with it); the next one (or None: the update is taken)."""
        self._pushes_since_barrier += 1
        return self.worker.push_portion(portion, portions,
                                        lr=getattr(self.optimizer, "lr", None), loss=loss)

    def dealer_reply(self):
        """The header of the first server's last answer with parameters (what a server
        policy such as L-BFGS's says beside them)."""
        return self.worker.last_params.get(self.server_ranks[0], {})

    def wait_seconds(self):
        """Seconds this step's ``finish`` waited (dealt portions: their waits happen inside
        the schedule, which reports them itself)."""
        return 0.0 if self.dealing else self._wait

    def epoch_cut(self):
        """True once ``--epoch-quorum`` workers finished this epoch: stop it here."""
        return self.worker is not None and self.worker.epoch_over

    # -- the epoch barrier
    def prepare_eval(self):
        self._epoch_barrier()

    def before_collective(self):
        self._epoch_barrier()

    def _epoch_barrier(self):
        """Meet the other workers at the servers' barrier (once after any pushes)."""
        if self.worker is None or (self._pulled and self._pushes_since_barrier == 0):
            return
        self._pulled = True
        self.worker.barrier(want_state=self.checkpoints and self.is_root)
        self._pushes_since_barrier = 0
        self.latest_stats = self.worker.barrier_stats
        self._server_states = self.worker.server_states

    def metrics(self):
        """Counts summed over the servers, as of the last barrier (exact: nothing is in
        flight there); ``ps_pushed == ps_applied + ps_dropped``."""
        return summarize(self.final_stats or self.latest_stats)

    def describe(self):
        c = f", compression {self.compressor.name}" if self.compressor is not None else ""
        d = ", portions dealt on demand" if self.dealing else ""
        return [f"parameter server: {len(self.server_ranks)} server(s), "
                f"{len(self.worker_ranks)} worker(s), mode {self.mode_cfg.mode}{d}{c}"]

    # -- checkpoints
    def state_dict(self):
        """On the root worker, between epochs: the servers' optimizer state as of the last
        barrier (merged over the shards), their versions and counts. The workers'
        compressor memories travel as per-rank sync state (the runtime gathers them)."""
        if self._pushes_since_barrier:
            raise RuntimeError("a parameter-server checkpoint can only be taken between "
                               "epochs (after the servers' barrier)")
        mine = None
        if self.compressor is not None:
            memory = self.compressor.memory
            mine = {"compressor": self.compressor.state_dict(),
                    "memory": memory.state_dict() if memory is not None else {}}
        if not self.is_root:
            return {"worker": mine}
        states = self._server_states
        if states is None:
            raise RuntimeError("no optimizer state came with the last barrier: set "
                               "runtime.checkpoints = True before setup()")
        merged = dict(states[0]["optimizer"], state={})
        for st in states:
            merged["state"].update(st["optimizer"]["state"])
        return {"worker": mine, "servers": {
            "optimizer": merged, "versions": [st["version"] for st in states],
            "counts": [st.get("counts") for st in states]}}

    def load_state_dict(self, state):
        mine = (state or {}).get("worker")
        if self.compressor is not None and mine:
            self.compressor.load_state_dict(mine["compressor"])
            if self.compressor.memory is not None:
                self.compressor.memory.load_state_dict(mine["memory"])

    def finish_training(self):
        """Say we are done; wait for every server's final counts."""
        if self.worker is not None:
            self.final_stats = self.worker.finish()


def summarize(stats):
    """Sum per-server stats dicts into ``ps_*`` metrics (empty dict for no stats)."""
    stats = [s for s in (stats or []) if s]
    if not stats:
        return {}
    pushed = sum(s["pushed"] for s in stats)
    return {
        "ps_pushed": pushed,
        "ps_applied": sum(s["applied"] for s in stats),
        "ps_dropped": sum(s["dropped"] for s in stats),
        "ps_updates": max(s["updates"] for s in stats),
        "ps_max_lead": max(s["max_lead"] for s in stats),
        "ps_mean_staleness": (sum(s["sum_staleness"] for s in stats) / pushed
                              if pushed else 0.0),
        # every push goes to every server: the first one's count per worker rank
        "ps_pushed_by_worker": {str(w): n for w, n in stats[0]["pushes_by_worker"].items()},
    }

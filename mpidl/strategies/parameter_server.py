"""``--strategy ps``: parameter servers hold the model and the optimizer, workers compute.

Ranks ``0 .. S-1`` are servers (``--servers S``, default 1), the others workers. The
parameters are sharded over the servers by size (``mpidl.ps.sharding``); each server runs
the optimizer for its shard only, workers hold parameters and compute gradients but never
any optimizer state. ``--mode`` picks how pushes become updates (``mpidl.ps.modes``):
``sync``, ``async`` (Downpour), ``ssp --staleness s``, ``backup --wait k``;
``--staleness-aware-lr`` divides async/SSP updates by the gradient's staleness.

How the trainer drives it: servers get ``trains_on_data = False`` and run ``serve()``
for the whole job; workers run the ordinary loop. The trainer's collectives (``reduce``,
``gather``) run over the workers only, and the first worker is the root that logs and
writes metrics. Before evaluation every worker waits at an end-of-epoch barrier and
takes the current parameters, so all workers evaluate the same model whatever the mode;
the barrier's answer also carries the servers' counts, which ``metrics()`` reports
(``ps_pushed = ps_applied + ps_dropped``). Every collective among the workers passes that
barrier first, so no worker sits in a collective while a server waits for its push.
``--epoch-quorum K`` (async/ssp/backup): once K workers wait at that barrier, the servers'
answers tell the others to stop (``epoch_cut()``), and the trainer ends their epoch early.

Checkpoints: the servers' optimizer state and the workers' parameters agree only at the
epoch barrier, so with ``--checkpoint-dir`` the trainer writes a checkpoint at the end of
every epoch (``checkpoint_at_epoch_end``); the root worker's barrier request then asks
each server for its shard's optimizer state, which ``state_dict`` merges. ``--resume``
continues at the next epoch; in sync mode bitwise as if never stopped.

Straggler injection for experiments: ``--straggler RANK:FACTOR`` makes that worker's
steps take FACTOR times as long (it sleeps ``FACTOR - 1`` times its compute time).
"""

import time

from mpidl.errors import ConfigError
from mpidl.ps.modes import MODES, ModeConfig
from mpidl.ps.server import ParameterServer
from mpidl.ps.sharding import shard_parameters
from mpidl.ps.worker import PSWorker
from mpidl.strategies.base import Strategy, check_options

KNOWN = {"servers", "mode", "staleness", "wait", "staleness_aware_lr", "straggler",
         "compression", "ratio", "trace", "poll_max_ms", "epoch_quorum"}
#: options of other strategies that the CLI passes to every strategy; ignored here
IGNORED = {"algorithm", "bucket_mb", "overlap"}


def parse_straggler(spec):
    """``"RANK:FACTOR"`` -> (rank, factor); None stays None."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, (tuple, list)):
        rank, factor = spec
    else:
        try:
            rank, factor = str(spec).split(":")
            rank, factor = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"--straggler {spec!r}: expected RANK:FACTOR, e.g. 3:2 "
                              "(worker rank 3 computes twice as slowly)") from None
    if not factor >= 1.0:
        raise ConfigError(f"--straggler {spec!r}: FACTOR must be >= 1 (a slowdown)")
    return int(rank), float(factor)


def _mpi(comm):
    return getattr(comm, "mpi", comm)


class ParameterServerStrategy(Strategy):
    """Parameter-server training; see the module docstring."""

    name = "ps"
    checkpoint_at_epoch_end = True

    def __init__(self, comm=None, servers=None, mode=None, staleness=None, wait=None,
                 staleness_aware_lr=None, straggler=None, compression=None, ratio=None,
                 trace=False, poll_max_ms=None, epoch_quorum=None, **options):
        check_options("ps", KNOWN, {k: v for k, v in options.items() if k not in IGNORED})
        super().__init__(comm, servers=servers, mode=mode, staleness=staleness, wait=wait,
                         staleness_aware_lr=staleness_aware_lr, straggler=straggler,
                         compression=compression, ratio=ratio, epoch_quorum=epoch_quorum,
                         **options)
        self.num_servers = 1 if servers is None else int(servers)
        if self.num_servers < 1:
            raise ConfigError(f"--servers must be at least 1, got {self.num_servers}")
        if self.size < self.num_servers + 1:
            raise ConfigError(
                f"--strategy ps with {self.num_servers} server(s) needs at least "
                f"{self.num_servers + 1} ranks (servers + at least one worker), but "
                f"{self.size} were started: run under mpiexec -n {self.num_servers + 1} "
                "or more")
        self.server_ranks = list(range(self.num_servers))
        self.worker_ranks = list(range(self.num_servers, self.size))
        self.mode_cfg = ModeConfig(
            mode=(mode or "sync"), staleness=int(staleness or 0), wait=int(wait or 0),
            staleness_aware_lr=bool(staleness_aware_lr),
            epoch_quorum=int(epoch_quorum or 0)).check(len(self.worker_ranks))
        if self.mode_cfg.mode not in MODES:  # pragma: no cover - check() raised already
            raise ConfigError(f"unknown mode {mode!r}")
        self.straggler = parse_straggler(straggler)
        if self.straggler and self.straggler[0] not in self.worker_ranks:
            raise ConfigError(f"--straggler {straggler}: rank {self.straggler[0]} is not a "
                              f"worker; workers are ranks {self.worker_ranks[0]}.."
                              f"{self.worker_ranks[-1]} (ranks 0..{self.num_servers - 1} "
                              "serve)")
        self.compression, self.ratio = compression, ratio
        self._compressor = self._memory = None  # made here: a bad name is a user error
        if ratio is not None and compression in (None, "", "none"):
            raise ConfigError("--ratio is a compression setting: give --compression too "
                              "(e.g. --compression topk --ratio 0.01)")
        if compression not in (None, "", "none"):
            self._compressor, self._memory = _make_compressor(compression, ratio)
        self.trace = bool(trace)
        self.poll_max_s = (poll_max_ms or 1.0) * 1e-3
        self.is_server = self.rank in self.server_ranks
        self.trains_on_data = not self.is_server
        self.server = self.worker = None
        self.layout = None
        self.latest_stats = {}
        self.final_stats = None
        self._server_states = None

    # -- who am I
    @property
    def is_root(self):
        """The first worker logs and writes metrics (servers do not run the epoch loop)."""
        return self.rank == self.worker_ranks[0]

    def shard(self):
        if self.is_server:
            return 0, len(self.worker_ranks)
        return self.worker_ranks.index(self.rank), len(self.worker_ranks)

    # -- set-up
    def setup(self, model, optimizer, loss):
        """Collective: private communicators and the shard layout. Nothing here waits for
        a server (the first step pulls the parameters), so servers may do collective work
        between setup and serve."""
        from mpidl.ps.protocol import Poller

        super().setup(model, optimizer, loss)
        world = _mpi(self.comm)
        self.ps_comm = world.Dup()  # the protocol's traffic never meets anyone else's
        self.group_comm = world.Split(0 if self.is_server else 1, self.rank)
        named = model.named_parameters()
        self.layout = shard_parameters(named, self.num_servers)
        compressor, memory = self._compressor, self._memory
        if compressor is not None and not self.is_server:  # per-worker random streams
            compressor.bind(self.worker_ranks.index(self.rank), len(self.worker_ranks))
        poller = Poller(self.ps_comm, longest=self.poll_max_s,
                        who=f"{'server' if self.is_server else 'worker'} rank {self.rank}")
        if self.is_server:
            index = self.server_ranks.index(self.rank)
            mine = set(self.layout.names[index])
            shard = [(n, p) for n, p in named if n in mine]
            # the trainer's optimizer, stepped with names= this shard only: only the
            # shard's optimizer state ever exists, and only here
            self.server = ParameterServer(
                self.ps_comm, index, shard, optimizer, self.mode_cfg, self.worker_ranks,
                self.server_ranks, compressor=compressor, trace=self.trace, poller=poller)
        else:
            factor = self.straggler[1] if self.straggler and self.straggler[0] == self.rank \
                else 1.0
            self.worker = PSWorker(self.ps_comm, named, self.layout, self.server_ranks,
                                   compressor=compressor, memory=memory, straggler=factor,
                                   poller=poller)
        self._pulled = False  # the first step pulls: setup never waits for a server
        self._pushes_since_barrier = 0

    def _first_pull(self):
        """Every worker starts from the servers' parameters."""
        if not self._pulled:
            self._pulled = True
            self.worker.pull()

    # -- workers
    def train_step(self, x, y):
        self._first_pull()
        self.worker.begin_step()
        self.model.zero_grad()
        logits = self.model.forward(x)
        loss = self.loss.forward(logits, y)
        self.model.backward(self.loss.backward())
        self.worker.push(lr=getattr(self.optimizer, "lr", None))
        self._pushes_since_barrier += 1
        return float(loss)

    def epoch_cut(self):
        """True once ``--epoch-quorum`` workers finished this epoch: stop it here."""
        return self.worker is not None and self.worker.epoch_over

    def prepare_eval(self):
        """End of epoch: all workers meet at the barrier and take the same parameters."""
        self._epoch_barrier()

    def _epoch_barrier(self):
        """Meet the other workers at the servers' barrier (once after any pushes).

        Every collective among the workers passes it first: a worker waiting inside a
        collective pushes nothing, and the servers must know that, or a backup-mode
        quorum (or anything else) could wait for it forever.
        """
        if self.worker is None or (self._pulled and self._pushes_since_barrier == 0):
            return
        self._pulled = True
        self.worker.barrier(want_state=self.checkpoints and self.is_root)
        self._pushes_since_barrier = 0
        self.latest_stats = self.worker.barrier_stats
        self._server_states = self.worker.server_states
        self._average_buffers()

    def _average_buffers(self):
        """BatchNorm running statistics live on the workers, not the servers: average
        them over the workers so that every worker evaluates (and saves) one model."""
        import numpy as np

        from mpidl.backend import to_device, to_numpy

        n = len(self.worker_ranks)
        for name, buf in self.model.named_buffers():
            host = to_numpy(buf)
            if n == 1 or host.dtype.kind != "f":
                continue
            total = np.empty_like(host)
            self.group_comm.Allreduce(np.ascontiguousarray(host), total)
            self.model.set_buffer(name, to_device(total / host.dtype.type(n)))

    def metrics(self):
        """Counts summed over the servers, as of the last barrier (exact: nothing is in
        flight there); ``ps_pushed == ps_applied + ps_dropped``."""
        return summarize(self.final_stats or self.latest_stats)

    # -- servers
    def serve(self):
        """Serve until every worker is done, then report the counts (server 0 logs)."""
        from mpidl.training.log import get_logger

        t0 = time.perf_counter()
        st = self.server.serve(until="end")
        everyone = self.group_comm.gather(st.as_dict(), root=0)
        if self.rank == self.server_ranks[0]:
            self.final_stats = everyone
            s = summarize(everyone)
            get_logger().info(
                f"parameter server ({self.mode_cfg.mode}, {self.num_servers} server(s), "
                f"{len(self.worker_ranks)} workers): pushed {s['ps_pushed']} = applied "
                f"{s['ps_applied']} + dropped {s['ps_dropped']}; {s['ps_updates']} updates, "
                f"max lead {s['ps_max_lead']}, mean staleness {s['ps_mean_staleness']:.2f}, "
                f"server CPU {st.cpu_s:.1f} s of {time.perf_counter() - t0:.1f} s")
        return st

    # -- the trainer's collectives run over the workers only
    def reduce(self, values, op="mean"):
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce op must be 'sum' or 'mean', got {op!r}")
        self._epoch_barrier()
        keys = sorted(values)
        rows = self.group_comm.allgather([float(values[k]) for k in keys])
        totals = [0.0] * len(keys)
        for row in rows:  # rank order: the same bits on every worker
            totals = [t + v for t, v in zip(totals, row)]
        if op == "mean":
            totals = [t / len(rows) for t in totals]
        return dict(zip(keys, totals))

    def gather(self, obj):
        self._epoch_barrier()
        got = self.group_comm.gather(obj, root=0)
        return got if self.is_root else None

    def bcast(self, obj):
        return _mpi(self.comm).bcast(obj, root=self.worker_ranks[0])

    def barrier(self):
        self._epoch_barrier()
        self.group_comm.Barrier()

    def state_dict(self):
        """Collective over the workers, between epochs: the servers' optimizer state as
        of the last barrier (merged over the shards, keyed by parameter name, so a resume
        may use another --servers), their versions, and every worker's error-feedback
        memory. The model the trainer saves holds that barrier's parameters."""
        if self._pushes_since_barrier:
            raise RuntimeError("a parameter-server checkpoint can only be taken between "
                               "epochs (after the servers' barrier)")
        mine = None
        if self._compressor is not None:
            mine = {"compressor": self._compressor.state_dict(),
                    "memory": self._memory.state_dict() if self._memory is not None else {}}
        per_worker = self.group_comm.gather(mine, root=0)
        if not self.is_root:
            return None
        states = self._server_states
        if states is None:
            raise RuntimeError("no optimizer state came with the last barrier: set "
                               "strategy.checkpoints = True before setup()")
        merged = dict(states[0]["optimizer"], state={})
        for st in states:
            merged["state"].update(st["optimizer"]["state"])
        return {"optimizer": merged, "versions": [st["version"] for st in states],
                "counts": [st.get("counts") for st in states],
                "workers": per_worker if mine is not None else None}

    def load_state_dict(self, state):
        """Every rank: servers take their shard's optimizer state, workers their
        compressor's state and error-feedback memory (when the worker count is the same)."""
        if self.is_server:
            index = self.server_ranks.index(self.rank)
            versions = state.get("versions") or []
            counts = state.get("counts") or []
            same = len(counts) == self.num_servers  # counts are per server
            self.server.import_state(state["optimizer"],
                                     versions[index] if index < len(versions) else 0,
                                     counts[index] if same else None)
        elif self._compressor is not None and state.get("workers"):
            per_worker = state["workers"]
            if len(per_worker) == len(self.worker_ranks):
                mine = per_worker[self.worker_ranks.index(self.rank)]
                self._compressor.load_state_dict(mine["compressor"])
                if self._memory is not None:
                    self._memory.load_state_dict(mine["memory"])

    def finish(self):
        """Workers say they are done and wait for every server's final counts."""
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
    }


def _make_compressor(name, ratio):
    """(compressor, memory or None) from mpidl.compress, with error feedback where the
    compressor wants it."""
    try:
        from mpidl.compress import make_compressor
    except ModuleNotFoundError as e:
        if e.name not in ("mpidl.compress",):
            raise
        raise ConfigError(f"--compression {name}: this mpidl has no compression "
                          "module") from None
    kw = {} if ratio is None else {"ratio": ratio}
    try:
        compressor = make_compressor(name, **kw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--compression {name}: {e}") from None
    if getattr(compressor, "name", None) == "powersgd":
        raise ConfigError("--compression powersgd needs all-reduces between the workers "
                          "(its factors are averaged in two rounds): use it with "
                          "--strategy allreduce; with ps use topk, dgc, onebit, qsgd, ...")
    memory = getattr(compressor, "memory", None)
    return compressor, memory


STRATEGY = ParameterServerStrategy

"""The parameter-server role: a rank that holds a shard of the parameters and the
optimizer for it, and answers workers until they are done (``mpidl.ps.server``).

Server ranks do not train on data: the trainer calls ``serve()`` instead of running
epochs. Server 0 logs the final counts.
"""

import time


class ServerRole:
    """Serve one shard (``index`` among the servers) until every worker is done."""

    def __init__(self, mode_cfg, server_ranks, worker_ranks, compressor=None, trace=False,
                 poll_max_s=1e-3, group_size=1, select=None):
        self.mode_cfg = mode_cfg
        # ``select``: which parameters the servers hold (Parallax: a selector with
        # ``bind(model)``, as the trainers' syncs have); None: every parameter
        self.select = select
        # ``worker_ranks``: the ranks that push, the leaders of groups of ``group_size``
        self.group_size = int(group_size)
        self.server_ranks, self.worker_ranks = list(server_ranks), list(worker_ranks)
        self.compressor = compressor
        self.trace = trace
        self.poll_max_s = poll_max_s
        self.server = None
        self.final_stats = None

    def setup(self, ctx):
        """Local work only (nothing here waits for a worker)."""
        from mpidl.ps.protocol import Poller  # noqa: PLC0415
        from mpidl.ps.server import ParameterServer  # noqa: PLC0415
        from mpidl.ps.sharding import shard_parameters  # noqa: PLC0415

        rank = ctx.ps_comm.rank
        self.rank = rank
        self.index = self.server_ranks.index(rank)
        self.servers_group = ctx.role_group
        named = ctx.named_params
        if self.select is not None:
            self.select.bind(ctx.model)
            named = [(n, p) for n, p in named if self.select(n)]
        layout = shard_parameters(named, len(self.server_ranks))
        mine = set(layout.names[self.index])
        shard = [(n, p) for n, p in named if n in mine]
        poller = Poller(ctx.ps_comm, longest=self.poll_max_s, who=f"server rank {rank}")
        # the trainer's optimizer, stepped with names= this shard only: only the shard's
        # optimizer state ever exists, and only here
        self.server = ParameterServer(
            ctx.ps_comm, self.index, shard, ctx.optimizer, self.mode_cfg, self.worker_ranks,
            self.server_ranks, compressor=self.compressor, trace=self.trace, poller=poller)
        from mpidl import env  # noqa: PLC0415

        kill_at = env.rank_steps("MPIDL_KILL_AT").get(ctx.ps_comm.world_rank)
        if kill_at:  # the test hook: this server dies once it applied that many updates
            self.server.on_update = lambda s: env.kill_now() if s.version in kill_at else None

    def serve(self):
        """Serve until every worker is done, then report the counts (server 0 logs)."""
        from mpidl.runtime.sync.pushpull import summarize  # noqa: PLC0415
        from mpidl.training.log import get_logger  # noqa: PLC0415

        t0 = time.perf_counter()
        st = self.server.serve(until="end")
        everyone = self.servers_group.mpi.gather(st.as_dict(), root=0)
        if self.index == 0:
            self.final_stats = everyone
            s = summarize(everyone)
            get_logger().info(
                f"parameter server ({self.mode_cfg.mode}, {len(self.server_ranks)} "
                f"server(s), {self._workers_text()}): pushed {s['ps_pushed']} = "
                f"applied {s['ps_applied']} + dropped {s['ps_dropped']}; {s['ps_updates']} "
                f"updates, max lead {s['ps_max_lead']}, mean staleness "
                f"{s['ps_mean_staleness']:.2f}, server CPU {st.cpu_s:.1f} s of "
                f"{time.perf_counter() - t0:.1f} s")
        return st

    def _workers_text(self):
        n = len(self.worker_ranks)
        if self.group_size == 1:
            return f"{n} workers"
        return f"{n} worker group{'s' if n != 1 else ''} of {self.group_size}"

    def load_state_dict(self, servers):
        """Take this shard's entries of the checkpoint's merged optimizer state, and this
        server's version and counts (when the checkpoint has as many servers)."""
        versions = servers.get("versions") or []
        counts = servers.get("counts") or []
        same = len(counts) == len(self.server_ranks)
        self.server.import_state(servers["optimizer"],
                                 versions[self.index] if self.index < len(versions) else 0,
                                 counts[self.index] if same else None)

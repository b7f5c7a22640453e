"""``--optimizer lbfgs``: where full-batch L-BFGS runs, and what it refuses.

L-BFGS is not a step of the runtime's kind (a batch in, an update out): an iteration is
a line search over full-batch evaluations, decided from scalars. It runs

* on one process (``--strategy local``): the algorithm itself
  (``mpidl.engine.lbfgs.minimize``), the full batch evaluated in portions of
  ``--portion-size`` summed in portion order (``dealing.sum_of_portions``);
* on parameter servers (``--strategy ps``), Sandblaster's way (``mpidl.ps.lbfgs``):
  the servers are shards of the parameters and the L-BFGS vectors, server 0 also
  coordinates, and the workers compute those same portions, dealt to whichever is free
  (``--deal portions``, always on here), with backup copies of the last ones.

The reductions' order depends on the data and the model only (portions in portion order,
dot products per tensor added in parameter order), so the two give bitwise the same
iterates, whatever the number of servers and workers and whoever is slow.

Everything that would make ranks decide or compute differently is refused in one line
(``check``): other strategies, other modes, compression, micro-batching, sharded or
model-parallel layouts, mixed precision, models whose gradient depends on who computed a
portion (Dropout, BatchNorm's running statistics) or is row-sparse.
"""

from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.server import ServerRole

OPTIONS = [
    Option("lbfgs_history", int, 10, "--optimizer lbfgs: correction pairs kept (the "
           "memory m)", metavar="M", check=lambda v: None if v >= 1 else
           "must be at least 1"),
    Option("lbfgs_iterations", int, 100, "--optimizer lbfgs: the most iterations (each "
           "is one or more full-batch evaluations); it stops earlier when max |g_i| <= "
           "1e-5 or the loss no longer decreases (SciPy's L-BFGS-B tests)", metavar="N",
           check=lambda v: None if v >= 1 else "must be at least 1"),
]

#: settings of the parameter server that L-BFGS uses (the rest refuses, ``check``)
PS_SETTINGS = ("servers", "deal", "portion_size", "straggler", "trace", "poll_max_ms",
               "compute_pace")
#: training settings of the other optimizers: a note says they have no effect
IGNORED = ("lr", "momentum", "nesterov", "schedule", "warmup_epochs", "scale_lr",
           "epochs", "batch_size", "fused_optimizer")

_WHY = {
    "accumulate": "it evaluates the whole training set, in portions of --portion-size, "
                  "already: drop --accumulate",
    "micro_batches": "it evaluates the whole training set, in portions of --portion-size, "
                     "already: drop --micro-batches",
    "compression": "its line search needs exact gradients: drop --compression",
    "ratio": "its line search needs exact gradients: drop --ratio",
    "mode": "every rank follows the coordinator's line-search decisions, in step: drop "
            "--mode",
    "group_size": "each portion's gradient goes to the shards on its own: drop --group-size",
    "precision": "it keeps the parameters and its vectors in --dtype: drop --precision "
                 "(use --dtype float32 or float64)",
    "zero": "the parameter servers shard its vectors already: drop --zero",
    "tensor_parallel": "the parameter servers shard its vectors already: drop "
                       "--tensor-parallel",
    "pipeline_stages": "it is not built for pipelines: drop --pipeline-stages",
    "hybrid": "it is not built for --hybrid layouts: drop --hybrid",
    "sync": "every iteration uses the whole training set's gradient: drop --sync",
    "weight_decay": "its objective is the plain loss (no L2 term yet): drop --weight-decay",
    "checkpoint_dir": "its runs keep no checkpoints yet: drop --checkpoint-dir",
    "checkpoint_every": "its runs keep no checkpoints yet: drop --checkpoint-every",
    "resume": "its runs keep no checkpoints yet: drop --resume",
    "cuda_graph": "its steps are not graph-captured: drop --cuda-graph",
    "elastic": "its shards and coordinator hold state no other rank has, so a dead rank "
               "cannot be replaced from memory: drop --elastic",
    "elastic_commit_every": "it is not elastic: drop --elastic-commit-every",
}


def check(strategy, given, size=1, training=None):
    """ConfigError, one line, for what L-BFGS cannot serve. ``strategy``: the canonical
    preset name; ``given``: {setting: value} of the parallelism settings the user set;
    ``training``: the training settings the user gave (only those that would change
    what L-BFGS minimizes or keeps are refused); ``size``: ranks started."""
    if strategy not in ("local", "ps"):
        raise ConfigError(f"--optimizer lbfgs runs on one process (--strategy local) or on "
                          f"parameter servers (--strategy ps: servers hold the parameters "
                          f"and L-BFGS's vectors, workers compute the full-batch gradient "
                          f"in dealt portions), not --strategy {strategy}: use --strategy "
                          "ps" + (" --servers S" if size > 1 else ""))
    if given.get("deal") not in (None, "portions"):
        raise ConfigError(f"--optimizer lbfgs deals portions of the training set to the "
                          f"workers: drop --deal {given['deal']}")
    if (given.get("mode") or "sync") == "sync":
        given = {k: v for k, v in given.items() if k != "mode"}
    refused = [(k, v) for k, v in (training or {}).items() if k in _WHY and v]
    for name, value in refused + list(given.items()):
        if value in (None, False):
            continue
        if name in PS_SETTINGS and strategy == "ps" or name == "portion_size":
            continue
        if name in ("accumulate", "micro_batches", "group_size", "tensor_parallel",
                    "pipeline_stages") and value == 1:
            continue
        flag = "--" + name.replace("_", "-")
        shown = "" if value is True else f" {value}"
        why = _WHY.get(name)
        if why is None:
            where = ("with --strategy local (one process)" if strategy == "local"
                     else "with --strategy ps")
            why = f"it has no use {where}: drop {flag}"
        raise ConfigError(f"--optimizer lbfgs cannot be used with {flag}{shown}: {why}")


def check_model(model):
    """ConfigError for a model whose full-batch gradient would depend on which rank
    computed a portion, or that L-BFGS's dense vectors cannot hold."""
    from mpidl.engine.normalization import BatchNorm1d, BatchNorm2d  # noqa: PLC0415
    from mpidl.runtime import dealing  # noqa: PLC0415
    from mpidl.runtime.sync.rowsparse import sparse_param_names  # noqa: PLC0415

    try:
        dealing.check_model(model)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--deal portions", "--optimizer lbfgs")) from None
    for name, layer in model.modules():
        if isinstance(layer, (BatchNorm1d, BatchNorm2d)):
            raise ConfigError(f"--optimizer lbfgs: layer {name} is {type(layer).__name__}, "
                              "whose running statistics would depend on which rank "
                              "computed which portion; use a model without it (logreg, "
                              "mlp)")
    sparse = sorted(sparse_param_names(model))
    if sparse:
        raise ConfigError(f"--optimizer lbfgs keeps dense vectors, but {sparse[0]} has "
                          "row-sparse gradients (an Embedding); use a model without one")


def default_portion_size(samples):
    """Samples per portion when ``--portion-size`` is not given: the training set in 16
    portions (a function of the data only, so every layout cuts the same portions)."""
    return max(1, -(-int(samples) // 16))


def build(comm, settings, portion_size, servers=None, straggler=None, trace=False,
          poll_max_ms=None, compute_pace=None, deal=None):
    """The ``Runtime`` of ``--strategy ps --optimizer lbfgs`` on this rank: the
    parameter-server preset with dealt portions of ``portion_size`` samples, its server
    role L-BFGS's (``LbfgsServerRole``). Local work only."""
    from mpidl.runtime import presets  # noqa: PLC0415

    if portion_size is None:
        raise ValueError("L-BFGS needs a portion size that does not depend on the layout "
                         "(default_portion_size)")
    rt = presets.ps(comm, [], servers=servers, deal="portions", portion_size=portion_size,
                    straggler=straggler, trace=trace, poll_max_ms=poll_max_ms,
                    compute_pace=compute_pace)
    rt.name = "ps+lbfgs"
    if rt.role == "server":
        old = rt.server
        rt.server = LbfgsServerRole(settings, old.mode_cfg, old.server_ranks,
                                    old.worker_ranks, trace=old.trace,
                                    poll_max_s=old.poll_max_s)
    rt.checks.append(lambda model, optimizer: check_model(model))
    return rt


class LbfgsServerRole(ServerRole):
    """A shard of the parameters and of L-BFGS's vectors; server 0 also coordinates
    (``mpidl.ps.lbfgs``). ``summary`` after ``serve``: this shard's evaluations, the bytes
    and messages it sent on the servers' group, and on server 0 the coordinator's
    records and why it stopped."""

    def __init__(self, settings, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.coordinator = None
        self.summary = None

    def setup(self, ctx):
        from mpidl.engine.lbfgs import Lbfgs, ShardVectors  # noqa: PLC0415
        from mpidl.ps.lbfgs import LbfgsDealMode, RemoteShards, ShardFollower  # noqa: PLC0415
        from mpidl.ps.protocol import Poller  # noqa: PLC0415
        from mpidl.ps.sharding import shard_parameters  # noqa: PLC0415

        super().setup(ctx)
        srv, group = self.server, ctx.role_group
        if group.rank != self.index:
            raise RuntimeError(f"server {self.index} is rank {group.rank} of the servers' "
                               "group; L-BFGS's exchange needs them in the same order")
        self.group = group
        group.reset_counters()
        vectors = ShardVectors([(n, srv.params[n]) for n in srv.names],
                               self.settings.history)
        poller = Poller(group, longest=self.poll_max_s, who=f"L-BFGS shard {self.index}")
        if self.index == 0:
            named = ctx.named_params
            layout = shard_parameters(named, len(self.server_ranks))
            shards = RemoteShards(group, vectors, layout.names, poller)
            self.coordinator = Lbfgs(self.settings, shards, [n for n, _ in named])
            srv.policy = LbfgsDealMode(srv.cfg, vectors, coordinator=self.coordinator)
        else:
            srv.policy = LbfgsDealMode(srv.cfg, vectors,
                                       follower=ShardFollower(group, vectors, poller))

    def serve(self):
        from mpidl.training.log import get_logger  # noqa: PLC0415

        st = self.server.serve(until="end")
        p2p = self.group.counters()["p2p"]
        policy = self.server.policy
        self.summary = {"evaluations": policy.evaluations, "deals": policy.deals,
                        "group_bytes": p2p["bytes"], "group_messages": p2p["messages"],
                        "tensors": len(self.server.names), "pushed": st.pushed,
                        "dropped": st.dropped}
        if self.coordinator is not None:
            c = self.coordinator
            self.summary.update(stop_reason=c.stop_reason, iterations=c.iteration,
                                coordinator_evaluations=c.evaluations)
            get_logger().info(
                f"L-BFGS coordinator (server 0 of {len(self.server_ranks)}, "
                f"{len(self.worker_ranks)} workers): {c.iteration} iterations, "
                f"{c.evaluations} evaluations; {c.stop_reason}")
        return st

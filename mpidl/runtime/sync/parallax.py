"""Parallax (``--sparse-sync ps``): sparse parameters through parameter servers, the dense
rest all-reduced among the trainers (after Kim et al., EuroSys 2019).

An embedding's gradient touches a few rows per step: all-gathering every rank's rows
grows with the ranks, while a parameter server takes each trainer's rows once. Dense
gradients are the other way round: a ring all-reduce moves 2(p-1)/p of them per rank,
whatever p, with no server in the way. So each parameter is kept in step the way that
suits it:

* ranks ``0 .. S-1`` (``--servers S``) are servers holding the *remote* parameters
  (sharded over them as ``--strategy ps`` shards, ``mpidl.ps.sharding``) and running
  their optimizer; the other ranks are trainers;
* the remote parameters are chosen per parameter: by default every parameter with
  row-sparse gradients (Embedding weights), or the names matching ``--ps-params
  PATTERNS`` (comma-separated ``fnmatch`` patterns on ``model.named_parameters()``'s names,
  e.g. ``'0.weight,*.bias'``);
* a trainer's step: backward; its remote gradients leave first, row-sparse ones as
  coalesced rows (the arrays the all-gather would send), dense ones dense; then the dense
  gradients are all-reduced in the fused buckets among the trainers only (``--algorithm``,
  ``--bucket-mb``, ``--overlap``) and stepped by the replicated optimizer; row-sparse
  parameters a pattern left on the trainers go through the all-gather
  (``--sparse-grads``); last it takes the servers' answer, the remote parameters after
  their update. The servers' round trip overlaps the all-reduce.

``--mode`` is the servers' (``mpidl.ps.modes``) and concerns the remote parameters only;
the dense ones are all-reduced every step whatever the mode, so the trainers stay in
lockstep. ``sync`` (the default) averages the trainers' rows in trainer order and scales
them by 1/n exactly as the all-gather does, and the servers' optimizer is the same
(Adam densifies the rows, SGD updates touched rows only, as a replicated one does): a
run is bitwise ``--strategy allreduce`` on as many ranks as there are trainers. In
``async`` each trainer's rows are an update of their own, applied on arrival (so n
updates per step, each from one trainer's batch, not their mean: about n times the
step size of sync on those parameters, as in Downpour), and a trainer goes on with the
remote parameters as they were when its push was applied (so its next gradient is
stale by the other trainers' pushes applied since, typically those of that step and the
one before); ``ssp``, ``backup``, ``softsync`` likewise act on the remote parameters'
pushes. ``--epoch-quorum`` is refused: a trainer cannot leave an epoch
early while the others wait for it in the all-reduce.

Checkpoints are written at epoch ends only, as with ``--strategy ps``: the barrier
there gives every trainer the servers' parameters and the root the servers' optimizer
state. Evaluation and the saved model are the whole model: the root trainer's dense
parameters (the same on every trainer) and the servers' remote ones (taken at the
barrier before every evaluation).
"""

from fnmatch import fnmatchcase

from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.sync.base import GradSync
from mpidl.runtime.sync.rowsparse import as_rows, sparse_param_names

SPARSE_SYNCS = ("allreduce", "ps")


def _pattern_problem(value):
    return None if parse_patterns(value, check=False) else (
        "must name at least one parameter pattern (comma-separated, e.g. '0.weight,*.bias')")


OPTIONS = [
    Option("sparse_sync", str, None, "--strategy allreduce: how the parameters with row-"
           "sparse gradients (Embedding weights) are kept in step: allreduce (the trainers "
           "exchange them, see --sparse-grads; the default) or ps (Parallax: ranks 0..S-1, "
           "--servers S, hold them and run their optimizer, the other ranks train and "
           "all-reduce the dense rest among themselves; --mode applies to the servers' "
           "part)", "parallelism", choices=(None,) + SPARSE_SYNCS),
    Option("ps_params", str, None, "--sparse-sync ps: the parameters the servers hold, as "
           "comma-separated name patterns (fnmatch on the names of model.named_parameters(), "
           "e.g. '0.weight,*.bias'; gpt-tiny's token embedding is 0.weight); default: every "
           "parameter with row-sparse gradients",
           "parallelism", metavar="PATTERNS", check=_pattern_problem),
]


def parse_patterns(value, check=True):
    """The patterns of ``--ps-params`` as a tuple (None when not given)."""
    if value is None:
        return None
    patterns = tuple(p.strip() for p in str(value).split(",") if p.strip())
    if check and not patterns:
        raise ConfigError(f"--ps-params {value!r} {_pattern_problem(value)}")
    return patterns


def wanted(sparse_sync):
    """Whether ``--sparse-sync`` asks for Parallax (checked against its choices)."""
    if sparse_sync not in (None,) + SPARSE_SYNCS:
        raise ConfigError(f"--sparse-sync {sparse_sync!r}: choose one of "
                          f"{', '.join(SPARSE_SYNCS)}")
    return sparse_sync == "ps"


def check_preset(name, given):
    """One line for ``--sparse-sync ps`` or ``--ps-params`` where they cannot apply:
    another preset than ``allreduce``, or patterns without Parallax."""
    on = wanted(given.get("sparse_sync"))
    if given.get("ps_params") is not None and not on:
        raise ConfigError(f"--ps-params {given['ps_params']!r} says which parameters the "
                          "servers of --sparse-sync ps hold: add --sparse-sync ps, or drop "
                          "--ps-params")
    if not on or name == "allreduce":
        return
    if name == "local":
        raise ConfigError("--sparse-sync ps needs server ranks and trainer ranks: run under "
                          "mpiexec -n 2 or more (--strategy allreduce, the default on several "
                          "ranks: ranks 0..S-1 serve, --servers S, default 1)")
    raise ConfigError(f"--sparse-sync ps splits the parameters between servers and an "
                      f"all-reduce among trainers (--strategy allreduce), not --strategy "
                      f"{name}" + (": --strategy ps already keeps every parameter on the "
                                   "servers" if name == "ps" else "")
                      + "; drop one of them")


def check_composes(tensor_parallel=1, pipeline_stages=1, zero=0, compression=None, sync=None,
                   precision=None, hybrid=None, epoch_quorum=None):
    """One line for each setting Parallax does not compose with."""
    why = [
        ((tensor_parallel or 1) > 1, f"--tensor-parallel {tensor_parallel}", "the servers "
         "hold whole tensors, tensor parallelism slices them over trainers (not built)"),
        ((pipeline_stages or 1) > 1, f"--pipeline-stages {pipeline_stages}", "a pipeline "
         "splits the model over the trainers (not built)"),
        (bool(zero), f"--zero {zero}", "ZeRO shards the trainers' optimizer; the servers "
         "already hold the sparse parameters' (not built)"),
        (compression not in (None, "none"), f"--compression {compression}", "compressed "
         "exchange of the dense buckets and pushes is not built"),
        (sync not in (None, "allreduce"), f"--sync {sync}", "model averaging lets every "
         "trainer step alone, but the servers' parameters have one copy"),
        (precision not in (None, "fp32"), f"--precision {precision}", "the servers step "
         "their parameters in the format they receive, with no float32 master weights"),
        (bool(hybrid), f"--hybrid {hybrid}", "its fully connected layers are tensor "
         "parallel (not built)"),
        (bool(epoch_quorum), f"--epoch-quorum {epoch_quorum}", "every trainer takes part "
         "in every step's all-reduce, so none can leave an epoch early"),
    ]
    for bad, flag, reason in why:
        if bad:
            raise ConfigError(f"--sparse-sync ps cannot be used with {flag}: {reason}; drop "
                              "one of them")


class Split:
    """Which parameters the servers hold (``remote``), decided from the model at setup:
    the ``--ps-params`` patterns' matches, or every parameter with row-sparse gradients.
    Called with a name, it says whether the servers hold it (the selector the server
    role takes); ``rows`` are the row-sparse ones, remote or not."""

    def __init__(self, patterns=None):
        self.patterns = None if patterns is None else tuple(patterns)
        self.names = ()
        self.remote = frozenset()
        self.rows = frozenset()

    def bind(self, model):
        self.names = tuple(n for n, _ in model.named_parameters())
        self.rows = frozenset(sparse_param_names(model))
        if self.patterns is None:
            self.remote = self.rows
        else:
            self.remote = frozenset(n for n in self.names
                                    if any(fnmatchcase(n, pat) for pat in self.patterns))

    def __call__(self, name):
        return name in self.remote

    def check(self, model, optimizer=None):
        """A ``ConfigError`` unless the servers get some, and not all, parameters
        (local work: the command line runs it before any rank communicates)."""
        self.bind(model)
        some = ", ".join(self.names[:6]) + (", ..." if len(self.names) > 6 else "")
        if not self.remote and self.patterns is None:
            raise ConfigError("--sparse-sync ps: the model has no parameter with row-sparse "
                              "gradients (an Embedding's weight) for the servers to hold; "
                              f"name some with --ps-params PATTERNS (its parameters: {some}), "
                              "or drop --sparse-sync ps")
        if not self.remote:
            raise ConfigError(f"--ps-params {','.join(self.patterns)!r} matches none of the "
                              f"model's parameters ({some}); the patterns are fnmatch "
                              "patterns on these names")
        if len(self.remote) == len(self.names):
            raise ConfigError("--sparse-sync ps would put every parameter of the model on "
                              "the servers, leaving nothing to all-reduce among the trainers: "
                              "use --strategy ps, or name fewer with --ps-params")


class Parallax(GradSync):
    """A trainer's side (module doc): one sync over the whole model that routes each
    parameter to the part that keeps it in step (``dense``: a ``FusedAllreduce`` over
    the trainers; ``rows``: a ``RowSparseAllgather`` for row-sparse parameters kept on
    the trainers, or None to put them in the buckets; ``push``: a ``PushPull`` to the
    servers for the remote ones). Only the dense and kept parameters are yielded to the
    replicated optimizer; the remote ones come back from the servers."""

    name = "parallax"
    #: the runtime broadcasts every parameter from the first trainer at start; the
    #: remote ones are then replaced by the servers' with the first pull
    updates_remotely = False
    hook = None  # (no compression hook on the buckets)

    def __init__(self, split, dense, rows, push):
        super().__init__()
        self.split, self.dense, self.rows, self.push = split, dense, rows, push
        self.checkpoints = False
        self.rows_names = ()  # the remote parameters that travel as rows
        self._wait = 0.0
        self._steps = 0
        self._pushed = 0  # bytes to the servers since the last metrics
        self._pulled = 0  # bytes from the servers in their answers

    @property
    def wants_hooks(self):
        return self.dense.wants_hooks

    def setup(self, ctx, named_params):
        """Collective over the trainers (the buckets' overlap decision)."""
        super().setup(ctx, named_params)
        split = self.split
        split.bind(ctx.model)
        remote = [(n, p) for n, p in named_params if n in split.remote]
        kept = [(n, p) for n, p in named_params if n in split.rows and n not in split.remote
                and self.rows is not None]
        taken = {n for n, _ in remote + kept}
        self.dense.setup(ctx, [(n, p) for n, p in named_params if n not in taken])
        if self.rows is not None:
            self.rows.setup(ctx, kept)
        self.push.checkpoints = self.checkpoints
        self.push.setup(ctx, remote)
        self.rows_names = tuple(n for n, _ in remote if n in split.rows)

    # -- a step
    def begin_step(self):
        self.push.begin_step()  # the first step pulls the servers' parameters
        self.dense.begin_step()
        if self.rows is not None:
            self.rows.begin_step()

    def on_grads_ready(self, names):
        self.dense.on_grads_ready(names)

    def finish(self):
        push, stats = self.push, self.push.worker.stats
        for name in self.rows_names:  # the arrays the all-gather would send
            p = self.params[name]
            p.grad = as_rows(p)
        sent, received = stats["bytes_sent"], stats["bytes_received"]
        push.start()  # first, so the servers work while the trainers all-reduce
        yield from self.dense.finish()
        if self.rows is not None:
            yield from self.rows.finish()
        push.complete()
        self._steps += 1
        self._pushed += stats["bytes_sent"] - sent
        self._pulled += stats["bytes_received"] - received
        self._wait = (self.dense.wait_seconds() + push.wait_seconds()
                      + (self.rows.wait_seconds() if self.rows is not None else 0.0))

    def wait_seconds(self):
        return self._wait

    def epoch_cut(self):
        return False  # (--epoch-quorum is refused)

    # -- the servers' barrier (evaluation, the trainer's collectives, checkpoints)
    def prepare_eval(self):
        self.push.prepare_eval()

    def before_collective(self):
        self.push.before_collective()

    # -- reporting
    def bytes_per_step(self):
        """Per trainer and step: the buckets' ring all-reduce (formula), the kept rows'
        all-gather, and the bytes pushed to the servers (counted)."""
        out = self.dense.bytes_per_step() + self._pushed / max(self._steps, 1)
        if self.rows is not None:
            out += self.rows.bytes_per_step()
        return out

    def metrics(self):
        steps = max(self._steps, 1)
        out = {"ps_bytes_pushed_per_step": self._pushed / steps,
               "ps_bytes_pulled_per_step": self._pulled / steps}
        self._steps = self._pushed = self._pulled = 0
        out.update(self.dense.metrics())
        if self.rows is not None:
            out.update(self.rows.metrics())
        out.update(self.push.metrics())
        return out

    def describe(self):
        push = self.push
        remote = sorted(self.split.remote)
        lines = [f"Parallax: {len(remote)} parameter(s) on {len(push.server_ranks)} "
                 f"server(s) ({', '.join(remote[:4])}{', ...' if len(remote) > 4 else ''}), "
                 f"mode {push.mode_cfg.mode}; the rest kept in step among "
                 f"{len(push.worker_ranks)} trainer(s)"]
        lines += self.dense.describe()
        if self.rows is not None:
            lines += self.rows.describe()
        return lines

    def memory(self, ledger):
        self.dense.memory(ledger)

    # -- checkpoints (between epochs: the servers' optimizer state on the root)
    def state_dict(self):
        return self.push.state_dict()

    def load_state_dict(self, state):
        self.push.load_state_dict(state)

    def finish_training(self):
        self.push.finish_training()

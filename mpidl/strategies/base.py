"""The interface the trainer drives: how one training step runs across ranks.

A strategy decides how replicas stay in step (one process, all-reduce data parallelism,
a parameter server, ...). The trainer owns everything else — data, epochs, learning-rate
schedule, evaluation, metrics, checkpoints — and talks to the strategy only through this
class, so a new strategy is one module and no trainer change.

Life cycle, on every rank::

    s = make_strategy(name, comm, **options)   # local work only: no communication
    s.setup(model, optimizer, loss)            # collective: e.g. broadcast parameters
    index, count = s.shard()                   # which piece of each global batch is mine
    if s.trains_on_data:
        for each step: optimizer.lr = ...; loss = s.train_step(x, y)
        s.prepare_eval(); ... s.reduce({...}, "sum") ...
    else:
        s.serve()                              # e.g. a parameter server answers workers
    s.state_dict() / s.load_state_dict(...)    # collective; extra state for checkpoints
    s.finish()

Rules a strategy keeps:

* ``__init__`` must not communicate: it runs before the ranks have agreed that the
  configuration is valid, and a rank that already failed would leave the others waiting.
  Collective work belongs in ``setup``.
* ``shard()`` returns the same ``count`` on every rank and a distinct ``index`` per
  training rank; the data loader gives rank ``index`` the ``index``-th contiguous piece of
  every global batch (see ``mpidl.data.loader``), so all training ranks run the same
  number of steps.
* Settings of its own (beyond ``algorithm``, ``bucket_mb``, ``overlap``,
  ``compression``, ``ratio``) are declared in the module as ``CLI_OPTIONS``, a list of
  ``mpidl.config.Option`` in the group "parallelism"; they become ``mpidl train`` flags
  and config keys, and reach ``__init__`` as keyword arguments when set.
* ``reduce``, ``gather``, ``bcast``, ``barrier``, ``state_dict`` and ``load_state_dict``
  are collective over all ranks of the strategy's communicator: every rank calls them in
  the same order (server ranks included; they may contribute nothing).
"""

from mpidl.engine.dropout import Dropout
from mpidl.errors import ConfigError


def _mpi(comm):
    """The mpi4py communicator under ``comm`` (an mpidl Communicator or an mpi4py one)."""
    return getattr(comm, "mpi", comm)


class Strategy:
    """Base class; ``train_step`` is the one method every strategy must write.

    ``comm`` is an ``mpidl.comm.Communicator`` (or any object with ``rank``, ``size`` and
    ``mpi``, the mpi4py communicator), or None for a single process. ``options`` are the
    command line's strategy flags (``algorithm``, ``bucket_mb``, ``overlap``,
    ``compression``, ``ratio``, ...), passed through untouched.
    """

    name = "base"
    #: False on ranks that hold no data and run ``serve()`` instead (parameter servers).
    trains_on_data = True
    #: True when a consistent checkpoint exists only between epochs (the parameter
    #: server's barrier): the trainer then writes one at every epoch's end and refuses
    #: ``--checkpoint-every``.
    checkpoint_at_epoch_end = False
    #: Set by the trainer before ``setup`` when checkpoints are on, so a strategy can keep
    #: what a checkpoint will need.
    checkpoints = False

    def __init__(self, comm=None, **options):
        self.comm = comm
        self.options = options
        self.model = self.optimizer = self.loss = None

    # -- who am I
    @property
    def rank(self):
        return 0 if self.comm is None else self.comm.rank

    @property
    def size(self):
        return 1 if self.comm is None else self.comm.size

    @property
    def is_root(self):
        """The rank that logs, prints metrics and writes checkpoints."""
        return self.rank == 0

    def shard(self):
        """(index, count): this rank's piece of every global batch; every rank trains."""
        return self.rank, self.size

    # -- training
    def setup(self, model, optimizer, loss):
        """Take the model, optimizer and loss; collective (e.g. broadcast parameters)."""
        self.model, self.optimizer, self.loss = model, optimizer, loss
        model.needs_input_grad = False  # nobody uses the gradient w.r.t. the images
        index, _ = self.shard()
        for _, layer in model.modules():  # each share of the data its own dropout masks
            if isinstance(layer, Dropout):
                layer.stream = index

    def train_step(self, x, y):
        """One step on this rank's batch (x, y), parameters updated; returns the local loss."""
        raise NotImplementedError

    def epoch_cut(self):
        """True when this rank should end its epoch before its share of the data is
        done (a parameter server's ``--epoch-quorum``); checked after every step."""
        return False

    def serve(self):
        """Run a non-training rank (``trains_on_data`` False) until training is over."""
        raise NotImplementedError(f"strategy {self.name!r} has no server role")

    def prepare_eval(self):
        """Make ``self.model`` hold the parameters to evaluate (e.g. pull from servers)."""

    def metrics(self):
        """Extra {name: number} for the epoch's metrics line (e.g. parameter-server counts);
        called once per epoch, after the epoch's evaluation."""
        return {}

    # -- collectives for the trainer
    def reduce(self, values, op="mean"):
        """{name: float} summed ("sum") or averaged ("mean") over the training ranks.

        Ranks that do not train pass zeros and are not counted in the mean.
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce op must be 'sum' or 'mean', got {op!r}")
        if self.comm is None or self.size == 1:
            return {k: float(v) for k, v in values.items()}
        keys = sorted(values)
        mine = [float(values[k]) if self.trains_on_data else 0.0 for k in keys]
        both = _mpi(self.comm).allgather((mine, self.trains_on_data))
        # sum in rank order on every rank: the same bits everywhere, whatever MPI does
        totals = [0.0] * len(keys)
        for row, _ in both:
            totals = [t + v for t, v in zip(totals, row)]
        if op == "mean":
            n = max(1, sum(1 for _, trains in both if trains))
            totals = [t / n for t in totals]
        return dict(zip(keys, totals))

    def average(self, values):
        return self.reduce(values, "mean")

    def gather(self, obj):
        """Every rank's ``obj`` as a list (rank order) on the root, None elsewhere."""
        if self.comm is None or self.size == 1:
            return [obj]
        return _mpi(self.comm).gather(obj, root=0)

    def bcast(self, obj):
        """The root's ``obj`` on every rank."""
        if self.comm is None or self.size == 1:
            return obj
        return _mpi(self.comm).bcast(obj, root=0)

    def barrier(self):
        if self.comm is not None and self.size > 1:
            _mpi(self.comm).Barrier()

    # -- checkpoints
    def state_dict(self):
        """Extra state to checkpoint (e.g. error-feedback residuals); collective.

        The value returned on the root is saved; nested dicts/lists of arrays, numbers
        and strings are fine. Per-rank state must be gathered to the root here.
        """
        return {}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned on the root; called on every rank."""

    def finish(self):
        """Called once at the end: flush pending communication, stop helper threads."""


def check_options(strategy, known, options):
    """Raise ConfigError when ``options`` holds a flag ``strategy`` does not understand."""
    unknown = sorted(k for k, v in options.items() if v is not None and k not in known)
    if unknown:
        raise ConfigError(f"strategy {strategy!r} does not take option(s) "
                          f"{', '.join(unknown)}; it takes {', '.join(sorted(known)) or 'none'}")

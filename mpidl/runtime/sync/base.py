"""The interface of a gradient sync: how one group of parameters' gradients become the
gradients the optimizer applies.

A step (``mpidl.runtime.Runtime.train_step``) is a *schedule* (forward and backward over
the micro-batches), then, for every sync in turn, ``finish()``: each sync yields the
names of parameters whose gradients are ready, in an order every rank shares, and the
*optimizer placement* steps them at once (so an update can start while later buckets
are still travelling). A sync owns a disjoint set of parameters, chosen when the runtime
is built (dense ones to fused buckets, Embedding's row-sparse ones to an all-gather, all
of them to a parameter server, ...).

Life cycle, on every training rank::

    sync.setup(ctx, named_params)      # collective
    each step: sync.begin_step(); [sync.on_grads_ready(names) from backward hooks];
               for names in sync.finish(): optimizer.step(names)
    sync.metrics(); sync.state_dict(); sync.finish_training()
"""


class GradSync:
    """Base class: a sync that keeps every gradient as it is (no communication)."""

    #: short name for logs and ``describe()``
    name = "none"
    #: True when ``on_grads_ready`` should be called from backward hooks during the
    #: step's final backward pass (overlap of communication with backward)
    wants_hooks = False
    #: parameters whose updates come back from elsewhere (a parameter server): the
    #: optimizer placement must not step them locally
    updates_remotely = False

    def __init__(self):
        self.names = []
        self.params = {}

    def setup(self, ctx, named_params):
        """Take the (name, Parameter) pairs this sync owns; collective over ``ctx``'s group."""
        self.params = dict(named_params)
        self.names = [n for n, _ in named_params]

    def begin_step(self):
        """Called before the step's first forward."""

    def on_grads_ready(self, names):
        """Backward hook (final pass only): these parameters' gradients are final."""

    def finish(self):
        """After backward: yield lists of parameter names whose gradients are ready."""
        if self.names:
            yield self.names

    def wait_seconds(self):
        """Seconds of the last ``finish`` spent waiting on communication."""
        return 0.0

    def prepare_eval(self):
        """Before an evaluation (e.g. meet the other workers at a parameter server)."""

    def gather_params(self):
        """Before the whole model is read (``Runtime.full_state``, checkpoints): the
        parameters this sync owns whole on this rank; collective over its group (ZeRO
        stage 3 gathers its shards, the others hold them whole already)."""

    def before_collective(self):
        """Before the trainer's own collectives (reduce, gather, barrier) on this rank."""

    def metrics(self):
        """Extra {name: number} for the epoch line; resets per-epoch counts."""
        return {}

    def describe(self):
        """Lines for the log."""
        return []

    def memory(self, ledger):
        """Add the arrays this sync holds to ``ledger`` (``mpidl.runtime.memory.Ledger``;
        the model's parameters and gradients are added by the runtime before)."""

    def state_dict(self):
        """Extra state to checkpoint; collective over the training ranks."""
        return {}

    def load_state_dict(self, state):
        pass

    def finish_training(self):
        """Once, at the end (flush, say goodbye to servers, check step counts)."""

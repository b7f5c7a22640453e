"""Your own training loop on many ranks: wrap the optimizer and go (Horovod's pattern).

::

    comm = Communicator()                                  # every rank
    opt = DistributedOptimizer(SGD(model.named_parameters(), lr=0.1), model, comm)
    for x, y in my_batches:                                # this rank's share of the data
        opt.zero_grad()
        loss.forward(model(x), y)
        model.backprop(loss.backward())
        opt.step()                                         # average over ranks, then update

Building it is collective: rank 0's parameters and buffers are broadcast, so every
replica starts identical. ``step()`` runs the same gradient syncs as ``--strategy
allreduce`` (fused buckets, the row-sparse all-gather for Embedding, ``compression=``)
and then the wrapped optimizer. Options are the allreduce preset's (``algorithm``,
``bucket_mb``, ``compression``, ``ratio``, ``sparse_grads``, ``sync_bn``); overlap with
backward is off here (the wrapper cannot know which backward of yours is the last
before ``step``). ``sync_buffers()`` averages BatchNorm statistics before you evaluate.
"""

from mpidl.runtime.presets import build


class DistributedOptimizer:
    """An optimizer whose ``step`` first averages the gradients over ``comm``'s ranks."""

    def __init__(self, optimizer, model, comm=None, **options):
        if options.get("overlap") not in (None, "off", False):
            raise ValueError("DistributedOptimizer syncs after your backward: overlap "
                             "must be off (use the Trainer for overlap)")
        options["overlap"] = "off"
        self.optimizer = optimizer
        self.model = model
        self.runtime = build("allreduce", comm, **options)
        self.runtime.setup(model, optimizer, loss=None)
        self._open = False

    @property
    def lr(self):
        return self.optimizer.lr

    @lr.setter
    def lr(self, value):
        self.optimizer.lr = value

    def zero_grad(self):
        """Clear the gradients (call it before each step's forward)."""
        self.runtime.begin_step()
        self._open = True

    def step(self):
        """Average the gradients over the ranks, then update (the same on every rank)."""
        if not self._open:  # zero_grad was not called: open the step now
            for _, s in self.runtime.syncs:
                s.begin_step()
        self.runtime.finish_step()
        self._open = False

    def sync_buffers(self):
        """Average BatchNorm running statistics over the ranks (collective)."""
        self.runtime.sync_buffers()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

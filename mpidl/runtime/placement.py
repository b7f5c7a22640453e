"""Where the optimizer runs: the third part of a step (after the schedule and the syncs).

* ``Replicated``: every training rank holds the whole optimizer state and steps the
  parameters whose gradients a sync has made ready (the same update on every rank, so
  replicas stay identical). Data parallelism and one process.
* ``OnServers``: parameter servers hold the optimizer (each for its shard); a worker
  never steps, it takes the parameters the servers send back.

A ZeRO-sharded placement (each data-parallel rank steps its shard, then the shards are
all-gathered) is the next one.
"""


class Replicated:
    """The whole optimizer on every training rank."""

    name = "replicated"

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def zero_grad(self, model):
        self.optimizer.zero_grad()
        model.zero_grad()

    def step(self, names, coef=1.0):
        """Step the parameters of ``names``; their gradients times ``coef`` first (the
        clipping coefficient, ``mpidl.runtime.clip``)."""
        if coef != 1.0:
            from mpidl.runtime.clip import scale_grads  # noqa: PLC0415

            scale_grads(self.optimizer, names, coef)
        held = self.optimizer.params
        self.optimizer.step([n for n in names if n in held])

    def memory(self, ledger):
        """The optimizer's state arrays, for the memory ledger."""
        ledger.add("mem_optimizer", state_arrays(self.optimizer))


class OnServers:
    """The optimizer lives on the parameter servers: nothing to step here."""

    name = "on-servers"

    def __init__(self, optimizer):
        self.optimizer = optimizer  # only its learning rate is used (sent with pushes)

    def zero_grad(self, model):
        model.zero_grad()

    def memory(self, ledger):
        pass  # the optimizer state lives on the servers

    def step(self, names, coef=1.0):
        raise RuntimeError(f"parameters {list(names)[:3]} are updated by the parameter "
                           "servers, not on this worker")


def state_arrays(optimizer):
    """Every array of an optimizer's per-parameter state."""
    return [v for st in optimizer.state.values() for v in st.values()
            if hasattr(v, "nbytes")]

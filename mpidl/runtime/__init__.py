"""The parallel runtime: a training step built from parts (schedule, gradient syncs,
optimizer placement), the roles ranks play, and what the trainer asks of the ranks.

    from mpidl.runtime import build
    rt = build("allreduce", comm, algorithm="ring", accumulate=4)   # --strategy presets
    rt.setup(model, optimizer, loss)                                 # collective
    loss = rt.train_step(x, y)

``runtime.Runtime`` composes the parts; ``presets`` holds ``--strategy local|allreduce|ps``;
``schedule``, ``sync/`` and ``placement`` are the parts; ``server`` is the parameter
server's role; ``fusion`` lays gradients out in buckets; ``distributed`` wraps an
optimizer for a loop of your own (Horovod's pattern).
"""

from mpidl.runtime.presets import build, canonical, cli_options, names
from mpidl.runtime.runtime import Runtime

__all__ = ["Runtime", "build", "canonical", "cli_options", "names"]

"""mpidl: a pure-MPI toolkit for training neural networks on many processes.

The names below load on first use, so ``import mpidl`` stays cheap (the ``mpidl``
command sets each rank's BLAS threads before NumPy is imported):

- ``mpidl.Communicator``: collectives and point-to-point over MPI (``mpidl.comm``);
- ``mpidl.build_runtime``: a training step built from parts (``mpidl.runtime.build``);
- ``mpidl.Trainer``: the training loop (``mpidl.training.trainer``);
- ``mpidl.DistributedOptimizer``: your own loop on many ranks (``mpidl.runtime.distributed``).
"""

__version__ = "0.1.0"

_LAZY = {
    "Communicator": ("mpidl.comm", "Communicator"),
    "build_runtime": ("mpidl.runtime", "build"),
    "Trainer": ("mpidl.training.trainer", "Trainer"),
    "DistributedOptimizer": ("mpidl.runtime.distributed", "DistributedOptimizer"),
}


def __getattr__(name):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'mpidl' has no attribute {name!r}") from None
    import importlib  # noqa: PLC0415

    return getattr(importlib.import_module(module), attr)


__all__ = sorted(_LAZY)

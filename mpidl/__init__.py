"""mpidl: a pure-MPI toolkit for training neural networks on many processes.

The names below load on first use, so ``import mpidl`` stays cheap (the ``mpidl``
command sets each rank's BLAS threads before NumPy is imported):

- ``mpidl.Communicator``: collectives and point-to-point over MPI (``mpidl.comm``);
- ``mpidl.build_runtime``: a training step built from parts (``mpidl.runtime.build``);
- ``mpidl.Trainer``: the training loop (``mpidl.training.trainer``);
- ``mpidl.DistributedOptimizer``: your own loop on many ranks (``mpidl.runtime.distributed``).
"""

__version__ = "0.1.0"


def _find_kernels():
    """Make sure ``mpidl.kernels`` is the one beside this ``mpidl``, or fail now in one line.

    ``kernels/`` sits beside ``mpidl/`` in the source tree and installs as ``mpidl.kernels``.
    Imported from a checkout (``python -m pytest`` there, which shadows an installed mpidl;
    ``PYTHONPATH=checkout``; an editable install whose setuptools did not map the folder),
    nothing else finds the checkout's ``kernels/``, or finds another tree's: then it is the
    checkout's that answers for ``mpidl.kernels``. A finder, not an eager import, so
    ``import mpidl`` still loads no NumPy.
    """
    import importlib.abc
    import importlib.util
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__))
    if os.path.isfile(os.path.join(package, "kernels", "__init__.py")):
        return  # installed: mpidl/kernels/ is a real folder
    tree = os.path.dirname(package)
    folder = os.path.join(tree, "kernels")
    init = os.path.join(folder, "__init__.py")
    if os.path.isfile(init) and os.path.isfile(os.path.join(tree, "pyproject.toml")):

        class CheckoutKernels(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name != __name__ + ".kernels":
                    return None
                return importlib.util.spec_from_file_location(
                    name, init, submodule_search_locations=[folder])

        sys.meta_path.insert(0, CheckoutKernels())
    elif importlib.util.find_spec(__name__ + ".kernels") is None:
        raise ImportError(
            f"mpidl: error: the mpidl in {package} has no mpidl.kernels (a broken install): "
            "reinstall it (pip install --force-reinstall --no-deps mpidl, or . in a checkout)")


_find_kernels()

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

"""Strategies: how replicas stay in step. ``make_strategy(name, comm, **options)``.

A strategy is a module here that defines ``STRATEGY``, a subclass of
``mpidl.strategies.base.Strategy``. ``--strategy NAME`` imports ``mpidl.strategies.NAME``
(or the module an alias below names) only when asked for, so adding a strategy means
adding its module, and a missing one gives a clear error instead of an ImportError.
"""

import importlib

from mpidl.errors import ConfigError
from mpidl.strategies.base import Strategy

#: short names on the command line -> module under mpidl.strategies
ALIASES = {
    "allreduce": "data_parallel",
    "dp": "data_parallel",
    "ps": "parameter_server",
}


def strategy_class(name):
    """The Strategy subclass for ``name`` (an alias or a module name under mpidl.strategies)."""
    if not name.replace("_", "").isalnum():
        raise ConfigError(f"bad strategy name {name!r}; available: {', '.join(available())}")
    module_name = "mpidl.strategies." + ALIASES.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # the module exists but needs something missing: a bug
            raise
        raise ConfigError(f"strategy {name!r} is not available in this version of mpidl "
                          f"(no module {module_name}); available: "
                          f"{', '.join(available()) or 'local'}") from None
    cls = getattr(module, "STRATEGY", None)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"{module_name} must define STRATEGY, a subclass of Strategy")
    return cls


def make_strategy(name, comm=None, **options):
    """A new strategy ``name`` on ``comm`` with the command line's ``options``."""
    return strategy_class(name)(comm, **options)


def available():
    """Names usable with --strategy in this installation (aliases included)."""
    import pkgutil  # noqa: PLC0415

    here = __path__  # noqa: F821 - package attribute
    modules = {m.name for m in pkgutil.iter_modules(here)} - {"base"}
    names = sorted(modules | {a for a, m in ALIASES.items() if m in modules})
    return names


__all__ = ["Strategy", "make_strategy", "strategy_class", "available", "ALIASES"]

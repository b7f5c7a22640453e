"""Your own model on the command line: ``mpidl train --model FILE.py:FUNC``.

``FUNC(input_shape, num_classes, rng, dtype)`` — the signature of the built-in builders
in ``mpidl.engine.models`` — must return an mpidl ``Layer`` (a ``Sequential`` of engine
layers, or a ``Layer`` subclass of your own). ``rng`` is a ``numpy.random.Generator``
seeded from ``--seed``; draw every initial weight from it so all ranks build the same
model. The file is imported fresh by path (it need not be on ``sys.path``). A missing
file or function, a file that fails to import, or a wrong return type is one
``ValueError`` saying which and what to do.
"""

import importlib.util
import os
import sys


def is_model_file(name):
    """True for a ``FILE.py:FUNC`` model spec (a built-in name has no ``.py:``)."""
    return isinstance(name, str) and ".py:" in name


def load_model_function(spec):
    """The callable ``FUNC`` from ``FILE.py:FUNC``."""
    path, _, func = spec.rpartition(":")
    if not path.endswith(".py") or not func.isidentifier():
        raise ValueError(f"expected FILE.py:FUNC (a Python file and the name of a function "
                         f"in it), got {spec!r}")
    if not os.path.isfile(path):
        raise ValueError(f"no such file {path!r}")
    module_name = "mpidl_user_model_" + "".join(c if c.isalnum() else "_" for c in
                                                os.path.abspath(path))
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: say what went wrong in one line
        raise ValueError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    sys.modules.setdefault(module_name, module)
    fn = getattr(module, func, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_") and
                         getattr(v, "__module__", None) == module_name)
        raise ValueError(f"{path} defines no {func!r}" + (
            f" (it defines {', '.join(defined)})" if defined else ""))
    if not callable(fn):
        raise ValueError(f"{path}: {func!r} is not a function")
    return fn


def check_model(model, spec):
    """``model`` must be an mpidl Layer; else a ValueError saying what came back."""
    from mpidl.engine.module import Layer  # noqa: PLC0415

    if not isinstance(model, Layer):
        raise ValueError(f"{spec} returned {type(model).__name__}, not an mpidl Layer: "
                         "build the model from mpidl.engine layers (e.g. Sequential(...)) or "
                         "subclass mpidl.engine.Layer")
    return model

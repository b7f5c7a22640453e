"""Weight initializers, drawn on the host and then moved to the device.

Every draw comes from a ``numpy.random.Generator`` in float64 and is rounded to the
layer's dtype on the host, so one seed gives bitwise the same model on every rank, on
CPU and on GPU. ``fan_in``/``fan_out`` are passed explicitly because layers lay their
weights out differently (Linear ``(in, out)``, Conv2d ``(out, in, kh, kw)``).
"""

import math

import numpy as np

from mpidl.backend import to_device
from mpidl.engine.lazy import LazyRNG, defer, elementwise


def as_generator(rng):
    """A ``numpy.random.Generator`` from a Generator, an int seed, or None (seed 0).

    None means seed 0 rather than fresh entropy: an MPI program must build the same
    model on every rank, so the default is deterministic. Pass distinct generators (or
    use ``build_model``, which threads one generator through all layers) to get
    different weights in layers of the same shape.
    """
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(0 if rng is None else rng)


def _uniform(rng, shape, bound):
    return rng.uniform(-bound, bound, size=shape)


@elementwise(draws=1)
def he_uniform(rng, shape, fan_in, fan_out=None):
    """Kaiming/He uniform for ReLU nets: U(-b, b), b = sqrt(6 / fan_in)."""
    return _uniform(rng, shape, math.sqrt(6.0 / fan_in))


@elementwise
def he_normal(rng, shape, fan_in, fan_out=None):
    """Kaiming/He normal for ReLU nets: N(0, 2 / fan_in)."""
    return rng.normal(0.0, math.sqrt(2.0 / fan_in), size=shape)


@elementwise(draws=1)
def glorot_uniform(rng, shape, fan_in, fan_out):
    """Glorot/Xavier uniform: U(-b, b), b = sqrt(6 / (fan_in + fan_out))."""
    return _uniform(rng, shape, math.sqrt(6.0 / (fan_in + fan_out)))


@elementwise
def glorot_normal(rng, shape, fan_in, fan_out):
    """Glorot/Xavier normal: N(0, 2 / (fan_in + fan_out))."""
    return rng.normal(0.0, math.sqrt(2.0 / (fan_in + fan_out)), size=shape)


@elementwise(draws=1)
def lecun_uniform(rng, shape, fan_in, fan_out=None):
    """U(-b, b), b = sqrt(3 / fan_in) (unit variance for linear/tanh layers)."""
    return _uniform(rng, shape, math.sqrt(3.0 / fan_in))


@elementwise
def normal(rng, shape, fan_in=None, fan_out=None):
    """N(0, 1) (Embedding's default, as in PyTorch)."""
    return rng.standard_normal(size=shape)


@elementwise(draws=0)
def zeros(rng, shape, fan_in=None, fan_out=None):
    return np.zeros(shape)


@elementwise(draws=0)
def ones(rng, shape, fan_in=None, fan_out=None):
    return np.ones(shape)


INITIALIZERS = {
    "he_uniform": he_uniform,
    "he_normal": he_normal,
    "glorot_uniform": glorot_uniform,
    "glorot_normal": glorot_normal,
    "lecun_uniform": lecun_uniform,
    "normal": normal,
    "zeros": zeros,
    "ones": ones,
}


def initialize(init, shape, fan_in=None, fan_out=None, rng=None, dtype="float32"):
    """Draw an array of ``shape`` with initializer ``init`` (a name or a callable
    ``f(rng, shape, fan_in, fan_out) -> ndarray``) and return it on the device. Under a
    ``LazyRNG`` (``mpidl.engine.lazy``) an ``elementwise`` initializer returns a
    ``LazyInit`` instead, drawn later where the values are kept."""
    if callable(init):
        fn = init
    else:
        try:
            fn = INITIALIZERS[init]
        except KeyError:
            raise ValueError(f"unknown initializer {init!r}: expected one of "
                             f"{', '.join(sorted(INITIALIZERS))} or a callable") from None
    if isinstance(rng, LazyRNG):  # a lazy build: draw later, where the values are kept
        lazy = defer(fn, tuple(shape), fan_in, fan_out, rng, dtype)
        if lazy is not None:
            return lazy
    host = np.asarray(fn(as_generator(rng), tuple(shape), fan_in, fan_out))
    if host.shape != tuple(shape):
        raise ValueError(f"initializer {init!r} returned shape {host.shape}, expected {tuple(shape)}")
    return to_device(host.astype(np.dtype(dtype)))

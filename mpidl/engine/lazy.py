"""Deferred initialization: parameters drawn only where a rank keeps them.

Tensor and pipeline parallelism keep a slice of some layers, or some of the layers, on
each rank. Built eagerly, every rank would first draw the whole model from the seed, so
the largest model that could start is the one that fits a single rank. Built lazily
(``build_model(..., lazy=True)``, which threads a ``LazyRNG`` through the layers), each
initializer records where its draw starts in the generator's stream and skips over it
without keeping the values: the parameter holds a ``LazyInit``, a few hundred bytes.
When the runtime has cut the model, ``LazyInit.values`` draws again from that point,
piece by piece, keeping only this rank's slice (``mpidl.runtime.tensor_parallel``);
layers another stage keeps are never drawn (``mpidl.runtime.pipeline``); ZeRO stage 3
draws each rank's chunk of its buckets (``values_flat``, ``mpidl.runtime.zero``);
``materialize`` draws whatever is left whole.

Exact: the initializers draw element after element in C order (``elementwise``), so a
draw cut into pieces gives the same numbers as one draw and leaves the generator in the
same state, and a slice drawn lazily holds bitwise the values of the same slice of the
eagerly built model. An initializer not marked ``elementwise`` (a user's orthogonal init,
say) is drawn eagerly at build time, whole: still exact, just not deferred.

The price is time, not memory: a lazy build skips over every number (by drawing it, at
most ``CHUNK`` at a time, or, for uniform draws, by jumping the generator ahead) and
draws again the ones a rank keeps.
"""

from contextlib import contextmanager

import numpy as np

#: elements drawn at a time when skipping or drawing a lazy parameter (2 MiB of float64)
CHUNK = 1 << 18


def elementwise(fn=None, draws=None):
    """Mark initializer ``fn(rng, shape, fan_in, fan_out)`` as drawing independent
    elements in C order, so that pieces of a draw give the numbers of the whole draw (what
    a lazy build relies on); returns ``fn``. ``draws``: the generator's 64-bit outputs it
    takes per element when that is fixed (0: a constant; 1: uniform doubles), so a lazy
    build can skip its draw by advancing the generator instead of drawing (None:
    unknown, as a normal's rejection sampling; skipped by drawing)."""
    def mark(f):
        f.elementwise = True
        f.draws = draws
        return f
    return mark if fn is None else mark(fn)


class LazyRNG(np.random.Generator):
    """A ``numpy.random.Generator`` that tells the initializers to defer their draws.

    It shares the bit generator of the generator it wraps, so every draw not made by an
    initializer (dropout seeds, a user model's own ``rng.normal``) comes from the same
    stream, in the same order, as in an eager build."""

    def __init__(self, rng):
        super().__init__(rng.bit_generator)


class Deferred:
    """An array not in memory yet, made on demand: a lazily built parameter
    (``LazyInit``), a checkpoint's tensor not read yet (``mpidl.training.checkpoint.Ref``).
    It answers ``shape``, ``dtype``, ``ndim``, ``size``, ``itemsize`` and ``nbytes`` as an
    array would; ``values(dim, lo, hi)`` makes the whole host array, or only its slice
    ``[lo, hi)`` along ``dim`` (what a tensor-parallel rank keeps)."""

    __slots__ = ()

    def values(self, dim=None, lo=None, hi=None):
        raise NotImplementedError

    def part(self, dim, lo, hi):
        """The slice ``[lo, hi)`` along ``dim``, deferred too (made when asked)."""
        return _Part(self, dim, lo, hi)

    def values_flat(self, lo, hi):
        """Elements ``[lo, hi)`` of the flattened values (a 1-D host array; what a ZeRO
        rank keeps of a tensor: its chunks are flat). Subclasses that can make a part
        without the whole override it."""
        return self.values().reshape(-1)[lo:hi].copy()

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize


class _Part(Deferred):
    """``Deferred.part``: a slice of a deferred array, itself deferred."""

    __slots__ = ("whole", "dim", "lo", "hi", "shape", "dtype")

    def __init__(self, whole, dim, lo, hi):
        self.whole, self.dim, self.lo, self.hi = whole, dim, lo, hi
        shape = list(whole.shape)
        shape[dim] = hi - lo
        self.shape, self.dtype = tuple(shape), whole.dtype

    def values(self, dim=None, lo=None, hi=None):
        if dim is None:
            return self.whole.values(self.dim, self.lo, self.hi)
        if dim == self.dim:
            return self.whole.values(dim, self.lo + lo, self.lo + hi)
        index = [slice(None)] * self.ndim
        index[dim] = slice(lo, hi)
        return self.values()[tuple(index)].copy()


class LazyInit(Deferred):
    """The initial values of one parameter, not drawn yet: initializer ``fn``, ``shape``,
    ``dtype``, fans, and the bit generator's state where its draw begins."""

    __slots__ = ("fn", "shape", "dtype", "fan_in", "fan_out", "bit_generator", "state",
                 "on_gpu")

    def __init__(self, fn, shape, dtype, fan_in, fan_out, rng):
        from mpidl.backend import device  # noqa: PLC0415

        self.fn = fn
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.fan_in, self.fan_out = fan_in, fan_out
        self.bit_generator = type(rng.bit_generator)
        self.state = rng.bit_generator.state
        self.on_gpu = device() == "gpu"  # where it will be drawn into (array_module)

    def _pieces(self, stop, rng, rows=False):
        """Draw elements ``0 .. stop - 1`` of the flat C-order stream from ``rng``, at most
        ``CHUNK`` at a time (``rows``: whole rows of axis 0, at least one): yields (first
        element, host array of the parameter's dtype)."""
        step = CHUNK
        if rows:
            row = self._row()
            step = max(1, CHUNK // row) * row
        first = 0
        while first < stop:
            n = min(step, stop - first)
            values = np.asarray(self.fn(rng, (n,), self.fan_in, self.fan_out))
            yield first, values.astype(self.dtype, copy=False)
            first += n

    def _row(self):
        """Elements in one row of axis 0."""
        return self.size // self.shape[0] if self.ndim and self.shape[0] else 1

    def _generator(self):
        bits = self.bit_generator()
        bits.state = self.state
        return np.random.Generator(bits)

    def skip(self, rng):
        """Advance ``rng`` past this parameter's draw, as drawing it whole would: without
        drawing, where the initializer takes a fixed number of outputs per element and the
        bit generator can jump (PCG64's ``advance``; the 32-bit half it may hold from an
        earlier draw is kept, as a 64-bit draw keeps it)."""
        draws = getattr(self.fn, "draws", None)
        bits = rng.bit_generator
        if draws == 0:
            return
        if draws is not None and type(bits).__name__ in ("PCG64", "PCG64DXSM"):
            held = bits.state
            bits.advance(draws * self.size)
            state = bits.state
            state["has_uint32"], state["uinteger"] = held["has_uint32"], held["uinteger"]
            bits.state = state
            return
        for _ in self._pieces(self.size, rng):
            pass

    def values(self, dim=None, lo=None, hi=None):
        """The values drawn (a host array): whole, or the slice ``[lo, hi)`` along
        ``dim``."""
        rng = self._generator()
        if dim is None:
            out = np.empty(self.size, dtype=self.dtype)
            for first, piece in self._pieces(self.size, rng):
                out[first:first + piece.size] = piece
            return out.reshape(self.shape)
        shape = list(self.shape)
        shape[dim] = hi - lo
        out = np.empty(shape, dtype=self.dtype)
        row = self._row()
        # rows of axis 0 needed: all of them, or (dim 0) those up to hi
        stop = (hi if dim == 0 else self.shape[0]) * row
        for first, piece in self._pieces(stop, rng, rows=True):
            r0 = first // row
            rows = piece.reshape((-1,) + self.shape[1:])
            if dim == 0:
                a, b = max(r0, lo), min(r0 + len(rows), hi)
                if a < b:
                    out[a - lo:b - lo] = rows[a - r0:b - r0]
            else:
                index = [slice(None)] * self.ndim
                index[dim] = slice(lo, hi)
                out[r0:r0 + len(rows)] = rows[tuple(index)]
        return out

    def values_flat(self, lo, hi):
        """Elements ``[lo, hi)`` of the flattened values (a 1-D host array)."""
        out = np.empty(hi - lo, dtype=self.dtype)
        for first, piece in self._pieces(hi, self._generator()):
            a, b = max(first, lo), min(first + piece.size, hi)
            if a < b:
                out[a - lo:b - lo] = piece[a - first:b - first]
        return out

    def __repr__(self):
        return f"LazyInit(shape={self.shape}, dtype={self.dtype})"


def defer(fn, shape, fan_in, fan_out, rng, dtype):
    """What ``initialize`` returns under a ``LazyRNG``: a ``LazyInit`` whose draw ``rng``
    has skipped, or, for an initializer not marked ``elementwise``, None (then it draws
    eagerly)."""
    if not getattr(fn, "elementwise", False):
        return None
    lazy = LazyInit(fn, shape, dtype, fan_in, fan_out, rng)
    if lazy.size:
        lazy.skip(rng)
    return lazy


def flat_slice(a, lo, hi):
    """Elements ``[lo, hi)`` of array ``a`` flattened (a view), or of a ``Deferred`` (made
    now, that part only where it can be)."""
    if isinstance(a, Deferred):
        return a.values_flat(lo, hi)
    return a.reshape(-1)[lo:hi]


def values_of(tree):
    """``tree`` with every ``Deferred`` in it made (a rank's own entry of a checkpoint's
    per-rank state, read where it is loaded)."""
    if isinstance(tree, Deferred):
        return tree.values()
    if isinstance(tree, dict):
        return {k: values_of(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(values_of(v) for v in tree)
    return tree


def is_lazy(a):
    """Whether ``a`` is a lazily built parameter's values, not drawn yet."""
    return isinstance(a, LazyInit)


def is_deferred(a):
    """Whether ``a`` is an array not in memory yet (``Deferred``)."""
    return isinstance(a, Deferred)


def lazy_parameters(model):
    """[(name, Parameter)] of ``model`` whose values are not drawn yet."""
    return [(n, p) for n, p in model.named_parameters() if is_lazy(p.data)]


def materialize(model):
    """Draw every parameter of ``model`` that is still lazy, whole, onto the device;
    returns how many it drew. (A tied weight is one ``Parameter``: drawn once.)"""
    from mpidl.backend import to_device  # noqa: PLC0415

    seen = set()
    for _, p in lazy_parameters(model):
        if id(p) not in seen:
            seen.add(id(p))
            p.data = to_device(p.data.values())
    return len(seen)


@contextmanager
def drawn(layer):
    """Within the block, ``layer``'s lazy parameters hold their values (drawn whole);
    after it they are lazy again. For work on one layer at a time (a pipeline timing
    the layers of a model no rank holds whole)."""
    from mpidl.backend import to_device  # noqa: PLC0415

    lazy = {id(p): (p, p.data) for _, p in layer.named_parameters() if is_lazy(p.data)}
    for p, init in lazy.values():
        p.data = to_device(init.values())
    try:
        yield layer
    finally:
        for p, init in lazy.values():
            p.data = init


@contextmanager
def shape_only(model):
    """Within the block, ``model``'s lazy parameters read as zeros of their shape (a
    broadcast scalar, no memory of their own): enough to check the shapes of a forward
    pass, never to train."""
    from mpidl.backend import xp  # noqa: PLC0415

    mod = xp()
    lazy = {id(p): (p, p.data) for _, p in lazy_parameters(model)}
    for p, init in lazy.values():
        p.data = mod.broadcast_to(mod.zeros((), dtype=init.dtype), init.shape)
    try:
        yield model
    finally:
        for p, init in lazy.values():
            p.data = init

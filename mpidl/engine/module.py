"""Parameters, the Layer base class and Sequential.

A layer owns its parameters (``Parameter``: data + grad) and non-trainable buffers
(BatchNorm's running statistics). ``named_parameters()`` gives every parameter a stable
dotted name (``"3.weight"``) in a stable order, identical on every rank: collectives,
fusion buffers and checkpoints rely on it.

Backward hooks: ``Sequential.backward`` calls each hook registered with
``add_grad_ready_hook`` with the names of the parameters whose gradients just became
final. Data parallelism uses it to start a bucket's all-reduce while backward goes on.
"""

from collections import OrderedDict


class SparseGrad:
    """A row-sparse gradient (Embedding): ``values[i]`` is the gradient of row ``indices[i]``.

    Indices may repeat; ``to_dense`` sums duplicates.
    """

    __slots__ = ("indices", "values", "shape")

    def __init__(self, indices, values, shape):
        self.indices = indices
        self.values = values
        self.shape = tuple(shape)

    def coalesce(self):
        """The same gradient with unique, sorted indices (duplicate rows summed)."""
        from mpidl.backend import array_module

        xp = array_module(self.values)
        if len(self.indices) == 0:
            return SparseGrad(self.indices, self.values, self.shape)
        unique, inverse = xp.unique(self.indices, return_inverse=True)
        if len(unique) == len(self.indices):  # no duplicates: just sort
            order = xp.argsort(self.indices)
            return SparseGrad(self.indices[order], self.values[order], self.shape)
        summed = xp.zeros((len(unique),) + tuple(self.values.shape[1:]), dtype=self.values.dtype)
        scatter_add(summed, inverse.reshape(-1), self.values)
        return SparseGrad(unique, summed, self.shape)

    def to_dense(self):
        from mpidl.backend import array_module

        xp = array_module(self.values)
        dense = xp.zeros(self.shape, dtype=self.values.dtype)
        if len(self.indices):
            scatter_add(dense, self.indices, self.values)
        return dense

    def __repr__(self):
        return f"SparseGrad({len(self.indices)} rows of {self.shape})"


def scatter_add(target, indices, values):
    """``target[indices] += values`` with repeated indices summed (NumPy or CuPy)."""
    from mpidl.backend import is_gpu_array

    if is_gpu_array(target):
        import cupyx  # noqa: PLC0415 - only reached with CuPy arrays

        cupyx.scatter_add(target, indices, values)
    else:
        import numpy as np  # noqa: PLC0415

        np.add.at(target, indices, values)


class Parameter:
    """A trainable array and its gradient (None until backward has run)."""

    __slots__ = ("data", "grad")

    def __init__(self, data):
        self.data = data
        self.grad = None

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def size(self):
        return self.data.size


class Layer:
    """Base class: ``forward(x) -> y`` and ``backward(dy) -> dx``.

    Subclasses create parameters with ``self.add_param(name, array)`` and buffers with
    ``self.add_buffer(name, array)``; forward caches what backward needs. Setting
    ``needs_input_grad = False`` (Sequential does it for the layers before its first
    parameter when its own input needs no gradient) lets a layer skip computing ``dx``
    nobody uses; its backward then returns None.

    Conventions every layer keeps, so Sequential can chain them without copies:
    ``backward`` *overwrites* each parameter's ``grad`` (no accumulation), may reuse
    ``dy``'s memory (callers hand it over and must not read it afterwards), and returns a
    writable array the caller may in turn modify. ``forward`` never modifies ``x``.
    """

    def __init__(self):
        self._params = OrderedDict()
        self._buffers = OrderedDict()
        self.training = True
        self.needs_input_grad = True

    # -- parameters and buffers
    def add_param(self, name, data):
        p = Parameter(data)
        self._params[name] = p
        return p

    def add_buffer(self, name, data):
        self._buffers[name] = data
        return data

    def children(self):
        """Sub-layers as (name, layer) pairs; leaf layers have none."""
        return []

    def modules(self, prefix=""):
        """This layer and every layer under it, as (dotted name, layer), parents first."""
        out = [(prefix.rstrip("."), self)]
        for cname, child in self.children():
            out += child.modules(f"{prefix}{cname}.")
        return out

    def named_parameters(self, prefix=""):
        """All parameters of this layer and its children as (dotted name, Parameter)."""
        out = [(prefix + n, p) for n, p in self._params.items()]
        for cname, child in self.children():
            out += child.named_parameters(f"{prefix}{cname}.")
        return out

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix=""):
        out = [(prefix + n, b) for n, b in self._buffers.items()]
        for cname, child in self.children():
            out += child.named_buffers(f"{prefix}{cname}.")
        return out

    def set_buffer(self, name, value):
        """Replace buffer ``name`` (a dotted path for children) in place of the old one."""
        head, _, rest = name.partition(".")
        if rest and head in dict(self.children()):
            dict(self.children())[head].set_buffer(rest, value)
        elif name in self._buffers:
            self._buffers[name] = value
        else:
            raise KeyError(f"{type(self).__name__} has no buffer {name!r}")

    def has_params(self):
        """Whether this layer or one of its children owns a trainable parameter."""
        return bool(self._params) or any(c.has_params() for _, c in self.children())

    def num_parameters(self):
        """Total number of trainable scalars."""
        return sum(p.size for p in self.parameters())

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    # -- modes
    def train(self, mode=True):
        self.training = mode
        for _, child in self.children():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- state
    def state_dict(self):
        """Parameters and buffers as {dotted name: array} (arrays are not copied)."""
        state = OrderedDict((n, p.data) for n, p in self.named_parameters())
        state.update(self.named_buffers())
        return state

    def load_state_dict(self, state):
        """Copy arrays from ``state`` into this model; names and shapes must match."""
        from mpidl.backend import to_device

        own = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        expected = set(own) | set(buffers)
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise KeyError(f"state does not fit the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
        for name, p in own.items():
            value = state[name]
            if tuple(value.shape) != tuple(p.data.shape):
                raise ValueError(f"parameter {name!r}: state has shape {tuple(value.shape)}, "
                                 f"model has {tuple(p.data.shape)}")
            p.data[...] = to_device(value, dtype=p.data.dtype)
        for name in buffers:
            self.set_buffer(name, to_device(state[name]).copy())

    # -- computation
    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)

    def __repr__(self):
        return f"{type(self).__name__}()"


class Sequential(Layer):
    """Layers applied in order; children are named "0", "1", ..."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = list(layers)
        self._grad_ready_hooks = []

    def children(self):
        return [(str(i), layer) for i, layer in enumerate(self.layers)]

    def add_grad_ready_hook(self, fn):
        """Call ``fn(names)`` whenever backward finishes the gradients of ``names``."""
        self._grad_ready_hooks.append(fn)

    def forward(self, x):
        # A layer needs dx only if this container's input needs it or a parameter sits
        # before it: the layers up to the first one with parameters skip dx.
        needs = self.needs_input_grad
        for i, layer in enumerate(self.layers):
            layer.needs_input_grad = needs
            needs = needs or layer.has_params()
            try:
                x = layer.forward(x)
            except ShapeError as e:
                raise ShapeError(f"layer {i} ({layer!r}): {e}") from None
        return x

    def backward(self, dy):
        for i in range(len(self.layers) - 1, -1, -1):
            if dy is None:  # the layers below have no parameters and nobody wants dx
                break
            layer = self.layers[i]
            dy = layer.backward(dy)
            if self._grad_ready_hooks:
                names = [n for n, _ in layer.named_parameters(f"{i}.")]
                if names:
                    for hook in self._grad_ready_hooks:
                        hook(names)
        return dy

    def __repr__(self):
        inner = ",\n  ".join(f"({i}) {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential(\n  {inner}\n)"


class ShapeError(ValueError):
    """An input does not fit a layer (wrong feature count, channels, rank...)."""

"""Parameters, the Layer base class and Sequential.

A layer owns its parameters (``Parameter``: data, grad, placement) and non-trainable
buffers (BatchNorm's running statistics). ``named_parameters()`` gives every parameter a
stable dotted name (``"3.weight"``) in a stable order, identical on every rank:
collectives, fusion buffers and checkpoints rely on it.

Micro-batches: what a forward keeps for its backward is stored per micro-batch key
(``save_for_backward``), so several micro-batches can be in flight at once (pipeline
schedules, gradient accumulation) and backward adds into ``grad`` instead of overwriting
it. Backward hooks: ``add_grad_ready_hook`` on any layer reports the names of parameters
whose gradients a backward pass has finished (``mpidl.engine.hooks``); data parallelism
uses it to start a bucket's all-reduce while backward goes on.
"""

from collections import OrderedDict
from contextlib import contextmanager

from mpidl.engine.hooks import GradReadyHook
from mpidl.engine.placement import REPLICATED_DP, Placement


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
    """A trainable array, its gradient (None until a backward has run) and where it lives.

    ``placement`` (a ``Placement``, default replicated over the "dp" axis) tells parallel
    runtimes how the tensor is spread over processes; ``master_dtype`` (None: the data's
    dtype) is the precision an optimizer keeps its master copy in. Neither touches the
    arrays, and checkpoints (``state_dict``) hold the data only.
    """

    __slots__ = ("data", "grad", "placement", "master_dtype")

    def __init__(self, data, placement=None, master_dtype=None):
        self.data = data
        self.grad = None
        if placement is None:
            placement = REPLICATED_DP
        elif not isinstance(placement, Placement):
            raise TypeError(f"placement must be a Placement (e.g. Placement.replicated('dp')), "
                            f"got {placement!r}")
        placement.check_shape(data.shape)
        self.placement = placement
        if master_dtype is not None:
            import numpy as np  # noqa: PLC0415

            master_dtype = np.dtype(master_dtype)
        self.master_dtype = master_dtype

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def size(self):
        return self.data.size

    def accumulate(self, g):
        """Add gradient ``g`` into ``grad`` (the backward of every layer goes through here).

        No gradient yet: ``grad`` becomes ``g`` itself, not a copy, so one micro-batch
        gives bitwise the gradient a lone backward gives, at no extra cost. Dense into
        dense adds in place (``g`` is the caller's to give away; ``grad``'s memory is
        reused). Two ``SparseGrad`` concatenate their rows (duplicates are summed later by
        ``coalesce``/``to_dense``); a sparse and a dense one sum into a dense array.
        """
        grad = self.grad
        if grad is None:
            self.grad = g
        elif isinstance(grad, SparseGrad):
            if isinstance(g, SparseGrad):
                from mpidl.backend import array_module  # noqa: PLC0415

                xp = array_module(g.values)
                self.grad = SparseGrad(xp.concatenate((grad.indices, g.indices)),
                                       xp.concatenate((grad.values, g.values)), grad.shape)
            else:
                dense = grad.to_dense()
                dense += g
                self.grad = dense
        elif isinstance(g, SparseGrad):
            scatter_add(grad, g.indices, g.values)
        else:
            grad += g

    def __repr__(self):
        extra = "" if self.placement == REPLICATED_DP else f", {self.placement!r}"
        if self.master_dtype is not None:
            extra += f", master_dtype={self.master_dtype}"
        return f"Parameter(shape={tuple(self.data.shape)}, dtype={self.data.dtype}{extra})"


class Layer:
    """Base class: ``forward(x) -> y`` and ``backward(dy) -> dx``.

    Subclasses create parameters with ``self.add_param(name, array)`` and buffers with
    ``self.add_buffer(name, array)``. ``forward`` stores what backward needs with
    ``self.save_for_backward(...)`` and ``backward`` takes it back with
    ``self.saved_for_backward()``: contexts are kept per micro-batch key (see
    ``micro_batch``), so several forwards may be in flight and their backwards run in any
    order. Setting ``needs_input_grad = False`` (Sequential does it for the layers before
    its first parameter when its own input needs no gradient) lets a layer skip computing
    ``dx`` nobody uses; its backward then returns None.

    Conventions every layer keeps, so containers can chain them without copies:
    ``backward`` *accumulates* into each parameter's ``grad`` (``Parameter.accumulate``;
    ``zero_grad`` starts over), may reuse ``dy``'s memory (callers hand it over and must
    not read it afterwards), and returns a writable array the caller may in turn modify.
    ``forward`` never modifies ``x``. Every forward saves exactly one context (possibly
    empty) and every backward takes exactly one, even when it returns None.

    Calling: ``layer(x)`` runs forward and ``layer.backprop(dy)`` runs backward then fires
    the grad-ready hooks of this layer's own parameters; containers call their children
    that way. A container that calls ``child.forward``/``child.backward`` directly still
    computes correct gradients; only the hooks of that subtree stay silent.
    """

    #: fn(layer, "forward" | "backward") called before this layer's forward (``__call__``)
    #: and backward (``backprop``); ZeRO stage 3 gathers the layer's parameters there.
    #: A class-level empty tuple until ``add_pre_hook``: nothing to pay when unused.
    _pre_hooks = ()

    #: None, or a list: a layer that can (``Linear``) appends the computation of its
    #: weight gradients as a callable instead of running it in ``backward``, for a later
    #: pass (the zero-bubble pipeline schedule's weight-gradient pass). Others ignore it.
    deferred_grads = None

    def __init__(self):
        self._params = OrderedDict()
        self._buffers = OrderedDict()
        self.training = True
        self.needs_input_grad = True
        self._mb_key = 0       # the micro-batch the next forward/backward belongs to
        self._saved = {}       # micro-batch key -> tuple saved by forward for backward
        self._grad_hooks = []  # GradReadyHook objects that count this layer's parameters

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
        """All parameters of this layer and its children as (dotted name, Parameter).

        A parameter held by several layers (weight tying) appears once, under its first
        name: optimizers, gradient exchange and checkpoints must see it once."""
        out, seen = [], set()
        for name, p in self._all_named_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def _all_named_parameters(self, prefix):
        out = [(prefix + n, p) for n, p in self._params.items()]
        for cname, child in self.children():
            out += child._all_named_parameters(f"{prefix}{cname}.")
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
        """Copy arrays from ``state`` into this model; names and shapes must match. A
        ``Deferred`` value (a checkpoint's tensor not read yet) is read when its turn
        comes, so no more than one is held beside the model."""
        from mpidl.backend import to_device
        from mpidl.engine.lazy import is_deferred

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
            p.data[...] = to_device(value.values() if is_deferred(value) else value,
                                    dtype=p.data.dtype)
        for name in buffers:
            value = state[name]
            self.set_buffer(name, to_device(value.values()) if is_deferred(value) else
                            to_device(value).copy())

    # -- per-micro-batch contexts
    @contextmanager
    def micro_batch(self, key):
        """Within the block, forwards and backwards of this layer and every module under
        it belong to micro-batch ``key`` (any hashable; 0 when nobody sets one). The
        previous keys come back on exit."""
        previous = [(m, m._mb_key) for m in self._walk()]
        for m, _ in previous:
            m._mb_key = key
        try:
            yield self
        finally:
            for m, old in previous:
                m._mb_key = old

    def save_for_backward(self, *values):
        """Keep ``values`` for this micro-batch's backward (a later forward under the same
        key replaces them: eval forwards and recalibrations never run backward)."""
        self._saved[self._mb_key] = values

    def saved_for_backward(self):
        """The tuple ``save_for_backward`` stored for the current micro-batch, removed."""
        try:
            return self._saved.pop(self._mb_key)
        except KeyError:
            have = sorted(map(repr, self._saved)) or "none"
            raise RuntimeError(
                f"{self!r}: backward of micro-batch {self._mb_key!r} without its forward "
                f"(forwards waiting for backward: {have}); run forward under the same "
                f"micro_batch key first, and backward only once per forward") from None

    def discard_saved(self, all_keys=False):
        """Drop the current micro-batch's contexts (every key's with ``all_keys``) in this
        layer and every module under it: for a backward that stops early, or to free the
        activations an evaluation forward left behind."""
        for m in self._walk():
            if all_keys:
                m._saved.clear()
            else:
                m._saved.pop(m._mb_key, None)

    def activation_nbytes(self, exclude=()):
        """Bytes of the arrays saved for backward in this layer and every module under it,
        over all micro-batch keys. An array shared by several contexts (a layer's output
        kept by the next layer too) or viewed through several reshapes counts once, at the
        size of the memory it keeps alive. Memory of the arrays in ``exclude`` (the input
        batch, held by the caller anyway) is not counted."""
        seen, total = set(), 0
        for v in exclude:
            while getattr(v, "base", None) is not None and hasattr(v.base, "nbytes"):
                v = v.base
            seen.add(id(v))
        for m in self._walk():
            for values in m._saved.values():
                for v in values:
                    if not hasattr(v, "nbytes") or not hasattr(v, "shape"):
                        continue
                    while getattr(v, "base", None) is not None and hasattr(v.base, "nbytes"):
                        v = v.base
                    if id(v) not in seen:
                        seen.add(id(v))
                        total += int(v.nbytes)
        return total

    def _walk(self):
        """This layer and every module under it, each once."""
        out, seen, stack = [], set(), [self]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            out.append(m)
            stack.extend(child for _, child in reversed(m.children()))
        return out

    # -- hooks
    def add_grad_ready_hook(self, fn):
        """Call ``fn(names)`` whenever a backward pass finishes the gradients of ``names``
        (dotted names relative to this layer, as ``named_parameters`` gives them).

        A gradient is final when every module holding the parameter has finished its
        ``backprop`` in the pass (tied weights: after the last user). Structure is read
        now; see ``mpidl.engine.hooks`` for the limits. Returns the hook object."""
        return GradReadyHook(self, fn)

    def add_pre_hook(self, fn):
        """Call ``fn(self, "forward")`` before every forward of this layer through
        ``layer(x)`` and ``fn(self, "backward")`` before every ``backprop`` (this layer
        only, not its children). Returns ``fn``."""
        if not callable(fn):
            raise TypeError(f"add_pre_hook needs a callable fn(layer, phase), got {fn!r}")
        if not self._pre_hooks:
            self._pre_hooks = []
        self._pre_hooks.append(fn)
        return fn

    def remove_pre_hook(self, fn):
        """Undo ``add_pre_hook(fn)``."""
        hooks = self._pre_hooks
        if fn not in hooks:
            raise ValueError(f"{fn!r} is not a pre-hook of this {type(self).__name__}")
        hooks.remove(fn)
        if not hooks:
            del self._pre_hooks  # back to the class's empty tuple: nothing to pay

    # -- computation
    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def __call__(self, x):
        """Run forward (after the pre-forward hooks): the single entry point containers
        use."""
        if self._pre_hooks:
            for hook in self._pre_hooks:
                hook(self, "forward")
        return self.forward(x)

    def backprop(self, dy):
        """Run backward (after the pre-backward hooks), then tell the grad-ready hooks
        this layer's own parameters are done (children report their own from their
        ``backprop``)."""
        if self._pre_hooks:
            for hook in self._pre_hooks:
                hook(self, "backward")
        dx = self.backward(dy)
        for hook in self._grad_hooks:
            hook.layer_done(self)
        return dx

    def __repr__(self):
        return f"{type(self).__name__}()"


class Sequential(Layer):
    """Layers applied in order; children are named "0", "1", ... unless ``names`` says
    otherwise (a pipeline stage keeps a few of a model's layers under their names in the
    whole model, so parameter names and checkpoints do not depend on the layout)."""

    def __init__(self, *layers, names=None):
        super().__init__()
        self.layers = list(layers)
        self.names = None if names is None else [str(n) for n in names]

    def children(self):
        if self.names is not None:
            return list(zip(self.names, self.layers))
        return [(str(i), layer) for i, layer in enumerate(self.layers)]

    def forward(self, x):
        # A layer needs dx only if this container's input needs it or a parameter sits
        # before it: the layers up to the first one with parameters skip dx.
        needs = self.needs_input_grad
        for i, layer in enumerate(self.layers):
            layer.needs_input_grad = needs
            needs = needs or layer.has_params()
            try:
                x = layer(x)
            except ShapeError as e:
                raise ShapeError(f"layer {i} ({layer!r}): {e}") from None
        return x

    def backward(self, dy):
        layers = self.layers
        for i in range(len(layers) - 1, -1, -1):
            if dy is None:  # the layers below have no parameters and nobody wants dx:
                for layer in layers[:i + 1]:  # their contexts are of no more use
                    layer.discard_saved()
                break
            dy = layers[i].backprop(dy)
        return dy

    def __repr__(self):
        inner = ",\n  ".join(f"({i}) {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential(\n  {inner}\n)"


class ShapeError(ValueError):
    """An input does not fit a layer (wrong feature count, channels, rank...)."""

"""Optimizers: SGD (momentum, Nesterov, weight decay), Adam and AdamW.

``opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9)`` then, after backward,
``opt.step()`` updates every parameter whose ``grad`` is not None, or ``opt.step(names)``
only those (data parallelism applies updates bucket by bucket). ``opt.lr`` may be set at
any time (schedules do). ``state_dict()``/``load_state_dict()`` round-trip everything an
update depends on, so a resumed run continues bitwise where it stopped.

Updates work in place. Each parameter is updated by one fused kernel: on CPU with Numba
(``mpidl.engine._fused``), on GPU a CuPy kernel (``mpidl.engine._fused_gpu``); both are
bitwise equal to the array-operation sequence used otherwise; ``fused=False`` forces the
sequence. ``SGD.lr_ref`` (a one-element CuPy array, normally None) makes the GPU kernel
read the learning rate from device memory, and ``Adam.scalars_ref`` (three elements:
``step_scalars(t)``) the values that change per update, so a captured CUDA graph
follows the schedule and the bias correction.

Row-sparse gradients (``SparseGrad``, from Embedding): SGD updates the touched rows only,
and so does its momentum ("lazy" momentum: an untouched row's velocity neither decays nor
moves the row; it equals dense momentum when every row is touched every step); weight
decay too applies to touched rows only. Adam and AdamW densify the gradient, so they keep
exact dense semantics (moments of untouched rows decay).
"""

import math
from collections import OrderedDict

from mpidl.backend import array_module, is_gpu_array, to_device
from mpidl.engine import _fused, _fused_gpu
from mpidl.engine.lazy import is_deferred
from mpidl.engine.module import Layer, Parameter, SparseGrad


def _check_lr(lr, allow_zero=False):
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise ValueError(f"lr must be a number, got {lr!r}") from None
    if not math.isfinite(lr) or lr < 0 or (lr == 0 and not allow_zero):
        raise ValueError(f"lr must be {'>= 0' if allow_zero else '> 0'}, got {lr}")
    return lr


def _check_range(name, value, lo, hi, hi_open=True):
    value = float(value)
    if not (lo <= value and (value < hi if hi_open else value <= hi)):
        raise ValueError(f"{name} must be in [{lo}, {hi}{')' if hi_open else ']'}, got {value}")
    return value


class Optimizer:
    """Base class: parameter bookkeeping, ``step``, ``zero_grad`` and state round trips.

    Subclasses list their hyper-parameters in ``hyper`` and their per-parameter arrays in
    ``slots``, and implement ``_dense(name, p, g, st)`` and ``_sparse(name, p, g, st)``.
    """

    hyper = ()
    slots = ()

    def __init__(self, params, lr, fused=None):
        if isinstance(params, Layer):
            params = params.named_parameters()
        self.params = OrderedDict()
        for item in params:
            if not (isinstance(item, tuple) and len(item) == 2
                    and isinstance(item[1], Parameter)):
                raise TypeError(f"{type(self).__name__} expects (name, Parameter) pairs such as "
                                f"model.named_parameters(), got {item!r}")
            name, p = item
            if name in self.params:
                raise ValueError(f"parameter name {name!r} appears twice")
            self.params[name] = p
        self._lr = _check_lr(lr)
        self.fused = fused
        self.lr_ref = None  # SGD: the learning rate in device memory (CUDA graphs)
        self.scalars_ref = None  # Adam: step_scalars(t) in device memory (CUDA graphs)
        self.state = {}
        self._scratch = {}

    # -- learning rate
    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = _check_lr(value, allow_zero=True)  # a schedule may anneal to 0

    # -- stepping
    def step(self, names=None):
        """Update the parameters ``names`` (default: all) whose grad is not None."""
        if names is None:
            items = self.params.items()
        else:
            items = []
            for name in names:
                if name not in self.params:
                    raise KeyError(f"{type(self).__name__}.step: unknown parameter {name!r} "
                                   f"(the optimizer holds {len(self.params)} parameters, e.g. "
                                   f"{list(self.params)[:3]})")
                items.append((name, self.params[name]))
        dense = []
        for name, p in items:
            g = p.grad
            if g is None:
                continue
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = self._new_state(p)
            st["step"] += 1
            if isinstance(g, SparseGrad):
                self._sparse(name, p, g, st)
            else:
                if g.dtype != p.data.dtype:
                    g = g.astype(p.data.dtype)
                if g.shape != p.data.shape:
                    raise ValueError(f"gradient of {name!r} has shape {tuple(g.shape)}, the "
                                     f"parameter {tuple(p.data.shape)}")
                dense.append((name, p, g, st))
        for name, p, g, st in self._dense_many(dense):
            self._dense(name, p, g, st)

    def _dense_many(self, dense):
        """Update what it can of ``[(name, p, g, state)]`` at once; returns the rest, for
        ``_dense`` one by one."""
        return dense

    def zero_grad(self):
        """Drop every gradient (``grad = None``); backward writes fresh ones."""
        for p in self.params.values():
            p.grad = None

    @property
    def step_count(self):
        """How many updates the most-updated parameter has received."""
        return max((st["step"] for st in self.state.values()), default=0)

    def _new_state(self, p):
        xp = array_module(p.data)
        st = {"step": 0}
        for slot in self._active_slots():
            st[slot] = xp.zeros_like(p.data)
        return st

    def _active_slots(self, **hyper):
        """The per-parameter arrays an update needs (given hyper-parameter overrides)."""
        return self.slots

    def _fused_kernels(self, *arrays):
        """The module of fused update kernels for these arrays (``_fused`` on CPU with
        Numba, ``_fused_gpu`` on CuPy arrays), or None for the array-operation sequence."""
        if self.fused is False or not all(a.flags.c_contiguous for a in arrays):
            return None
        if is_gpu_array(arrays[0]):
            return _fused_gpu
        return _fused if _fused.available() else None

    def _tmp(self, like, k=0):
        """Scratch array shaped like ``like``: views of one growing buffer per device,
        dtype and slot ``k``, so updates allocate nothing after the first step."""
        xp = array_module(like)
        key = (xp.__name__, like.dtype.str, k)
        buf = self._scratch.get(key)
        if buf is None or buf.size < like.size:
            buf = self._scratch[key] = xp.empty(like.size, dtype=like.dtype)
        return buf[:like.size].reshape(like.shape)

    # -- state
    def state_dict(self, copy=True):
        """``{"type", "step", <hyper-parameters>..., "state": {param name: {"step": int,
        slot: array}}}``; arrays are copies on the parameters' device (``copy=False``:
        the optimizer's own arrays, for a caller that copies them itself)."""
        out = {"type": type(self).__name__, "step": self.step_count, "lr": self.lr}
        for h in self.hyper:
            out[h] = getattr(self, h)
        out["state"] = {name: {k: (v if isinstance(v, int) or not copy else v.copy())
                               for k, v in st.items()}
                        for name, st in self.state.items()}
        return out

    def load_state_dict(self, state, read=True):
        """Restore hyper-parameters and per-parameter state saved by ``state_dict`` (a
        ``Deferred`` slot, a checkpoint's tensor not read yet, is read in its turn;
        ``read=False`` keeps it as it is, for a ZeRO placement that reads only its
        chunks of it: ``zero.Sharded.import_state``)."""
        kind = state.get("type", type(self).__name__)
        if kind != type(self).__name__:
            raise ValueError(f"cannot load {kind} state into {type(self).__name__}")
        unknown = sorted(set(state.get("state", {})) - set(self.params))
        if unknown:
            raise KeyError(f"optimizer state names parameters this optimizer does not hold: "
                           f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        new_state = {}
        for name, saved in state.get("state", {}).items():
            p = self.params[name]
            st = {"step": int(saved.get("step", 0))}
            for slot in self._active_slots(**{h: state.get(h, getattr(self, h))
                                              for h in self.hyper}):
                if slot not in saved:
                    raise KeyError(f"optimizer state for {name!r} lacks {slot!r}")
                value = saved[slot]
                if tuple(value.shape) != tuple(p.data.shape):
                    raise ValueError(f"optimizer state {name!r}/{slot}: shape "
                                     f"{tuple(value.shape)}, parameter {tuple(p.data.shape)}")
                if is_deferred(value):  # a checkpoint's, read now: a new array already
                    st[slot] = (to_device(value.values(), dtype=p.data.dtype) if read
                                else value)
                else:
                    st[slot] = to_device(value, dtype=p.data.dtype).copy()
            new_state[name] = st
        self.lr = state.get("lr", self.lr)
        for h in self.hyper:
            if h in state:
                setattr(self, h, state[h])
        self._validate()
        self.state = new_state

    def _validate(self):
        pass

    def __repr__(self):
        hyper = ", ".join(f"{h}={getattr(self, h)}" for h in self.hyper)
        return f"{type(self).__name__}(lr={self.lr}, {hyper})"


class SGD(Optimizer):
    """Stochastic gradient descent, PyTorch's formulation:
    ``g += weight_decay * p``; ``v = momentum * v + g``;
    ``p -= lr * (g + momentum * v if nesterov else v)`` (``p -= lr * g`` without momentum).
    """

    hyper = ("momentum", "nesterov", "weight_decay")

    def __init__(self, params, lr=0.01, momentum=0.0, nesterov=False, weight_decay=0.0,
                 fused=None):
        super().__init__(params, lr, fused)
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self._validate()

    def _validate(self):
        self.momentum = _check_range("momentum", self.momentum, 0.0, 1.0)
        self.weight_decay = _check_range("weight_decay", self.weight_decay, 0.0, math.inf)
        self.nesterov = bool(self.nesterov)
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0")

    def _active_slots(self, momentum=None, **_):
        momentum = self.momentum if momentum is None else momentum
        return ("momentum",) if momentum else ()

    def _dense_many(self, dense):
        """On a GPU, every parameter in one launch (``_fused_gpu.sgd_multi``): the step
        of a small model is mostly launches."""
        if len(dense) < 2 or not is_gpu_array(dense[0][1].data):
            return dense
        dtype = dense[0][1].data.dtype
        if any(self._fused_kernels(p.data, g) is not _fused_gpu or p.data.dtype != dtype
               for _, p, g, _ in dense):
            return dense
        mu = self.momentum
        triples = []
        for _, p, g, st in dense:
            v = st.get("momentum")
            if mu and v is None:  # momentum switched on by load_state_dict or by hand
                v = st["momentum"] = array_module(p.data).zeros_like(p.data)
            triples.append((p.data.reshape(-1), g.reshape(-1), v.reshape(-1) if mu else None))
        size = _fused_gpu.MULTI_TENSOR_MAX
        for k in range(0, len(triples), size):
            _fused_gpu.sgd_multi(triples[k:k + size], self.lr, mu, self.weight_decay,
                                 self.nesterov, lr_ref=self.lr_ref)
        return []

    def _dense(self, name, p, g, st):
        lr, mu, wd = self.lr, self.momentum, self.weight_decay
        v = st.get("momentum")
        if mu and v is None:  # momentum switched on by load_state_dict or by hand
            v = st["momentum"] = array_module(p.data).zeros_like(p.data)
        data = p.data
        kernels = self._fused_kernels(data, g)
        if kernels is _fused_gpu:
            kernels.sgd(data.reshape(-1), g.reshape(-1), v.reshape(-1) if mu else None,
                        lr, mu, wd, self.nesterov, lr_ref=self.lr_ref)
            return
        if self.lr_ref is not None:
            raise RuntimeError("SGD.lr_ref (a learning rate read from device memory, for "
                               "CUDA graphs) needs contiguous CuPy arrays and fused=None")
        if kernels is not None:
            kernels.sgd(data.reshape(-1), g.reshape(-1), v.reshape(-1) if mu else None,
                        lr, mu, wd, self.nesterov)
            return
        xp = array_module(data)
        if wd:
            g = xp.add(xp.multiply(data, wd, out=self._tmp(data, 0)), g, out=self._tmp(data, 0))
        if mu:
            v *= mu
            v += g
            if self.nesterov:
                upd = xp.multiply(v, mu, out=self._tmp(data, 1))
                upd += g
            else:
                upd = v
        else:
            upd = g
        data -= xp.multiply(upd, lr, out=self._tmp(data, 1))

    def _sparse(self, name, p, g, st):
        lr, mu, wd = self.lr, self.momentum, self.weight_decay
        g = g.coalesce()
        idx, vals = g.indices, g.values.astype(p.data.dtype)
        if not len(idx):
            return
        rows = p.data[idx]
        if wd:
            vals += rows * wd
        upd = vals
        if mu:
            v = st.get("momentum")
            if v is None:
                v = st["momentum"] = array_module(p.data).zeros_like(p.data)
            vrows = v[idx]
            vrows *= mu
            vrows += vals
            v[idx] = vrows
            upd = vals + vrows * mu if self.nesterov else vrows
        rows -= upd * lr
        p.data[idx] = rows


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction, PyTorch's formulation. ``weight_decay``
    here is L2 regularization added to the gradient; use AdamW for decoupled decay.

    ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`` with t counted per
    parameter (so per-bucket ``step(names)`` calls keep the right bias correction).
    """

    hyper = ("beta1", "beta2", "eps", "weight_decay")
    slots = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 fused=None):
        super().__init__(params, lr, fused)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self._validate()

    @property
    def betas(self):
        return (self.beta1, self.beta2)

    def _validate(self):
        self.beta1 = _check_range("beta1", self.beta1, 0.0, 1.0)
        self.beta2 = _check_range("beta2", self.beta2, 0.0, 1.0)
        self.eps = float(self.eps)
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        self.weight_decay = _check_range("weight_decay", self.weight_decay, 0.0, math.inf)

    def _active_slots(self, **_):
        return self.slots

    def step_scalars(self, t):
        """``(step_size, inv_sqrt_bc2, decay)`` of update number ``t``: what changes from
        one update to the next (bias corrections, the learning rate)."""
        b1, b2, wd, lr = self.beta1, self.beta2, self.weight_decay, self.lr
        step_size = lr / (1.0 - b1 ** t)
        inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - b2 ** t)
        decay = 1.0 - lr * wd if self.decoupled else 1.0
        return step_size, inv_sqrt_bc2, decay

    def _dense(self, name, p, g, st):
        b1, b2, eps, wd = self.beta1, self.beta2, self.eps, self.weight_decay
        step_size, inv_sqrt_bc2, decay = self.step_scalars(st["step"])
        l2 = 0.0 if self.decoupled else wd
        data, m, v = p.data, st["exp_avg"], st["exp_avg_sq"]
        kernels = self._fused_kernels(data, g)
        if kernels is _fused_gpu and self.scalars_ref is not None:
            kernels.adam_ref(data.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                             self.scalars_ref, b1, b2, eps, l2,
                             self.decoupled and wd != 0.0)
            return
        if self.scalars_ref is not None:
            raise RuntimeError("Adam.scalars_ref (per-step values read from device memory, "
                               "for CUDA graphs) needs contiguous CuPy arrays and fused=None")
        if kernels is not None:
            kernels.adam(data.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                        step_size, b1, b2, inv_sqrt_bc2, eps, l2, decay)
            return
        xp = array_module(data)
        if l2:
            g = xp.add(xp.multiply(data, l2, out=self._tmp(data, 0)), g, out=self._tmp(data, 0))
        if decay != 1.0:
            data *= decay
        m *= b1
        m += xp.multiply(g, 1.0 - b1, out=self._tmp(data, 1))
        v *= b2
        sq = xp.multiply(g, g, out=self._tmp(data, 1))
        sq *= 1.0 - b2
        v += sq
        denom = xp.sqrt(v, out=self._tmp(data, 1))
        denom *= inv_sqrt_bc2
        denom += eps
        upd = xp.divide(m, denom, out=denom)
        upd *= step_size
        data -= upd

    def _sparse(self, name, p, g, st):
        self._dense(name, p, g.to_dense().astype(p.data.dtype, copy=False), st)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p *= 1 - lr * wd``
    before the Adam step, instead of adding ``wd * p`` to the gradient."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, fused)


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(name, params, **kwargs):
    """An optimizer by name (``"sgd"``, ``"adam"``, ``"adamw"``)."""
    try:
        cls = OPTIMIZERS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown optimizer {name!r}: expected one of "
                         f"{', '.join(OPTIMIZERS)}") from None
    return cls(params, **kwargs)

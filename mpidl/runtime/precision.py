"""``--precision fp32|bf16|fp16``: mixed-precision training with float32 master weights.

A part of the runtime's step (``Runtime.precision``; None for fp32, which stays exactly
today's code path). With ``bf16`` or ``fp16``:

* **Compute**, as a GPU's tensor cores do it: low-precision inputs, weights and outputs,
  float32 accumulation inside a matmul or convolution. On CPU the layers keep computing
  in float32 on values that are all on the low-precision grid, and every result is
  rounded once to the format (round-to-nearest-even): each layer's output in forward;
  its input gradient and its parameters' gradients in backward; the model's input.
  That *is* the tensor-core semantics (a product of two bfloat16/float16 numbers is
  exact in float32, the sum is accumulated in float32, the result rounded on store),
  with float32 summation order instead of the hardware's. The wrapping is done at
  ``setup`` on the model's own modules (their ``forward``/``backward``), so layers need
  no change; layers that mpidl does not know to round this way are refused
  (``check_model``) rather than silently computed in float32.
* **Storage**: the model's working copy of each parameter is held in the 2-byte format
  between passes and decoded into a float32 ``Parameter.data`` only while its layer
  computes (``runtime/working_copy.py``: on CPU, float32 is what BLAS computes in, and
  NumPy has no bfloat16); the activations are float32 arrays holding low-precision
  values. Gradients travel in real 2-byte form: float16, or bfloat16 words
  (``mpidl.bfloat16``), in the fused all-reduce buckets (half the bytes of fp32); the
  optimizer decodes one tensor's at a time into a float32 scratch buffer.
* **Master weights**: the optimizer holds its own float32 copy of every parameter
  (``Precision.masters``: the optimizer's ``params`` are replaced by them, and its
  moments are float32 like them). After each update the working copy becomes the master
  rounded to the format. Reading the parameters between steps takes
  ``Runtime.gather_params()`` (evaluation, checkpoints and ``--save`` call it). Under
  ZeRO (``--zero 1|2|3``) the sharded placement takes each rank's chunks of the masters
  at set-up (``hand_masters_to``), steps them and gathers the rounded working copies
  itself (``zero.Sharded``); this part keeps the loss scale.
* **fp16 dynamic loss scaling** (Micikevicius et al. 2018): the loss gradient is
  multiplied by the scale S (initially ``--loss-scale``, 2**16). If any reduced gradient
  holds an inf or a NaN, the whole step is skipped (parameters and optimizer state
  untouched), S is halved; after ``--loss-scale-window`` clean steps in a row S is
  doubled. Otherwise the gradients are divided by S (exact: S is a power of two) into
  float32 before the optimizer. Data-parallel ranks decide alike without any extra
  message: the check reads the all-reduced gradients, which are bitwise identical on
  every rank. Where a rank sees only some of them (a pipeline's stage, ZeRO's chunks)
  the ranks agree first (``agree``: one int32 all-reduce). bf16 has float32's exponent
  range and needs no scaling.
"""

from collections import OrderedDict

import numpy as np

from mpidl import bfloat16
from mpidl.errors import ConfigError
from mpidl.options import Option

FORMATS = ("fp32", "bf16", "fp16")
DEFAULT_LOSS_SCALE = 2.0 ** 16
DEFAULT_WINDOW = 2000
#: float32 elements of the scratch buffer an update decodes 2-byte gradients into (at
#: least the largest gradient's): 16 MiB
SCRATCH_ELEMENTS = 1 << 22

OPTIONS = [
    Option("precision", str, "fp32", "fp32, bf16 or fp16: forward and backward in this "
           "format with float32 master weights in the optimizer; gradients all-reduced in "
           "it (half the bytes); fp16 with dynamic loss scaling", "precision",
           choices=FORMATS),
    Option("loss_scale", float, None, "fp16: the initial loss scale, a power of two "
           f"(default {DEFAULT_LOSS_SCALE:g})", "precision", metavar="S",
           check=lambda s: None if s > 0 and np.frexp(s)[0] == 0.5 and s < np.inf else
           "must be a power of two > 0"),
    Option("loss_scale_window", int, None, "fp16: double the loss scale after this many "
           f"steps in a row without an overflow (default {DEFAULT_WINDOW})", "precision",
           metavar="N", check=lambda n: None if n >= 1 else "must be at least 1"),
]


# -- rounding ------------------------------------------------------------------------------
def _round_fp16(x):
    """``x`` (float32) rounded in place to float16 values (nearest even; beyond 65504:
    inf)."""
    with np.errstate(over="ignore"):  # overflowing to inf is float16's (and the point)
        for (xs,) in bfloat16.pieces(x):  # (a float16 copy of a piece at a time)
            xs[...] = xs.astype(np.float16)
    return x


def _round_bf16(x):
    return bfloat16.round_(x, out=x)


ROUND = {"fp16": _round_fp16, "bf16": _round_bf16}
#: unit roundoff of each format: 2**-(bits of significand precision)
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


class Wire:
    """How gradients of one format sit in the fused buckets: ``storage`` (the bucket's
    dtype: float16, or uint16 for bfloat16 words), ``dtype`` (what the collectives see:
    float16 or ``bfloat16.BFLOAT16``), ``encode`` (float32 gradient times a scale into a
    bucket view) and ``decode`` (a bucket view back to float32)."""

    def __init__(self, fmt):
        self.format = fmt
        if fmt == "fp16":
            self.storage = self.dtype = np.dtype(np.float16)
        else:
            self.storage, self.dtype = np.dtype(np.uint16), bfloat16.BFLOAT16
        self.itemsize = 2

    def encode(self, grad, scale, out):
        from mpidl.backend import array_module  # noqa: PLC0415

        xp = array_module(out)
        if self.format == "fp16":
            if scale == 1.0:
                xp.copyto(out, grad, casting="same_kind")
            else:
                xp.multiply(grad, scale, out=out)  # float32 product, rounded once
        elif scale == 1.0:
            bfloat16.to_words(grad, out=out)
        else:  # (a piece at a time: no float32 copy of a whole tensor)
            for gs, os in bfloat16.pieces(grad, out):
                bfloat16.to_words(gs * np.float32(scale), out=os)

    def decode(self, g, out=None):
        """A gradient (or working copy) as float32: a new array, or into ``out``."""
        if g.dtype == np.float16:
            if out is None:
                return g.astype(np.float32)
            out[...] = g
            return out
        if g.dtype == np.uint16 or g.dtype == bfloat16.BFLOAT16:
            if out is None:
                return bfloat16.from_words(g).reshape(g.shape)
            return bfloat16.from_words(g.reshape(out.shape), out=out)
        if out is None:
            return g
        out[...] = g
        return out


# -- which layers have a low-precision path -------------------------------------------------
def _supported_types():
    from mpidl.engine import activations, attention, conv, dropout, embedding  # noqa
    from mpidl.engine import linear, module, normalization, pooling, reshape  # noqa
    from mpidl.engine import residual  # noqa: PLC0415

    return (module.Sequential, linear.Linear, conv.Conv2d, activations.ReLU,
            activations.LeakyReLU, activations.Tanh, activations.Sigmoid, activations.GELU,
            dropout.Dropout, reshape.Flatten, reshape.Reshape, pooling.MaxPool2d,
            pooling.AvgPool2d, pooling.GlobalAvgPool2d, normalization.BatchNorm1d,
            normalization.BatchNorm2d, normalization.LayerNorm, residual.Residual,
            embedding.Embedding, attention.PositionEmbedding, attention.CausalAttention)


def _round_grad(grad, rnd):
    """A parameter's gradient rounded to the format: in place, or for a row-sparse one
    (an Embedding's) its duplicate rows summed first, as a dense gradient would hold
    them (a new ``SparseGrad``)."""
    from mpidl.engine.module import SparseGrad  # noqa: PLC0415

    if isinstance(grad, SparseGrad):
        grad = grad.coalesce()
        if grad.values.size:  # (coalesce made the rows anew)
            rnd(grad.values)
        return grad
    return rnd(grad)


def _dense(grad):
    """A row-sparse gradient as its dense array (exact: its rows are unique and on the
    grid already, ``_round_grad``); any other as it is."""
    from mpidl.engine.module import SparseGrad  # noqa: PLC0415

    return grad.to_dense() if isinstance(grad, SparseGrad) else grad


def check_sparse_exchange(model, fmt, sparse_mode):
    """ConfigError when row-sparse gradients would travel outside the 2-byte buckets
    (``--sparse-grads allgather`` gathers float32 rows): mixed precision wants them in
    the buckets (``--sparse-grads dense``)."""
    if fmt in (None, "fp32") or sparse_mode != "allgather":
        return
    from mpidl.runtime.sync.rowsparse import sparse_param_names  # noqa: PLC0415

    sparse = sorted(sparse_param_names(model))
    if sparse:
        raise ConfigError(f"--precision {fmt}: {', '.join(sparse[:3])} ha"
                          f"{'s' if len(sparse) == 1 else 've'} row-sparse gradients, which "
                          "--sparse-grads allgather exchanges as float32 rows outside the "
                          "2-byte buckets; add --sparse-grads dense")


def check_model(model, fmt):
    """ConfigError naming the first layer without a ``fmt`` path (one the runtime does not
    know how to round: Embedding's row-sparse gradients, layers of your own)."""
    if fmt in (None, "fp32"):
        return
    known = _supported_types()
    for name, layer in model.modules():
        if type(layer) not in known:
            where = f"layer {name!r} ({type(layer).__name__})" if name else \
                f"the model ({type(layer).__name__})"
            raise ConfigError(
                f"--precision {fmt}: {where} has no {fmt} path (mpidl rounds the layers "
                f"it knows: {', '.join(sorted(t.__name__ for t in known))}); use "
                "--precision fp32, or build the model from those layers")


def check_format(fmt):
    fmt = fmt or "fp32"
    if fmt not in FORMATS:
        raise ConfigError(f"--precision must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def build_precision(precision=None, loss_scale=None, loss_scale_window=None):
    """The runtime part for ``precision`` (None for fp32) after checking the settings."""
    fmt = check_format(precision)
    if fmt != "fp16" and (loss_scale is not None or loss_scale_window is not None):
        flag = "--loss-scale" if loss_scale is not None else "--loss-scale-window"
        raise ConfigError(f"{flag} is for --precision fp16 (dynamic loss scaling); "
                          f"--precision {fmt} does not scale the loss")
    if fmt == "fp32":
        return None
    return Precision(fmt, loss_scale, loss_scale_window)


class Precision:
    """The bf16/fp16 part of a step (module doc). Life cycle: ``setup(runtime)`` once
    (after the parameters were broadcast), ``step(placement, names)`` instead of
    ``placement.step(names)`` every step."""

    def __init__(self, fmt, loss_scale=None, window=None):
        self.format = check_format(fmt)
        self.round = ROUND[self.format]
        self.wire = Wire(self.format)
        self.dynamic = self.format == "fp16"
        self.scale = float(DEFAULT_LOSS_SCALE if loss_scale is None else loss_scale) \
            if self.dynamic else 1.0
        self.window = int(DEFAULT_WINDOW if window is None else window)
        self.good_steps = 0           # clean steps since the last overflow or growth
        self.skipped_total = 0        # steps skipped since the start of training
        self.skipped_epoch = 0        # ... since the last metrics()
        self.masters = OrderedDict()  # name -> float32 Parameter the optimizer steps
        self.params = OrderedDict()   # name -> the model's Parameter (working copy)
        self.optimizer = None
        # fp16 under a pipeline or ZeRO: flag -> whether any stage or shard overflowed
        # (each rank sees its own gradients only; one process skips the whole step)
        self.agree = None
        # ZeRO (``hand_masters_to``): its placement holds the masters, in shards
        self.sharded = None
        self.exported = {}  # a checkpoint's gathered masters on the root (ZeRO)
        self.low = None       # working_copy.WorkingCopies: the 2-byte working copies
        self._scratch = None  # the float32 gradients one update reads (``grad_scratch``)

    # -- set-up
    def setup(self, model, optimizer, loss, chunks=()):
        """Masters from the (already broadcast) parameters, the optimizer moved onto them,
        the working copies rounded, the model's modules and the loss wrapped. ``chunks``:
        a pipeline stage's pieces, which take the model's input (the first stage) or the
        loss gradient (the last) in the model's place, so they round both as the whole
        model does (a stage boundary's values are rounded already: rounding is
        idempotent)."""
        from mpidl.engine.module import Parameter, Sequential  # noqa: PLC0415

        check_model(model, self.format)
        self.optimizer = optimizer
        for name, p in model.named_parameters():
            if p.data.dtype != np.float32:
                raise ConfigError(f"--precision {self.format} keeps float32 master weights; "
                                  f"parameter {name!r} is {p.data.dtype}: build the model "
                                  "with dtype float32 (--dtype float32)")
            master = Parameter(p.data.copy(), placement=p.placement)
            self.params[name], self.masters[name] = p, master
            p.master_dtype = np.dtype(np.float32)
            if name in optimizer.params:
                optimizer.params[name] = master
            self.round(p.data)
        for name, layer in model.modules():
            top = layer is model
            if isinstance(layer, Sequential) and not top:
                continue  # its last child rounded its output already
            self._wrap(layer, round_input=top, round_output=not isinstance(layer, Sequential))
        for chunk in chunks:
            self._wrap(chunk, round_input=True, round_output=False)
        self._wrap_loss(loss)

    def _wrap(self, layer, round_input, round_output):
        rnd = self.round
        forward, backward = layer.forward, layer.backward
        own = list(layer._params.values())

        def low_forward(x):
            if round_input and hasattr(x, "dtype") and x.dtype == np.float32:
                x = rnd(x.copy())  # the data is the caller's: never rounded in place
            y = forward(x)
            return rnd(y) if round_output else y

        def low_backward(dy):
            if round_input and dy is not None:
                rnd(dy)  # the loss gradient (times the loss scale) enters in the format
            dx = backward(dy)
            for p in own:
                if p.grad is not None:
                    p.grad = _round_grad(p.grad, rnd)
            return rnd(dx) if dx is not None and round_output else dx

        layer.forward, layer.backward = low_forward, low_backward

    def _wrap_loss(self, loss):
        backward = loss.backward
        precision = self

        def scaled_backward():
            dy = backward()
            if precision.scale != 1.0:
                dy *= precision.scale
            return dy

        loss.backward = scaled_backward

    def hand_masters_to(self, placement):
        """ZeRO: ``placement`` (``zero.Sharded``) took this rank's chunks of the masters
        into its shards; the whole copies go, and the trainer's optimizer holds the
        model's parameters again (the sharded optimizer steps the chunks)."""
        for name, master in self.masters.items():
            if self.optimizer.params.get(name) is master:
                self.optimizer.params[name] = self.params[name]
        self.masters = OrderedDict()
        self.sharded = placement

    def keep_working_copies(self, model, named, words=None):
        """Hold the working copies of ``named`` (``[(name, Parameter)]``, on the grid
        already) in the 2-byte format from now on, decoded layer by layer
        (``working_copy``). ``words``: arrays the caller keeps them in (ZeRO stages 1-2:
        views of its buckets' 2-byte buffers, filled with them); the others get their
        own."""
        from mpidl.backend import array_module  # noqa: PLC0415
        from mpidl.runtime.working_copy import WorkingCopies  # noqa: PLC0415

        words = dict(words or {})
        for n, p in named:
            if n not in words:
                w = words[n] = array_module(p.data).empty(p.data.shape,
                                                           dtype=self.wire.storage)
                self.wire.encode(p.data, 1.0, w)
        self.low = WorkingCopies(self.wire, model, named, words)

    def gather_params(self):
        """Every working copy decoded and kept until the next step (evaluation,
        checkpoints, reading the model)."""
        if self.low is not None:
            self.low.materialize()

    def begin_step(self):
        """The decoded working copies go back to the 2-byte format (``unpin``)."""
        if self.low is not None:
            self.low.unpin()

    # -- a step
    def step(self, placement, names, coef=1.0):
        """Apply the ready gradients ``names`` through ``placement`` to the masters, then
        round the masters into the working copies. fp16: on an overflow anywhere in them,
        skip, halve the scale and return False (the caller hands every name of the step
        at once, so a skip is all or nothing). Under ZeRO the placement decodes its
        reduced chunks, steps its masters and gathers the working copies itself.
        ``coef``: the clipping coefficient, applied to the unscaled gradients."""
        if self.low is not None:  # backward is over: no layer computes until next step
            self.low.release_all()
        if self.sharded is not None:
            grads = placement.reduced_chunks(names)
        else:  # (one process: an Embedding's gradient is still row-sparse)
            grads = [_dense(self.params[n].grad) for n in names]
        if self.dynamic and self._overflowed(grads):
            return False
        if self.sharded is not None:
            placement.step(names, coef)
            self._scratch = None
            self._grow()
            return True
        unscale = 1.0 / self.scale
        # the 2-byte gradients decoded into one float32 scratch buffer, as many at a time
        # as it holds (no float32 copy of a large model's whole gradient beside the
        # buckets; small tensors stepped together, as the optimizer's fused kernels like)
        low = [g for g in grads if g is not None and g.dtype != np.float32]
        scratch = None
        if low:
            scratch = self.grad_scratch(max([g.size for g in low] + [SCRATCH_ELEMENTS]),
                                        low[0])
        group, used = [], 0
        for n, g in zip(names, grads):
            if g is None:
                continue
            if g.dtype == np.float32:  # (one process: float32 already, the caller's)
                g32 = g
            else:
                if used + g.size > scratch.size:
                    self._step_group(placement, group)
                    group, used = [], 0
                g32 = self.wire.decode(g, out=scratch[used:used + g.size].reshape(g.shape))
                used += g.size
            for factor in (unscale, coef):  # (unscaling is exact: a power of two)
                if factor != 1.0:
                    if g32 is g:  # (float32 already, the caller's: not scaled in place)
                        g32 = g32 * np.float32(factor)
                    else:
                        g32 *= np.float32(factor)
            self.masters[n].grad = g32
            group.append(n)
        self._step_group(placement, group)
        self._scratch = None
        self._grow()
        return True

    def _step_group(self, placement, names):
        """Step the masters of ``names`` (their gradients set), then round them into the
        working copies."""
        if not names:
            return
        placement.step(names)
        for n in names:
            master = self.masters[n]
            master.grad = None
            self.set_working(n, master.data)

    def grad_scratch(self, size, like):
        """``size`` float32 elements of scratch on ``like``'s device: one flat buffer,
        grown as needed, which the update lets go at its end (backward, the memory's high
        point, never holds it beside the layers' float32 copies)."""
        from mpidl.backend import array_module  # noqa: PLC0415

        buf = self._scratch
        if buf is None or buf.size < size:
            buf = self._scratch = array_module(like).empty(size, dtype=np.float32)
        return buf[:size]

    def words_written(self, n, words):
        """Parameter ``n``'s working copy was written in the 2-byte format into ``words``
        (ZeRO stages 1-2's all-gather, into the arrays ``keep_working_copies`` was given):
        a decoded copy held of it follows; a float32 working copy (one a pipeline uses
        outside the passes) takes the values."""
        if self.low is not None and n in self.low.words:
            self.low.refresh(n)
            return
        p = self.params[n]
        self.wire.decode(words.reshape(p.data.shape), out=p.data)

    def set_working(self, n, values):
        """Parameter ``n``'s working copy becomes float32 ``values`` rounded to the
        format."""
        if self.low is not None and n in self.low.words:
            self.low.store(n, values)
            return
        from mpidl.backend import array_module  # noqa: PLC0415

        p = self.params[n]
        array_module(p.data).copyto(p.data, values)
        self.round(p.data)

    def _overflowed(self, grads):
        """fp16: whether any of ``grads`` (on any rank ``agree`` asks) holds an inf or a
        NaN; if so the step is skipped: the scale halves."""
        from mpidl.backend import array_module  # noqa: PLC0415

        overflow = any(g is not None and not bool(array_module(g).isfinite(g).all())
                       for g in grads)
        if self.agree is not None:
            overflow = self.agree(overflow)
        if overflow:
            self.skipped_total += 1
            self.skipped_epoch += 1
            self.scale /= 2.0
            self.good_steps = 0
        return overflow

    def _grow(self):
        """A clean step: fp16's scale doubles after ``window`` of them in a row."""
        if self.dynamic:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0

    # -- reporting and checkpoints
    def memory(self, ledger):
        """The float32 master weights (optimizer state, as ZeRO counts them) and the 2-byte
        working copies (parameters)."""
        ledger.add("mem_optimizer", [m.data for m in self.masters.values()])
        if self.low is not None:
            self.low.memory(ledger)

    def metrics(self):
        if not self.dynamic:
            return {}
        out = {"loss_scale": self.scale, "skipped_steps": self.skipped_epoch,
               "skipped_steps_total": self.skipped_total}
        self.skipped_epoch = 0
        return out

    def describe(self):
        text = (f"precision {self.format}: forward/backward rounded to {self.format}, "
                f"float32 master weights, gradients all-reduced as "
                f"{'float16' if self.format == 'fp16' else 'bfloat16 words'}")
        if self.dynamic:
            text += (f", dynamic loss scale {self.scale:g} (halved on overflow, doubled "
                     f"after {self.window} clean steps)")
        return [text]

    def master_arrays(self):
        """{name: float32 array} of this rank's master weights, the arrays themselves
        (under ZeRO those the placement gathered on this rank for a checkpoint)."""
        if self.sharded is not None:
            return dict(self.exported)
        return {n: m.data for n, m in self.masters.items()}

    def state_dict(self, masters=True):
        """Loss scale and master weights (under ZeRO the masters the placement gathered
        on the root for this checkpoint: the same form, resumable at any stage);
        ``masters=False``: without them (a sharded checkpoint's shards hold them)."""
        arrays = {}
        if masters:
            arrays = {n: a if self.sharded is not None else a.copy()
                      for n, a in self.master_arrays().items()}
        return {"format": self.format, "scale": self.scale, "good_steps": self.good_steps,
                "skipped_total": self.skipped_total, "masters": arrays}

    def load_state_dict(self, state):
        if not state or state.get("format") != self.format:
            got = (state or {}).get("format", "fp32")
            raise ConfigError(f"the checkpoint was written with --precision {got}; resume "
                              f"with --precision {got}, not {self.format}")
        from mpidl.backend import to_device  # noqa: PLC0415

        if self.sharded is not None:
            self.sharded.load_masters(state["masters"])
        else:
            from mpidl.engine.lazy import is_deferred  # noqa: PLC0415

            missing = [n for n in self.masters if n not in state["masters"]]
            if missing:
                raise ConfigError(f"the checkpoint has no master weights for "
                                  f"{', '.join(missing[:3])}; resume it with the model and "
                                  "layout it was written with")
            for n in self.masters:  # (this rank's: a pipeline stage's; may be Deferred)
                value = state["masters"][n]
                value = value.values() if is_deferred(value) else value
                self.masters[n].data[...] = to_device(value, dtype=np.float32)
                self.set_working(n, self.masters[n].data)
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_total = int(state["skipped_total"])

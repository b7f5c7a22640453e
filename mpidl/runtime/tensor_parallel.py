"""Tensor parallelism over the mesh's ``tp`` axis (``--tensor-parallel T``).

Megatron-LM's layout (Shoeybi et al. 2019), applied to a model of the zoo:

* A **column-parallel** ``Linear`` keeps a slice of the output columns. Its input is the
  same on every rank of the tensor-parallel group; its output is this rank's slice. In
  backward, the input gradient is the sum of every rank's partial product: one
  all-reduce (Megatron's *f* operator: identity forward, all-reduce backward).
* A **row-parallel** ``Linear`` keeps the matching slice of the input rows. Each rank's
  product is partial; one all-reduce makes the output whole (*g*: all-reduce forward,
  identity backward), and the bias, replicated, is added after it.
* Pairs: within one ``Sequential``, two ``Linear`` layers with only element-wise layers
  (activations, dropout) or an attention core between them become column- then
  row-parallel, so a block costs one all-reduce forward and one backward. An attention
  core between them makes the slices whole heads (the qkv columns of a head are
  contiguous, ``mpidl.engine.attention``).
* The model's last ``Linear``, when it is left unpaired, is column-parallel over the
  classes (the vocabulary): its logits stay sliced, and ``ParallelSoftmaxCrossEntropy``
  computes the loss from all-reduces of a row maximum and two row sums, never gathering
  the logits.
* An ``Embedding`` is vocabulary-parallel: each rank holds a slice of the rows, looks up
  the ids that fall in it (zeros elsewhere), and one all-reduce sums the pieces; the sum
  of one row and zeros is that row, bitwise.
* A ``Dropout`` between a pair draws the mask of the whole width and keeps its slice, so
  the ranks drop different units and the run equals one process bitwise in its masks.

Widths that T does not divide get uneven slices (``even_split`` of the units: columns,
or heads), never an error. Everything else (convolutions, norms, embeddings of
positions, the activations between blocks) is replicated: every rank of the group
computes it on the same data, so its parameters get the same gradient bits on every
rank, and data parallelism averages all parameters over the ``dp`` axis as usual.

The model is cut from the whole model one process would build from the seed: the same
initial values, which is what makes the run provably equal to one process (within the
rounding of the all-reduced partial sums). Built lazily (``mpidl.engine.lazy``, what
``mpidl train`` does), a rank draws only its slices of the split layers, so no rank ever
holds the whole model. Checkpoints and ``--save`` hold the whole
model: ``TensorParallel.full_state`` gathers the slices over the group, and
``load_full_state`` cuts a whole state (saved at any T) into this rank's slices.
"""

from mpidl.backend import array_module, is_gpu_array, to_device, to_numpy
from mpidl.comm.layout import even_split
from mpidl.engine.activations import GELU, LeakyReLU, ReLU, Sigmoid, Tanh
from mpidl.engine.dropout import Dropout
from mpidl.engine.attention import CausalAttention, TiedHead
from mpidl.engine.embedding import Embedding, check_ids
from mpidl.engine.linear import Linear
from mpidl.engine.losses import Loss, SoftmaxCrossEntropy
from mpidl.engine._util import as_input, colsum
from mpidl.engine.gemm import matmul
from mpidl.engine.lazy import is_deferred
from mpidl.engine.module import Layer, Sequential, ShapeError, SparseGrad
from mpidl.engine.placement import Placement
from mpidl.errors import ConfigError
from mpidl.options import Option

OPTIONS = [
    Option("tensor_parallel", int, 1, "split the model over T ranks (Megatron-style "
           "column/row-parallel Linear pairs, attention by heads, vocabulary-parallel "
           "embedding and loss); data parallelism runs over ranks / T", "parallelism"),
]

ELEMENTWISE = (ReLU, LeakyReLU, GELU, Tanh, Sigmoid, Dropout)


def check_degree(degree, ranks):
    """The tensor-parallel degree, checked against the number of training ranks."""
    degree = 1 if degree is None else degree
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"--tensor-parallel {degree!r}: give a positive number of ranks")
    if ranks % degree:
        raise ConfigError(f"--tensor-parallel {degree} does not divide the {ranks} rank(s): "
                          f"launch a multiple of {degree} ranks (data parallelism runs over "
                          "ranks / T) or pick a T that divides them")
    return degree


class Slice:
    """This rank's piece of a whole tensor: ``[lo, hi)`` along ``dim`` of ``full`` (the
    whole tensor's size there), and the pieces of every rank (``counts``/``displs``)."""

    __slots__ = ("dim", "counts", "displs", "index", "full")

    def __init__(self, dim, units, unit, count, index):
        counts, displs = even_split(units, count)
        self.dim = dim
        self.counts = tuple(c * unit for c in counts)
        self.displs = tuple(d * unit for d in displs)
        self.index = index
        self.full = units * unit

    @property
    def lo(self):
        return self.displs[self.index]

    @property
    def hi(self):
        return self.lo + self.counts[self.index]

    def take(self, a):
        """This rank's piece of the whole array ``a``: a copy, so the whole array is not
        kept alive behind a view. A ``Deferred`` array (a lazily built parameter, a
        checkpoint's tensor not read yet) makes only the piece."""
        if is_deferred(a):
            return to_device(a.values(self.dim, self.lo, self.hi))
        index = [slice(None)] * a.ndim
        index[self.dim] = slice(self.lo, self.hi)
        return a[tuple(index)].copy()

    def join(self, pieces):
        """The whole array from every rank's piece (host arrays, in rank order)."""
        import numpy as np  # noqa: PLC0415

        return np.concatenate(pieces, axis=self.dim)


def _shard_param(layer, pname, sl):
    """Cut ``layer``'s Parameter ``pname`` (the whole tensor) to this rank's slice, in
    place: the object stays, so optimizers and names that hold it stay valid."""
    p = layer._params[pname]
    p.data = sl.take(p.data)
    p.placement = Placement.sharded("tp", dim=sl.dim, index=sl.index, count=len(sl.counts))
    layer.param_slices[pname] = sl


def _bias_grad(dy2):
    return colsum(dy2) if is_gpu_array(dy2) else dy2.sum(axis=0)


class _ParallelLinear(Layer):
    """A ``Linear`` whose weight (and bias, when sliced) hold this rank's piece. Takes over
    the whole layer's ``Parameter`` objects."""

    #: the all-reduce algorithm (the conv-DP/FC-MP hybrid sets --algorithm, so that the
    #: bytes it counts follow its formula)
    algorithm = "auto"

    def __init__(self, linear, group, name, weight_slice, bias_slice):
        super().__init__()
        self.group, self.name = group, name
        self.dtype = linear.dtype
        self.in_features_full, self.out_features_full = linear.in_features, linear.out_features
        self.param_slices = {}
        self.weight = self._params["weight"] = linear.weight
        _shard_param(self, "weight", weight_slice)
        self.bias = linear.bias
        if self.bias is not None:
            self._params["bias"] = self.bias
            if bias_slice is not None:
                _shard_param(self, "bias", bias_slice)
        self.in_features, self.out_features = self.weight.data.shape
        self.needs_input_grad = linear.needs_input_grad

    def _check(self, x):
        if x.ndim < 2 or x.shape[-1] != self.in_features:
            got = x.shape[-1] if x.ndim else 0
            raise ShapeError(f"{type(self).__name__} {self.name!r} (tp rank "
                             f"{self.group.rank}) expects {self.in_features} input features, "
                             f"got {got} (input shape {tuple(x.shape)})")

    #: which side sums over the group: the output (row-parallel, *g*) or the input's
    #: gradient (column-parallel, *f*)
    reduces_output = False

    def _allreduce(self, a, what):
        return self.group.allreduce(a, out=a, algorithm=self.algorithm,
                                    name=f"tp.{self.name}.{what}")

    def forward(self, x):
        x, _ = as_input(x, self.dtype, self.weight.data)
        self._check(x)
        self.save_for_backward(x)
        y = matmul(x.reshape(-1, self.in_features), self.weight.data)
        if self.reduces_output:
            y = self._allreduce(y, "y")
        if self.bias is not None:  # (a row-parallel bias is whole: added once, after)
            y += self.bias.data
        return y.reshape(x.shape[:-1] + (self.out_features,))

    def backward(self, dy):
        (x,) = self.saved_for_backward()
        x2 = x.reshape(-1, self.in_features)
        dy2 = dy.reshape(-1, self.out_features)
        self.weight.accumulate(matmul(x2.T, dy2))
        if self.bias is not None:
            self.bias.accumulate(_bias_grad(dy2))
        if not self.needs_input_grad:
            return None
        dx = matmul(dy2, self.weight.data.T)
        if not self.reduces_output:
            dx = self._allreduce(dx, "dx")
        return dx.reshape(x.shape[:-1] + (self.in_features,))

    def __repr__(self):
        return (f"{type(self).__name__}({self.in_features_full}, {self.out_features_full}, "
                f"slice {self.in_features}x{self.out_features} on tp rank {self.group.rank}"
                f"/{self.group.size})")


class ColumnParallelLinear(_ParallelLinear):
    """Output columns ``[lo, hi)``: a whole input in, this rank's slice of the output out;
    backward all-reduces the input gradient (Megatron's *f*)."""

    def __init__(self, linear, group, name, unit=1):
        n = linear.out_features
        if n % unit:
            raise ValueError(f"{name}: {n} output features are not whole units of {unit}")
        cols = Slice(1, n // unit, unit, group.size, group.rank)
        super().__init__(linear, group, name, cols,
                         Slice(0, n // unit, unit, group.size, group.rank))
        self.slice = cols


class RowParallelLinear(_ParallelLinear):
    """Input rows ``[lo, hi)``: this rank's slice of the input in, the whole output out
    after one all-reduce (Megatron's *g*); the bias is whole and added after the sum, so
    its gradient is the same bits on every rank."""

    reduces_output = True

    def __init__(self, linear, group, name, unit=1):
        n = linear.in_features
        if n % unit:
            raise ValueError(f"{name}: {n} input features are not whole units of {unit}")
        rows = Slice(0, n // unit, unit, group.size, group.rank)
        super().__init__(linear, group, name, rows, None)
        self.slice = rows


class VocabParallelEmbedding(Layer):
    """An ``Embedding`` whose rows ``[lo, hi)`` live here: ids outside give zeros, one
    all-reduce sums the pieces (one row plus zeros: that row, bitwise). Its gradient is
    the row-sparse gradient of the ids that fall in this rank's rows (exchanged as one,
    ``sparse_grad``)."""

    sparse_grad = True

    def __init__(self, embedding, group, name):
        super().__init__()
        self.group, self.name = group, name
        self.num_embeddings_full = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.slice = Slice(0, embedding.num_embeddings, 1, group.size, group.rank)
        self.param_slices = {}
        self.weight = self._params["weight"] = embedding.weight
        _shard_param(self, "weight", self.slice)
        self.needs_input_grad = embedding.needs_input_grad

    def forward(self, ids):
        xp = array_module(self.weight.data)
        ids = xp.asarray(ids)
        check_ids(ids, self.num_embeddings_full, f"Embedding {self.name!r}")
        lo, hi = self.slice.lo, self.slice.hi
        mine = (ids >= lo) & (ids < hi)
        local = xp.where(mine, ids - lo, 0)
        y = self.weight.data[local]
        y *= mine[..., None]
        self.save_for_backward(ids, mine)
        return self.group.allreduce(y, out=y, name=f"tp.{self.name}.y")

    def backward(self, dy):
        ids, mine = self.saved_for_backward()
        flat = mine.reshape(-1)
        rows = ids.reshape(-1)[flat] - self.slice.lo
        values = dy.reshape(-1, self.embedding_dim)[flat]
        self.weight.accumulate(SparseGrad(rows, values, self.weight.data.shape))
        return None

    def __repr__(self):
        return (f"VocabParallelEmbedding({self.num_embeddings_full}, {self.embedding_dim}, "
                f"rows {self.slice.lo}..{self.slice.hi} on tp rank {self.group.rank})")


class ParallelTiedHead(TiedHead):
    """The output projection tied to a vocabulary-parallel ``Embedding``: logits of this
    rank's vocabulary rows (the tied weight is already this rank's slice), sliced like a
    column-parallel head; backward all-reduces the input gradient (Megatron's *f*)."""

    def __init__(self, head, embedding, group, name):
        super().__init__(head)  # the head's weight: the embedding's, already cut
        self.group, self.name = group, name
        self.slice = embedding.slice
        self.num_embeddings = self.weight.data.shape[0]
        self.needs_input_grad = head.needs_input_grad

    def backward(self, dy):
        dx = super().backward(dy)
        if dx is None:
            return None
        return self.group.allreduce(dx, out=dx, name=f"tp.{self.name}.dx")

    def __repr__(self):
        return (f"ParallelTiedHead(vocabulary {self.slice.lo}..{self.slice.hi} on tp rank "
                f"{self.group.rank})")


class ShardedDropout(Dropout):
    """Dropout inside a tensor-parallel pair: the mask of the whole width is drawn (the
    same draw as one process) and this rank keeps its columns."""

    def __init__(self, dropout, sl):
        super().__init__(dropout.p, dropout.seed)
        self.stream = dropout.stream
        self._buffers["calls"] = dropout._buffers["calls"]
        self.slice = sl

    def _draw(self, shape, rng):
        import numpy as np  # noqa: PLC0415

        full = tuple(shape[:-1]) + (self.slice.full,)
        keep = rng.random(full, dtype=np.float32) >= self.p
        return keep[..., self.slice.lo:self.slice.hi]

    def __repr__(self):
        return f"ShardedDropout(p={self.p}, columns {self.slice.lo}..{self.slice.hi})"


class ParallelSoftmaxCrossEntropy(Loss):
    """Softmax cross-entropy over logits sliced by class on the tensor-parallel group:
    all-reduces of the row maximum, of the row sums of exponentials and of the target's
    logit (two sums in one call); the gradient is this rank's slice of
    ``(softmax - onehot) / N``. Same mean as ``SoftmaxCrossEntropy`` up to rounding."""

    algorithm = "auto"  # of the max and sums all-reduces (see _ParallelLinear)

    def __init__(self, group, sl):
        self.group, self.slice = group, sl
        self._probs = None

    def forward(self, logits, labels):
        xp = array_module(logits)
        logits2 = logits.reshape(-1, logits.shape[-1])
        labels = xp.asarray(labels).reshape(-1)
        n = logits2.shape[0]
        if labels.shape[0] != n:
            raise ShapeError(f"cross-entropy: {n} rows of logits but {labels.shape[0]} labels")
        if n == 0:
            raise ShapeError("cross-entropy got an empty batch")
        if labels.dtype.kind not in "iu":
            raise ValueError(f"cross-entropy labels must be integer class indices, got dtype "
                             f"{labels.dtype}")
        lo, hi, full = self.slice.lo, self.slice.hi, self.slice.full
        if int(labels.min()) < 0 or int(labels.max()) >= full:
            bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
            raise ValueError(f"cross-entropy labels must be in [0, {full - 1}] for {full} "
                             f"classes, got label {bad}")
        g = self.group
        row_max = logits2.max(axis=1)
        g.allreduce(row_max, out=row_max, op="max", algorithm=self.algorithm,
                    name="tp.loss.max")
        shifted = logits2 - row_max[:, None]
        probs = xp.exp(shifted)
        mine = (labels >= lo) & (labels < hi)
        rows = xp.arange(n)
        sums = xp.empty((2, n), dtype=logits2.dtype)
        sums[0] = probs.sum(axis=1)
        sums[1] = xp.where(mine, shifted[rows, xp.where(mine, labels - lo, 0)], 0)
        g.allreduce(sums, out=sums, algorithm=self.algorithm, name="tp.loss.sums")
        probs /= sums[0][:, None]
        self._probs, self._mine, self._local = probs, mine, labels - lo
        self._shape = logits.shape
        return float((xp.log(sums[0]) - sums[1]).mean())

    def backward(self):
        probs = self._probs
        if probs is None:
            raise RuntimeError("ParallelSoftmaxCrossEntropy.backward called before forward")
        self._probs = None
        xp = array_module(probs)
        n = probs.shape[0]
        rows = xp.nonzero(self._mine)[0]
        probs[rows, self._local[rows]] -= 1.0
        probs *= 1.0 / n
        return probs.reshape(self._shape)

    def correct(self, logits, labels):
        """Rows whose largest logit (the first one, on ties, as ``argmax``) is the label:
        the largest value by an all-reduce max, then the smallest class index holding it
        by an all-reduce min."""
        import numpy as np  # noqa: PLC0415

        xp = array_module(logits)
        logits2 = logits.reshape(-1, logits.shape[-1])
        labels = xp.asarray(labels).reshape(-1)
        g = self.group
        local_max = logits2.max(axis=1)
        best = local_max.copy()
        g.allreduce(best, out=best, op="max", name="tp.acc.max")
        where = xp.where(local_max == best, logits2.argmax(axis=1) + self.slice.lo,
                         self.slice.full).astype(np.int64)
        g.allreduce(where, out=where, op="min", name="tp.acc.argmax")
        return int((where == labels).sum())

    def __repr__(self):
        return f"ParallelSoftmaxCrossEntropy(classes {self.slice.lo}..{self.slice.hi})"


class TensorParallel:
    """The runtime part: cuts the model at setup, and moves whole states in and out."""

    #: False: the group is the mesh's tp axis, whose ranks share one piece of the data.
    #: True (``mpidl.runtime.hybrid``): the group is the data-parallel group itself, every
    #: rank its own data; the mesh has no tp axis and sliced parameters are not broadcast.
    over_dp = False

    def __init__(self, degree):
        self.degree = degree
        self.group = None
        self.output_slice = None  # the class slice of sharded logits, or None
        self.slices = {}          # parameter name -> Slice
        self.layers = []          # (name, kind) of every parallel layer, for describe()

    # -- planning (local: the command line checks it before any rank communicates)
    def check(self, model):
        """ConfigError when the model cannot be cut T ways: a layer narrower than T, an
        attention with fewer heads than T."""
        self._plan(model, None)

    def _plan(self, model, group):
        """Walk the model; with ``group`` None only check, else replace layers."""
        t = self.degree
        att_types = (CausalAttention,)
        tied_types = (TiedHead,)
        embeddings = {}  # id(weight Parameter) -> its VocabParallelEmbedding

        def need(n, what, name):
            if n < t:
                raise ConfigError(f"--tensor-parallel {t}: {name} has {n} {what}, fewer than "
                                  f"the {t} ranks to split it over; use a smaller "
                                  "--tensor-parallel")

        def walk(layer, prefix, top):
            if not isinstance(layer, Sequential):
                for cname, child in layer.children():
                    walk(child, f"{prefix}{cname}.", False)
                return
            layers = layer.layers
            pending, between = None, []
            for i, child in enumerate(layers):
                name = f"{prefix}{i}"
                if isinstance(child, Linear):
                    if pending is None:
                        pending, between = i, []
                        continue
                    heads = [b for b in between if isinstance(b, att_types)]
                    col_unit = row_unit = 1
                    if heads:
                        dh = heads[0].head_dim
                        col_unit, row_unit = 3 * dh, dh
                        n_heads = layers[pending].out_features // col_unit
                        need(n_heads, "attention heads", f"layer {prefix}{pending}")
                    else:
                        need(layers[pending].out_features, "output features",
                             f"Linear {prefix}{pending}")
                    if group is not None:
                        col = self._column(layers[pending], group, f"{prefix}{pending}",
                                           col_unit)
                        layers[pending] = col
                        for j in range(pending + 1, i):
                            if isinstance(layers[j], Dropout):
                                layers[j] = ShardedDropout(layers[j], col.slice)
                        layers[i] = RowParallelLinear(child, group, name, row_unit)
                        self.layers += [(f"{prefix}{pending}", "column"), (name, "row")]
                    pending = None
                elif isinstance(child, Embedding):
                    need(child.num_embeddings, "rows", f"Embedding {name}")
                    if group is not None:
                        layers[i] = VocabParallelEmbedding(child, group, name)
                        embeddings[id(child.weight)] = layers[i]
                        self.layers.append((name, "vocab-parallel"))
                    pending = None
                elif top and i == len(layers) - 1 and isinstance(child, tied_types):
                    if group is not None:  # the tied Embedding was cut just before
                        emb = embeddings.get(id(child.weight))
                        if emb is None:
                            raise ConfigError(f"--tensor-parallel {t}: the tied head {name} "
                                              "shares its weight with no Embedding of this "
                                              "model")
                        layers[i] = ParallelTiedHead(child, emb, group, name)
                        self.output_slice = emb.slice
                        self.layers.append((name, "tied head, logits sliced"))
                    pending = None
                elif pending is not None and isinstance(child, ELEMENTWISE + att_types):
                    between.append(child)
                else:
                    pending = None
                    walk(child, f"{name}.", False)
            if top and pending is not None and pending == len(layers) - 1:
                last = layers[pending]
                need(last.out_features, "classes", f"the output Linear {prefix}{pending}")
                if group is not None:
                    col = self._column(last, group, f"{prefix}{pending}")
                    layers[pending] = col
                    self.output_slice = col.slice
                    self.layers.append((f"{prefix}{pending}", "column, logits sliced"))

        walk(model, "", True)

    def _column(self, linear, group, name, unit=1):
        """The column-parallel layer that replaces ``linear`` (a subclass may make another
        kind for some layers: the hybrid's first fully connected layer gathers its input)."""
        return ColumnParallelLinear(linear, group, name, unit)

    # -- set-up (collective over nothing: the model is cut locally)
    def setup(self, model, group):
        """Cut ``model`` (the same on every rank, built whole or lazily) into this rank's
        slices."""
        self.group = group
        self.layers = []
        self._plan(model, group)
        self.slices = {}
        for prefix, layer in model.modules():
            for pname, sl in getattr(layer, "param_slices", {}).items():
                self.slices[f"{prefix}.{pname}" if prefix else pname] = sl

    def loss(self, loss):
        """The loss to train with: the parallel cross-entropy when the logits are sliced."""
        if self.output_slice is None:
            return loss
        if not isinstance(loss, SoftmaxCrossEntropy):
            raise ConfigError(f"--tensor-parallel {self.degree}: the model's logits are split "
                              f"over the ranks, which only softmax cross-entropy handles, "
                              f"not {type(loss).__name__}")
        return ParallelSoftmaxCrossEntropy(self.group, self.output_slice)

    def describe(self):
        return [f"tensor parallel over {self.degree} ranks: "
                + ", ".join(f"{n} {k}" for n, k in self.layers)]

    # -- whole states (collective over the tensor-parallel group)
    def full_state(self, arrays, slice_of=None):
        """{key: array} of this rank's pieces -> {key: whole host array} on the group's
        first rank (None elsewhere), in one gather. ``slice_of(key)``: the parameter name
        whose slice a key follows (default: the key); keys of unsliced tensors pass
        through as they are."""
        slice_of = slice_of or (lambda key: key)
        sliced = {k: self.slices.get(slice_of(k)) for k in arrays}
        mine = {k: to_numpy(a) for k, a in arrays.items() if sliced[k] is not None}
        g = self.group
        with g.waiting("in the gather of tensor-parallel slices (checkpoint or --save)"):
            pieces = g.mpi.gather(mine, root=0)
        if g.rank != 0:
            return None
        return {k: (sliced[k].join([p[k] for p in pieces]) if sliced[k] is not None else a)
                for k, a in arrays.items()}

    def local_state(self, arrays, slice_of=None):
        """{key: whole array} -> this rank's pieces (the inverse of ``full_state``)."""
        slice_of = slice_of or (lambda key: key)
        out = {}
        for k, a in arrays.items():
            sl = self.slices.get(slice_of(k))
            if sl is not None and tuple(a.shape)[sl.dim] != sl.full:
                raise ConfigError(f"checkpoint: {k!r} has {a.shape[sl.dim]} along dimension "
                                  f"{sl.dim}; the whole model has {sl.full}")
            if sl is None:
                out[k] = a
            else:  # (a checkpoint's tensor not read yet: its slice is read when loaded)
                out[k] = a.part(sl.dim, sl.lo, sl.hi) if is_deferred(a) else sl.take(a)
        return out

    def split_state(self, model_state, opt_state):
        """A checkpoint's parts, local: (unsliced model state, optimizer state without
        the sliced parameters' arrays, this rank's shard {"model", "optimizer"} of
        slices, the index's ``slices`` entry {name: [dim, whole size]})."""
        whole = {k: v for k, v in model_state.items() if k not in self.slices}
        shard = {"model": {k: to_numpy(v) for k, v in model_state.items()
                           if k in self.slices}, "optimizer": {}}
        kept = {}
        for name, st in opt_state.get("state", {}).items():
            if name in self.slices:
                shard["optimizer"][name] = {k: to_numpy(v) for k, v in st.items()
                                            if hasattr(v, "shape")}
                kept[name] = {k: v for k, v in st.items() if not hasattr(v, "shape")}
            else:
                kept[name] = st
        slices = {k: [sl.dim, sl.full] for k, sl in self.slices.items() if k in model_state}
        return whole, dict(opt_state, state=kept), shard, slices

    def full_optimizer_state(self, sd):
        """An optimizer's ``state_dict`` with every per-parameter array made whole (on the
        group's first rank; None elsewhere)."""
        flat = {(name, slot): v for name, st in sd.get("state", {}).items()
                for slot, v in st.items() if hasattr(v, "shape")}
        whole = self.full_state(flat, slice_of=lambda key: key[0])
        if whole is None:
            return None
        state = {name: {slot: whole.get((name, slot), v) for slot, v in st.items()}
                 for name, st in sd.get("state", {}).items()}
        return dict(sd, state=state)

    def local_optimizer_state(self, sd):
        """The inverse of ``full_optimizer_state``: this rank's pieces of a whole one."""
        state = {}
        for name, st in sd.get("state", {}).items():
            arrays = {(name, slot): v for slot, v in st.items() if hasattr(v, "shape")}
            mine = self.local_state(arrays, slice_of=lambda key: key[0])
            state[name] = {slot: mine.get((name, slot), v) for slot, v in st.items()}
        return dict(sd, state=state)

    def full_shapes(self, model):
        """{name: whole shape} of the model's state."""
        out = {}
        for n, a in model.state_dict().items():
            shape = list(a.shape)
            sl = self.slices.get(n)
            if sl is not None:
                shape[sl.dim] = sl.full
            out[n] = tuple(shape)
        return out

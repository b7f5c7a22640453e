"""``--clip-grad-norm MAX``: gradients clipped to a global L2 norm that every layout agrees
on to the last bit.

Clipping by global norm (Pascanu et al. 2013; PyTorch's ``clip_grad_norm_``, Megatron-LM's
``--clip-grad``, DeepSpeed's ``gradient_clipping``) scales every gradient by
``min(1, MAX / (||g|| + 1e-6))`` once the gradients are synchronized and before the
optimizer steps. In a parallel layout no rank holds the whole gradient: a ZeRO rank holds
chunks of it, a tensor-parallel rank slices of some tensors and whole copies of others, a
pipeline stage its own layers. Summed the usual way, the squares' rounding depends on how
the pieces fall, so the coefficient, and every parameter after it, would differ between
layouts in their last bits; and a tensor replicated over a tensor-parallel group, counted
on every rank of it, would clip too early (a known trap of Megatron-style layouts).

Here the sum of squares is reproducible. One max all-reduce finds the largest square
anywhere, below 2**E; each square is then cut at fixed powers of two below 2**E into two or
three parts (``(s + sigma) - sigma`` rounds ``s`` to a multiple of ``sigma``'s unit), each
part as wide as lets a sum of every element's parts stay exact in float64 (``folds_for``).
All parts of a fold are multiples of one unit, so their sum is exact whatever the order and
however the elements are spread over ranks (Demmel and Nguyen's pre-rounded summation). The
folds' sums are all-reduced (exactly) and added in a fixed order. The norm's bits depend on
the gradient's values alone: ZeRO stages stay bitwise equal to stage 0, and a pipeline to one
process, with clipping on. What is lost is each square's bits below the last fold's unit:
a relative error of the norm below ``n * 2**-51`` for n elements (and far below it unless
one element dwarfs all others).

Every element is counted once: a tensor whole on every rank of a tensor-parallel group (or
of the conv-DP/FC-MP hybrid's group) by the group's first rank only; a tied weight's copy on
a later pipeline stage is no parameter of that stage. Data-parallel replicas hold the same
reduced gradient and each computes the same norm without talking; under ZeRO the
data-parallel group sums its chunks. Under model averaging (local SGD, DiLoCo) each
replica clips its own gradient with its own norm between averagings, as one process
training that replica would (no collective: the replicas' gradients differ by design;
the all-reduced steps of post-local SGD's warm-up are clipped like data parallelism's,
and DiLoCo's outer step is not clipped). Not built: the asynchronous pipeline,
parameter servers and
Hogwild (the servers apply the gradients), compression, L-BFGS and ``--cuda-graph``; more
than 2**32 counted elements (a fold would no longer sum exactly).
"""

import math

import numpy as np

from mpidl.errors import ConfigError

MIN_BITS = 20
#: the most elements one norm may count (a fold's sum of them stays exact)
MAX_ELEMENTS = 2 ** (52 - MIN_BITS) - 1
EPS = 1e-6  # added to the norm before dividing (as PyTorch and Megatron-LM do)
PIECE = 1 << 15  # elements squared at a time (a small float64 scratch, not a tensor's copy)

#: what clipping cannot serve: the preset's name -> why
REFUSED = {
    "ps": "the parameter servers apply each worker's gradient on their own shards",
    "hogwild": "every worker adds its own gradient to the shared parameters without waiting",
}


def check_max_norm(value):
    if value is None:
        return None
    value = float(value)
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"--clip-grad-norm must be a positive number (the largest global "
                          f"L2 norm of the gradients), got {value!r}")
    return value


def _pieces(a):
    flat = a.reshape(-1)
    for lo in range(0, flat.size, PIECE):
        yield flat[lo:lo + PIECE]


def local_max(pieces):
    """The largest |x| over ``pieces`` (arrays), as a float; inf if any element is not
    finite."""
    top = 0.0
    for a in pieces:
        if a.size == 0:
            continue
        hi, lo = float(a.max()), float(a.min())  # (a NaN anywhere makes them NaN)
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return math.inf
        top = max(top, hi, -lo)
    return top


def folds_for(count):
    """``(folds, bits)`` for sums of ``count`` squares: each fold's parts are ``bits``
    bits wide, as wide as keeps a sum of ``count`` of them exact in float64's 53 bits;
    two folds, or three where they would be narrower than 26 bits."""
    bits = 52 - max(1, int(count)).bit_length()
    if bits < MIN_BITS:
        raise ConfigError(f"--clip-grad-norm: the gradient has {int(count)} elements, more "
                          f"than the {MAX_ELEMENTS} its exact norm can sum")
    return (2 if bits >= 26 else 3), bits


def scale_exponent(top):
    """``k`` such that the elements times ``2**-k`` square without overflow or loss to
    underflow (0 for every float32 gradient: only float64 ones beyond 2**+-400 move)."""
    if top == 0.0 or 2.0 ** -400 < top < 2.0 ** 400:
        return 0
    return math.frexp(top)[1]


def sigmas(largest, folds, bits):
    """The fold boundaries for squares at most ``largest`` (> 0, finite): ``sigma_k``, whose
    unit is ``2**(E - (k + 1) * bits)``, every square being below ``2**E``."""
    e = math.frexp(largest)[1]
    return [1.5 * 2.0 ** (e - (k + 1) * bits + 52) for k in range(folds)]


def fold_sums(pieces, boundaries, k=0):
    """Each fold's sum of parts over the squares of ``pieces`` times ``2**-k`` (every sum
    exact)."""
    from mpidl.backend import array_module  # noqa: PLC0415

    out = [0.0] * len(boundaries)
    last = len(boundaries) - 1
    s = q = None
    for a in pieces:
        xp = array_module(a)
        for piece in _pieces(a):
            m = piece.size
            if s is None or s.size < m:
                s, q = xp.empty(PIECE, dtype=np.float64), xp.empty(PIECE, dtype=np.float64)
            sv, qv = s[:m], q[:m]
            if k:  # (a power of two: exact, but for elements 2**-1000 below the largest)
                xp.multiply(piece, 2.0 ** -k, out=sv, dtype=np.float64)
                xp.square(sv, out=sv)
            else:
                xp.square(piece, out=sv, dtype=np.float64)  # (exact for float32, 2-byte)
            for j, sigma in enumerate(boundaries):
                xp.add(sv, sigma, out=qv)  # sv rounded to a multiple of sigma's unit
                qv -= sigma
                out[j] += float(qv.sum())
                if j < last:
                    sv -= qv
    return out


def global_norm(pieces, count, reduce=None):
    """The L2 norm of every element of the arrays ``pieces()`` yields (this rank's part;
    it is called twice; at most ``count`` elements over every rank), over the ranks
    ``reduce(values, op)`` sums (``op`` "sum") or takes the largest of (``op`` "max"):
    None for one process. The same bits however the elements are spread; inf when any
    element is not finite."""
    folds, bits = folds_for(count)
    top = local_max(pieces())
    if reduce is not None:
        top = float(reduce(np.array([top]), "max")[0])
    if top == 0.0 or not math.isfinite(top):
        return top
    k = scale_exponent(top)
    scaled = math.ldexp(top, -k)
    sums = fold_sums(pieces(), sigmas(scaled * scaled, folds, bits), k)
    if reduce is not None:
        sums = reduce(np.array(sums, dtype=np.float64), "sum")
    total = 0.0
    for v in sums:  # (in a fixed order: the folds' sums are not multiples of one unit)
        total += float(v)
    return math.ldexp(math.sqrt(total), k)


def coefficient(norm, max_norm):
    """What the gradients are multiplied by: ``min(1, max_norm / (norm + 1e-6))``, as
    PyTorch's ``clip_grad_norm_`` computes it; 1 for a norm that is not finite (the step's
    overflow or divergence checks decide about those)."""
    if not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + EPS))


class GradClip:
    """The runtime's clipping part: which of this rank's gradient elements count, over
    which groups their squares are summed, and the epoch's figures."""

    def __init__(self, max_norm):
        self.max_norm = check_max_norm(max_norm)
        self.groups = []         # the groups the norm is summed over (see module doc)
        self.first_of_copies = True  # this rank counts tensors its group holds whole
        self.runtime = None
        self.count = 0           # the most elements the norm counts, over the groups
        self.chunks = None       # ZeRO: (shard, lo, hi) of each counted piece of its chunk
        self.counted = {}        # else: name -> Parameter whose gradient this rank counts
        self.reset()

    def reset(self):
        self.norms = []          # this epoch's norms before clipping (finite ones)
        self.clipped = 0         # this epoch's steps whose gradients were scaled

    def check(self, runtime):
        """Refuse, before any rank communicates, a runtime clipping cannot serve (one
        line)."""
        if runtime.pp is not None and runtime.pp.kind == "async":
            raise ConfigError("--clip-grad-norm with --pipeline-schedule async is not "
                              "built: its stages apply gradients of different steps; use "
                              "a synchronous schedule")
        if runtime.cuda_graph:
            raise ConfigError("--clip-grad-norm with --cuda-graph is not built: the captured "
                              "step has no place for the norm's exchange; drop one of them")
        if runtime.compressor is not None:
            raise ConfigError(f"--clip-grad-norm with --compression {runtime.compressor.name} "
                              "is not built: a compressor's payload and error feedback (and "
                              "dgc's and onebit's momentum) are not the gradient the norm "
                              "is of; drop one of them")
        if runtime.roles.get("server"):
            raise ConfigError("--clip-grad-norm cannot be used with parameter servers "
                              "(--sparse-sync ps): the servers apply gradients to their own "
                              "shards")

    def setup(self, runtime):
        """Collective over the groups: decide them and the norm's element count."""
        self.runtime = runtime
        groups = []
        tp_group = runtime.tp_group
        if tp_group is not None and tp_group.size > 1:
            groups.append(tp_group)
            self.first_of_copies = tp_group.rank == 0
        if runtime.pp_group is not None and runtime.pp_group.size > 1:
            groups.append(runtime.pp_group)
        sharded = hasattr(runtime.placement, "shards")  # ZeRO: chunks over the dp group
        if sharded and runtime.group is not None and runtime.group.size > 1 and \
                runtime.group is not tp_group:
            groups.append(runtime.group)
        self.groups = groups
        placement = runtime.placement
        if hasattr(placement, "shards"):  # ZeRO: the counted pieces of this rank's chunks
            from mpidl.runtime.zero import _overlaps  # noqa: PLC0415

            self.chunks = []
            for sh in placement.shards.values():
                params = dict(zip(sh.bucket.names, sh.bucket.params))
                self.chunks += [(sh, lo, hi) for name, _, _, lo, hi in _overlaps(sh)
                                if self._counts(params[name])]
            n = sum(hi - lo for _, lo, hi in self.chunks)
        else:
            held = runtime.precision.params if runtime.precision is not None else \
                placement.optimizer.params
            self.counted = {name: p for name, p in held.items() if self._counts(p)}
            n = sum(p.data.size for p in self.counted.values())  # (a row-sparse gradient:
            # at most its tensor's rows)
        values = np.array([float(n)])
        self.count = float(self._reduce(values, "sum")[0]) if groups else float(n)
        folds_for(self.count)  # (refuses a gradient too large for its exact norm)

    def _reduce(self, values, op):
        for g in self.groups:
            g.allreduce(values, out=values, op=op, algorithm="mpi", name=f"clip.{op}")
        return values

    def _counts(self, p):
        """Whether this rank counts parameter ``p``'s elements."""
        pl = getattr(p, "placement", None)
        return (pl is not None and pl.kind == "sharded") or self.first_of_copies

    def coefficient(self, names):
        """Collective over the groups: this step's coefficient, from the gradients of
        ``names`` as the optimizer will read them (after synchronization, decoded and
        unscaled under mixed precision)."""
        norm = global_norm(lambda: self._pieces(names), self.count,
                           self._reduce if self.groups else None)
        c = coefficient(norm, self.max_norm)
        if math.isfinite(norm):
            self.norms.append(norm)
        if c != 1.0:
            self.clipped += 1
        return c

    def _pieces(self, names):
        """The counted elements of this rank's gradients, a piece at a time, as the
        optimizer reads them (a 2-byte gradient decoded and divided by the loss scale)."""
        rt = self.runtime
        prec = rt.precision
        unscale = np.float32(1.0 if prec is None else 1.0 / prec.scale)
        for g in self._grads(names):
            for piece in _pieces(g):
                if prec is not None:
                    piece = prec.wire.decode(piece)
                    if unscale != 1.0:
                        piece = piece * unscale
                yield piece

    def _grads(self, names):
        """This rank's counted gradients of ``names`` (ZeRO: its reduced chunks, every
        bucket's), as the collectives left them."""
        if self.chunks is not None:
            wire = self.runtime.precision is not None
            for sh, lo, hi in self.chunks:
                yield (sh.grad_wire if wire else sh.grad)[lo:hi]
            return
        from mpidl.engine.module import SparseGrad  # noqa: PLC0415

        for n in dict.fromkeys(names):
            p = self.counted.get(n)
            if p is None or p.grad is None:
                continue
            g = p.grad
            if isinstance(g, SparseGrad):  # the dense gradient's rows (duplicates summed)
                g = g.coalesce().values
            yield g

    def metrics(self):
        out = {"grad_norm": (sum(self.norms) / len(self.norms)) if self.norms else None,
               "clipped_steps": self.clipped}
        self.reset()
        return out


def scale_grads(optimizer, names, c):
    """Replicated placement: multiply the gradients of ``names`` the optimizer holds by
    ``c`` in place (a row-sparse gradient's rows)."""
    from mpidl.engine.module import SparseGrad  # noqa: PLC0415

    held = optimizer.params
    for n in dict.fromkeys(names):
        p = held.get(n)
        if p is None or p.grad is None:
            continue
        g = p.grad
        if isinstance(g, SparseGrad):
            g.values *= g.values.dtype.type(c)
        else:
            g *= g.dtype.type(c)

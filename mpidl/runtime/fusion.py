"""Tensor fusion: gradients packed into a few preallocated flat buffers ("buckets").

One all-reduce per bucket instead of one per tensor: fewer, larger messages, so the
per-call latency is paid a few times per step and bandwidth-bound algorithms (the ring)
run at their best. The layout is fixed once, at setup, and is the same on every rank:

* parameters in the *reverse* of ``named_parameters()`` order, because backward produces
  the last layers' gradients first, so the first bucket is complete first;
* a new bucket starts when adding the next parameter would take the current one over
  ``bucket_bytes`` (a parameter larger than that gets a bucket of its own), when the
  dtype changes (a bucket is one flat array of one dtype), or where the model's *part*
  changes (``part_of``: an interleaved pipeline's model chunks, so that a bucket holds
  one chunk's parameters and ZeRO stage 3 gathers, for a pass of a chunk, that chunk's
  buckets alone);
* with a ``wire`` format (mixed precision, ``mpidl.runtime.precision.Wire``), buckets
  hold the gradients in that 2-byte form (float16, or bfloat16 words): packing rounds
  them once, the collectives move and reduce half the bytes, and the optimizer's side
  decodes them;
* every bucket owns one flat array allocated here, and every parameter a view of it, so
  a step allocates nothing: gradients are copied in with ``copyto`` into those views and,
  once reduced, the views themselves become the parameters' ``grad``.

Buckets are launched strictly in index order (``FusionBuffers.ready`` below), whatever
order the gradients arrive in, so every rank issues the same collectives in the same
order and the sums never depend on timing.
"""

from mpidl.backend import array_module
from mpidl.engine.module import SparseGrad

MiB = 1 << 20


class Bucket:
    """One fusion buffer: a flat array and, for each of its parameters, a shaped view."""

    __slots__ = ("index", "name", "names", "params", "views", "buffer", "dtype", "nbytes",
                 "pending", "handle", "wire")

    def __init__(self, index, names, params, buffer, views, wire_dtype=None):
        self.index = index
        self.name = f"bucket{index}"  # the tensor name its collectives carry
        self.names = names            # list of parameter names, in packing order
        self.params = params          # the matching Parameter objects
        self.views = views            # buffer views shaped like each parameter
        self.buffer = buffer          # the flat array all-reduced in place
        # what the collectives are handed: the buffer, or its bytes seen as the wire
        # format's dtype (bfloat16 words, which must not be summed as integers)
        self.wire = buffer if wire_dtype is None else buffer.view(wire_dtype)
        self.dtype = self.wire.dtype
        self.nbytes = buffer.nbytes
        self.pending = len(names)     # parameters not yet packed in this step
        self.handle = None            # the in-flight all-reduce, if any

    def __repr__(self):
        return (f"Bucket({self.index}: {len(self.names)} tensors, "
                f"{self.nbytes / MiB:.2f} MiB {self.dtype})")


def plan(named_params, bucket_bytes, itemsize=None, part_of=None):
    """Group ``(name, Parameter)`` pairs into buckets: a list of lists of pairs.

    Reverse parameter order; a new group when the next parameter would overflow
    ``bucket_bytes``, has another dtype or (``part_of``, a function of the name) is in
    another part of the model. Pure function of names, shapes and dtypes, so every rank
    computes the same plan. ``itemsize``: bytes per element in the buckets (default: the
    parameters' own).
    """
    groups, current, current_bytes, current_dtype, current_part = [], [], 0, None, None
    for name, p in reversed(list(named_params)):
        nbytes = p.data.nbytes if itemsize is None else p.data.size * itemsize
        part = None if part_of is None else part_of(name)
        if current and (p.data.dtype != current_dtype or part != current_part
                        or current_bytes + nbytes > bucket_bytes):
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, p))
        current_bytes += nbytes
        current_dtype, current_part = p.data.dtype, part
    if current:
        groups.append(current)
    return groups


class FusionBuffers:
    """The buckets of one model and the per-step bookkeeping of which are complete.

    ``pack(name)`` copies one parameter's gradient into its bucket and says whether that
    completed the bucket; ``ready()`` yields the buckets that may be launched now (all
    earlier ones launched, this one complete), in index order.
    """

    def __init__(self, named_params, bucket_bytes, scale=1.0, shared=False, wire=None,
                 part_of=None):
        named_params = list(named_params)
        self.wire = wire
        # gradients are multiplied by ``scale`` on their way in (1/N: the all-reduce then
        # sums, and the mean costs no extra pass over the buckets)
        self.scale = float(scale)
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        self.bucket_bytes = int(bucket_bytes)
        self.buckets = []
        self.slot = {}  # name -> (bucket, view, parameter)
        itemsize = None if wire is None else wire.itemsize
        groups = plan(named_params, bucket_bytes, itemsize, part_of)

        def storage(data):  # the buckets' element type
            return data.dtype if wire is None else wire.storage

        # shared: every bucket a prefix of one buffer, the largest bucket's size (ZeRO
        # stage 2 packs and sends the buckets one after another through it)
        # (one such buffer per dtype)
        pools = {}
        if shared:
            for g in groups:
                dt = storage(g[0][1].data)
                pools[dt] = max(pools.get(dt, 0), sum(p.data.size for _, p in g))
            pools = {dt: array_module(groups[0][0][1].data).zeros(n, dtype=dt)
                     for dt, n in pools.items()}
        for index, group in enumerate(groups):
            first = group[0][1].data
            xp = array_module(first)
            total = sum(p.data.size for _, p in group)
            buffer = pools[storage(first)][:total] if shared else \
                xp.zeros(total, dtype=storage(first))
            views, offset = [], 0
            for _, p in group:
                n = p.data.size
                views.append(buffer[offset:offset + n].reshape(p.data.shape))
                offset += n
            bucket = Bucket(index, [n for n, _ in group], [p for _, p in group], buffer,
                            views, None if wire is None else wire.dtype)
            self.buckets.append(bucket)
            for name, view, p in zip(bucket.names, views, bucket.params):
                self.slot[name] = (bucket, view, p)
        self.nbytes = sum(b.nbytes for b in self.buckets)  # of the layout
        #: bytes allocated for the buffers (less than ``nbytes`` when shared)
        self.buffer_nbytes = sum(b.nbytes for b in pools.values()) if shared else self.nbytes
        self._next = 0          # index of the next bucket to launch
        self.launched = 0       # buckets launched so far in this step
        self._packed = set()    # names packed in this step

    def __len__(self):
        return len(self.buckets)

    def __contains__(self, name):
        return name in self.slot

    # -- per step ---------------------------------------------------------------------------
    def begin_step(self):
        for b in self.buckets:
            b.pending = len(b.names)
            b.handle = None
        self._next = 0
        self.launched = 0
        self._packed.clear()

    def pack(self, name):
        """Copy ``name``'s gradient (times ``scale``) into its bucket (zeros if missing).

        Returns True when this completed the bucket. A name packed twice in one step (a
        layer whose backward ran twice) is copied again but counted once.
        """
        bucket, view, p = self.slot[name]
        grad = p.grad
        xp = array_module(view)
        if grad is None:  # a parameter backward did not reach: contributes nothing
            view.fill(0)
        elif grad is not view:
            if isinstance(grad, SparseGrad):  # planned into a dense bucket (sparse="dense")
                grad = grad.to_dense()
            if self.wire is not None:
                self.wire.encode(grad, self.scale, view)
            elif self.scale == 1.0:
                xp.copyto(view, grad)
            else:
                xp.multiply(grad, self.scale, out=view)
        if name in self._packed:
            return False
        self._packed.add(name)
        bucket.pending -= 1
        return bucket.pending == 0

    def pack_rest(self):
        """Pack every parameter not packed yet in this step (the end of backward)."""
        for b in self.buckets[self._next:]:
            if b.pending:
                for name in b.names:
                    if name not in self._packed:
                        self.pack(name)

    def ready(self):
        """The buckets that can be launched now, in order; marks them launched."""
        buckets, i = self.buckets, self._next
        start = i
        while i < len(buckets) and buckets[i].pending == 0:
            i += 1
        self._next = self.launched = i
        return buckets[start:i]

    def unpack(self, bucket):
        """Make the (reduced) views the parameters' gradients: no copy out."""
        for p, view in zip(bucket.params, bucket.views):
            p.grad = view

    def describe(self):
        """One line per bucket, for logs and reports."""
        return [f"bucket {b.index}: {b.nbytes / MiB:.3f} MiB "
                f"{'bfloat16' if b.dtype.names else b.dtype}, "
                f"{', '.join(b.names)}" for b in self.buckets]

"""Compressed gradient exchange (``--compression``), laid out for the cost model.

What travels is decided by the compressor's own code, so this module runs it: each
tensor the runtime would exchange (``compressed.PerTensorCompressed``: every parameter,
an Embedding's gradient densified; ``compressed.BucketHook``: each fused bucket, for the
element-wise compressors fp16 and none) is compressed by a fresh compressor built from
the same ``--compression``/``--ratio`` (``build_compression``, its memory included), and
the collectives ``mpidl.compress.Exchanger`` would start for the payload are recorded:

- a summable payload (fp16, random-k): one all-reduce per payload array, in its dtype;
  except float16 payloads of host arrays at p = 2, which the exchanger all-gathers;
- any other: one ``allgatherv`` of the payload's frame (``frame.header``: the arrays
  padded to 8 bytes behind a 16-byte entry each), uint8, one frame per rank;
- a multi-round compressor (PowerSGD): its own ``reduce`` runs with an all-reduce that
  records each call (the mean of identical ranks is the array itself).

The payload's size is exact for compressors whose size depends on the shape only (fp16,
onebit, random-k, qsgd, terngrad, PowerSGD). For the sparse ones (top-k, DGC, threshold)
it depends on the gradient's values: which entries are sent, and the gaps between them
(indices are delta-packed, ``kernels.encode_sparse``). The gradient given (a real one,
from a batch of the training set) gives an estimate, and ``frames`` (each rank's frame
bytes per tensor) the exact layout when they are known, as the exactness test knows
them.

The compressors' own work is timed here on the gradient given (``Call.local_s`` of each
tensor's first call: the seconds this machine takes, at ``p`` ranks) by running the
runtime's own ``Exchanger`` over a loopback group that stands in for the ranks (every
rank's payload alike, nothing moved): so it holds everything a step computes beside its
collectives, not just the compressor's calls: error feedback, the momentum a momentum-
correcting memory (DGC, 1-bit) takes over from SGD as the runtime hands it, packing the
frame, unpacking and decoding each rank's, the mean, restoring the shape and dtype. This
process times it alone; the step prices it at the machine's gamma
(``step.local_scale``: ``StepLayout.local_gamma`` is this process's).
"""

import time
from types import SimpleNamespace

import numpy as np

from mpidl.compress import Exchanger, build_compression, frame
from mpidl.compress.exchange import Done

from .step import Call, _dtype_name, resolve


class _Loopback:
    """Stands in for the data-parallel group while ``Exchanger`` runs one rank's exchange:
    every rank's contribution is this rank's (a mean of equal arrays is the array; an
    all-gather is ``size`` copies of the frame). ``spent``: the seconds its own copies
    took, which the link model prices and the timing leaves out."""

    rank = 0
    local_size = 1

    def __init__(self, size):
        self.size = size
        self.spent = 0.0

    def allreduce(self, x, out=None, op="sum", algorithm="auto", name=None):
        return x if out is None else out

    def iallreduce(self, x, op="sum", algorithm="auto", name=None):
        return Done(x)

    def iallgatherv(self, x, algorithm="auto", name=None):
        from mpidl.backend import array_module  # noqa: PLC0415

        t = time.perf_counter()
        gathered = array_module(x).concatenate([x.reshape(-1)] * self.size)
        self.spent += time.perf_counter() - t
        return Done((gathered, [int(x.size)] * self.size))


def exchange_seconds(spec, ratio, tensors, p, repeats=5, seconds=0.2, momentum=0.0):
    """Per tensor of ``tensors`` ((name, gradient) pairs, in the order the runtime starts
    them), the seconds of its compressed exchange on this machine apart from the
    collectives: ``Exchanger.start`` and ``finish`` over a loopback group of ``p``
    ranks (module doc), the median of at least ``repeats`` steps and ``seconds`` of them
    (one step's timing is at the mercy of whatever else the machine runs), the memory
    carried from step to step as in training. A first step only compiles the kernels.
    ``momentum``: the run's SGD momentum, which a momentum-correcting memory takes over
    (``Exchanger.adopt_momentum``, as the runtime does at set-up)."""
    group = _Loopback(p)
    exchanger = Exchanger(group, build_compression(spec, ratio))
    exchanger.adopt_momentum(SimpleNamespace(momentum=float(momentum or 0.0)))
    runs = {name: [] for name, _ in tensors}
    start, rep = time.perf_counter(), 0
    while rep <= repeats or time.perf_counter() - start < seconds:
        rep += 1
        for name, g in tensors:
            before = group.spent
            t = time.perf_counter()
            exchanger.finish(exchanger.start(g, name))
            runs[name].append(time.perf_counter() - t - (group.spent - before))
    return {name: float(np.median(r[1:])) for name, r in runs.items()}


def tensor_calls(compressor, grad, name, p, selector, algorithm, params, frames=None,
                 on_gpu=False):
    """The calls of one tensor's exchange (module doc)."""
    c = compressor
    calls = []
    if c.multi_round:
        def mean(array, label):
            alg = resolve(selector, "allreduce", algorithm, array.nbytes, array.dtype)
            calls.append(Call("allreduce", label, alg, int(array.size), array.itemsize,
                              _dtype_name(array.dtype), params))
            return array

        c.reduce(grad, name, mean)
        return calls
    memory = getattr(c, "memory", None)
    payload, ctx = memory.compress(c, grad, name) if memory is not None \
        else c.compress(grad, name)
    gather = not c.summable or (p == 2 and not on_gpu
                                and any(a.dtype == np.float16 for a in payload))
    if not gather:
        for i, a in enumerate(payload):
            alg = resolve(selector, "allreduce", algorithm, a.nbytes, a.dtype)
            calls.append(Call("allreduce", f"{name}/{i}", alg, int(a.size), a.itemsize,
                              _dtype_name(a.dtype), params))
        return calls
    size = frame.header(payload)[1]
    counts = list(frames) if frames is not None else [size] * p
    if len(counts) != p:
        raise ValueError(f"tensor {name}: give the frame bytes of each of the {p} ranks, "
                         f"got {counts}")
    alg = resolve(selector, "allgatherv", algorithm, sum(counts) // p, np.uint8)
    return [Call("allgatherv", name, alg, counts, 1, "uint8", params)]


def layout(step, named_params, grads, spec, ratio, selector, algorithm, bucket_mb,
           frames=None, overlap=True, on_gpu=False, momentum=0.0):
    """Fill ``step`` (a ``StepLayout`` for ``p`` ranks) with the compressed exchange of
    ``grads`` (name -> a gradient of each parameter, dense). ``frames``: per tensor (or
    bucket) name, each rank's frame bytes, where known; ``on_gpu``: the gradients are
    device arrays in the run (float16 payloads are then all-reduced at p = 2 too);
    ``momentum``: the run's SGD momentum (``exchange_seconds``)."""
    from mpidl.runtime.fusion import MiB, plan  # noqa: PLC0415

    from .calibrate import measure_gamma  # noqa: PLC0415

    p = step.p
    frames = frames or {}
    if build_compression(spec, ratio).granularity == "bucket":  # each fused bucket
        tensors = []
        for index, group in enumerate(plan(named_params, int(bucket_mb * MiB))):
            flat = np.concatenate([np.asarray(grads[n], dtype=q.data.dtype).reshape(-1)
                                   for n, q in group])
            tensors.append((f"bucket{index}", flat, tuple(n for n, _ in group)))
        step.buckets = len(tensors)
    else:  # every tensor, in backward's order (as the runtime starts them)
        tensors = [(n, np.asarray(grads[n], dtype=q.data.dtype).reshape(q.data.shape), (n,))
                   for n, q in reversed(list(named_params))]
        step.overlap = overlap
    compressor = build_compression(spec, ratio)
    compressor.bind(0, p)
    step.local_gamma = measure_gamma()
    seconds = exchange_seconds(spec, ratio, [(name, g) for name, g, _ in tensors], p,
                               momentum=momentum)
    for name, g, params in tensors:
        calls = tensor_calls(compressor, g, name, p, selector, algorithm, params,
                             frames.get(name), on_gpu)
        calls[0].local_s = seconds[name]
        step.calls += calls
        step.dense_bytes += g.nbytes
    step.what = f"compression {spec}"
    return step


def pushed(spec, ratio, grads, worker=0, workers=1):
    """What a parameter server's worker pushes under ``--compression`` (``server.Pushes``'
    arrays): per parameter ``(encoding, meta, arrays)`` as ``mpidl.ps.worker`` encodes
    it: a row-sparse gradient's rows uncompressed, a dense one compressed by a fresh
    compressor of worker ``worker`` of ``workers`` (its memory included), its context
    travelling in the header. ``grads``: as the engine leaves them (``SparseGrad`` for
    an Embedding's)."""
    from mpidl.backend import to_numpy  # noqa: PLC0415
    from mpidl.engine.module import SparseGrad  # noqa: PLC0415

    c = build_compression(spec, ratio)
    c.bind(worker, workers)
    memory = getattr(c, "memory", None)
    out = {}
    for name, g in grads.items():
        if g is None:
            continue
        if isinstance(g, SparseGrad):
            out[name] = ("sparse", None, [to_numpy(g.indices), to_numpy(g.values)])
            continue
        payload, ctx = memory.compress(c, g, name) if memory is not None \
            else c.compress(g, name)
        out[name] = ("compressed", ctx, [to_numpy(a) for a in payload])
    return out

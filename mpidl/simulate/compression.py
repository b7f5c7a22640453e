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

The compressors' own work (compress, and decode every rank's payload) is timed here
on the gradient given: ``Call.local_s``, the seconds this machine takes, at ``p`` ranks.
"""

import time

import numpy as np

from mpidl.compress import build_compression, frame

from .step import Call, _dtype_name, resolve


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def tensor_calls(compressor, grad, name, p, selector, algorithm, params, frames=None,
                 on_gpu=False):
    """The calls of one tensor's exchange (module doc), with the compressor's seconds."""
    c = compressor
    calls = []
    if c.multi_round:
        def mean(array, label):
            alg = resolve(selector, "allreduce", algorithm, array.nbytes, array.dtype)
            calls.append(Call("allreduce", label, alg, int(array.size), array.itemsize,
                              _dtype_name(array.dtype), params))
            return array

        _, seconds = _timed(c.reduce, grad, name, mean)
        if calls:
            calls[0].local_s = seconds
        return calls
    memory = getattr(c, "memory", None)
    if memory is not None:
        (payload, ctx), encode = _timed(memory.compress, c, grad, name)
    else:
        (payload, ctx), encode = _timed(c.compress, grad, name)
    gather = not c.summable or (p == 2 and not on_gpu
                                and any(a.dtype == np.float16 for a in payload))
    if not gather:
        for i, a in enumerate(payload):
            alg = resolve(selector, "allreduce", algorithm, a.nbytes, a.dtype)
            calls.append(Call("allreduce", f"{name}/{i}", alg, int(a.size), a.itemsize,
                              _dtype_name(a.dtype), params))
        _, decode = _timed(c.decompress, payload, ctx)
        calls[0].local_s = encode + decode
        return calls
    size = frame.header(payload)[1]
    counts = list(frames) if frames is not None else [size] * p
    if len(counts) != p:
        raise ValueError(f"tensor {name}: give the frame bytes of each of the {p} ranks, "
                         f"got {counts}")
    alg = resolve(selector, "allgatherv", algorithm, sum(counts) // p, np.uint8)
    out = np.zeros(ctx.n, dtype=np.float32)
    _, decode = _timed(c.decompress_add, payload, ctx, out)
    call = Call("allgatherv", name, alg, counts, 1, "uint8", params)
    call.local_s = encode + p * decode
    return [call]


def layout(step, named_params, grads, spec, ratio, selector, algorithm, bucket_mb,
           frames=None, overlap=True, on_gpu=False):
    """Fill ``step`` (a ``StepLayout`` for ``p`` ranks) with the compressed exchange of
    ``grads`` (name -> a gradient of each parameter, dense). ``frames``: per tensor (or
    bucket) name, each rank's frame bytes, where known; ``on_gpu``: the gradients are
    device arrays in the run (float16 payloads are then all-reduced at p = 2 too)."""
    from mpidl.runtime.fusion import MiB, plan  # noqa: PLC0415

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
    # the first compressor only compiles the kernels (its times would be the JIT's); the
    # second's calls and times are the layout
    for keep in (False, True):
        compressor = build_compression(spec, ratio)
        compressor.bind(0, p)
        for name, g, params in tensors:
            calls = tensor_calls(compressor, g, name, p, selector, algorithm, params,
                                 frames.get(name), on_gpu)
            if keep:
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

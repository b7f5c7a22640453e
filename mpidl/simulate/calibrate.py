"""``mpidl simulate --calibrate``: measure the machine the cost model describes.

- Links: ring exchanges at sizes from 1 byte to 8 MiB: every rank sends a message to
  its right neighbour and receives one from its left at the same time (``isend`` and
  ``irecv`` through mpi4py from Python, as one step of mpidl's ring does), the slowest
  rank's time per step; ``alpha + beta * bytes`` is fitted by least squares on the
  relative error (so the small sizes fix alpha and the large ones beta). Every rank
  sends at once because that is what a collective does: on a machine whose ranks share
  cores (or a node's link), a lone ping-pong would measure a faster machine than the
  collectives see. Inside a node: the exchange among a node's ranks; between nodes
  (when the launch spans several): among all ranks, whose ring crosses every node.
- Reductions: ``gamma``, seconds per byte of ``np.add(a, b, out=c)`` on 4 MiB buffers.
- Compute: forward and backward of each top-level layer of the model at the batch size,
  on every rank at once (ranks that share cores slow each other, as in training), the
  mean of several repeats (a step's mean is what an epoch takes), per sample; one
  optimizer step (``update_s``); and the spread of the whole forward + backward from
  repeat to repeat (``compute_cv``: standard deviation over mean).
"""

import time

import numpy as np

_clock = time.perf_counter


def fit_alpha_beta(sizes, times):
    """(alpha, beta) minimizing the relative error of ``alpha + beta * size``."""
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    w = 1.0 / t
    a = np.stack([w, s * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def ring_exchange(comm, sizes, repeats=5, target=0.01):
    """Seconds of one ring step per message size (module doc): the median of
    ``repeats`` runs of enough steps to last about ``target`` s (a first short run sets
    the count, so a loaded machine does not stretch the calibration)."""
    from mpi4py import MPI  # noqa: PLC0415

    rank, p = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % p, (rank - 1) % p

    def steps(sbuf, rbuf, iters):
        comm.Barrier()
        t0 = _clock()
        for _ in range(iters):
            MPI.Request.Waitall([comm.Irecv(rbuf, left, 12), comm.Isend(sbuf, right, 12)])
        return comm.allreduce((_clock() - t0) / iters, op=MPI.MAX)

    out = []
    for n in sizes:
        sbuf = np.zeros(max(n, 1), dtype=np.uint8)[:n]
        rbuf = np.zeros_like(sbuf)
        first = steps(sbuf, rbuf, 3)
        iters = max(1, min(1000, int(target / max(first, 1e-7))))
        out.append(float(np.median([steps(sbuf, rbuf, iters) for _ in range(repeats)])))
    return out


def measure_links(comm, nodes):
    """{"alpha_intra", "beta_intra", ["alpha_inter", "beta_inter"], "points"} (collective);
    ``nodes``: the node of each rank."""
    sizes = [1 << k for k in range(0, 24, 3)] + [1 << 23]
    rank = comm.Get_rank()
    out = {"points": {}}
    local = comm.Split(nodes[rank], rank)
    groups = [("intra", local if local.Get_size() > 1 else None)]
    if len(set(nodes)) > 1:
        groups.append(("inter", comm))
    # every node measures its own ranks at once; the biggest node's figures are kept
    biggest = max(set(nodes), key=nodes.count)
    for where, group in groups:
        if where == "intra" and nodes.count(biggest) < 2:
            continue
        times = ring_exchange(group, sizes) if group is not None else None
        times = comm.bcast(times, root=nodes.index(biggest) if where == "intra" else 0)
        alpha, beta = fit_alpha_beta(sizes, times)
        out[f"alpha_{where}"], out[f"beta_{where}"] = alpha, beta
        out["points"][where] = {"ranks": nodes.count(biggest) if where == "intra"
                                else len(nodes), "bytes": sizes, "seconds": times}
    local.Free()
    return out


def measure_gamma(nbytes=4 << 20, repeats=21):
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    c = np.empty_like(a)
    runs = []
    for _ in range(repeats):
        t0 = _clock()
        np.add(a, b, out=c)
        runs.append(_clock() - t0)
    return float(np.median(runs)) / nbytes


def measure_compute(model, optimizer, x, repeats=12, seconds=2.0):
    """Per-sample (forward, backward) seconds of each top-level layer of a ``Sequential``,
    the seconds of one optimizer step, at the batch of ``x``, and the coefficient of
    variation of the forward + backward time: at least ``repeats`` repeats and
    ``seconds`` of them (on a shared machine the load drifts: a longer window averages
    it as a run of many steps will)."""
    from mpidl.engine.module import Sequential  # noqa: PLC0415

    layers = model.children() if isinstance(model, Sequential) else [("model", model)]
    samples = len(x)
    per = {key: ([], []) for key, _ in layers}
    updates = []
    # each repeat starts from the same weights (repeated updates along one made-up
    # gradient would drive them to overflow, and arithmetic on inf/NaN times differently)
    saved = [(q, q.data.copy()) for _, q in model.named_parameters()]
    start, rep = _clock(), 0
    while rep <= repeats or _clock() - start < seconds:
        rep += 1
        model.zero_grad()
        h = x
        needs = getattr(model, "needs_input_grad", False)
        for key, layer in layers:  # as Sequential.forward, layer by layer
            layer.needs_input_grad = needs
            needs = needs or layer.has_params()
            t0 = _clock()
            h = layer(h)
            per[key][0].append(_clock() - t0)
        dy = np.ones_like(h) / max(h.size, 1)
        for key, layer in reversed(layers):
            t0 = _clock()
            dy = layer.backprop(dy) if dy is not None else None
            per[key][1].append(_clock() - t0)
        t0 = _clock()
        optimizer.step()
        updates.append(_clock() - t0)
        for q, data in saved:
            q.data[...] = data
    # (the first repeat warms caches and lazy set-ups: dropped)
    totals = np.sum([f[1:] for f, _ in per.values()] + [b[1:] for _, b in per.values()],
                    axis=0)
    cv = float(np.std(totals) / np.mean(totals)) if np.mean(totals) > 0 else 0.0
    return ({key: [float(np.mean(f[1:])) / samples, float(np.mean(b[1:])) / samples]
             for key, (f, b) in per.items()}, float(np.mean(updates[1:])), cv)

"""``mpidl simulate --calibrate``: measure the machine the cost model describes.

- Links: ping-pong between rank 0 and another rank (one of its node, and one of another
  node when there is one) at sizes from 1 byte to 8 MiB, through mpi4py from Python as
  mpidl's own algorithms send; half the round trip is one message's time, and
  ``alpha + beta * bytes`` is fitted by least squares on the relative error (so the
  small sizes fix alpha and the large ones beta).
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


def ping_pong(comm, peer, sizes, repeats=5, target=0.01):
    """One-way seconds per message size between rank 0 and ``peer`` (others wait);
    the median of ``repeats`` runs of enough round trips to last about ``target`` s
    (a first round trip sets the count, so a loaded machine does not stretch the run)."""
    rank = comm.Get_rank()

    def trips(buf, iters):
        comm.Barrier()
        t0 = _clock()
        if rank == 0:
            for _ in range(iters):
                comm.Send(buf, peer, 11)
                comm.Recv(buf, peer, 11)
        elif rank == peer:
            for _ in range(iters):
                comm.Recv(buf, 0, 11)
                comm.Send(buf, 0, 11)
        return comm.bcast((_clock() - t0) / iters / 2, root=0)

    out = []
    for n in sizes:
        buf = np.zeros(max(n, 1), dtype=np.uint8)[:n]
        first = trips(buf, 3)
        iters = max(1, min(1000, int(target / max(2 * first, 1e-7))))
        out.append(float(np.median([trips(buf, iters) for _ in range(repeats)])))
    return out


def measure_links(comm, nodes):
    """{"alpha_intra", "beta_intra", ["alpha_inter", "beta_inter"], "points"}; ``nodes``:
    the node of each rank."""
    sizes = [1 << k for k in range(0, 24, 3)] + [1 << 23]
    out = {"points": {}}
    same = [r for r in range(1, len(nodes)) if nodes[r] == nodes[0]]
    other = [r for r in range(1, len(nodes)) if nodes[r] != nodes[0]]
    for where, peers in (("intra", same), ("inter", other)):
        if not peers:
            continue
        times = ping_pong(comm, peers[0], sizes)
        alpha, beta = fit_alpha_beta(sizes, times)
        out[f"alpha_{where}"], out[f"beta_{where}"] = alpha, beta
        out["points"][where] = {"peer": peers[0], "bytes": sizes, "seconds": times}
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


def measure_compute(model, optimizer, x, repeats=12):
    """Per-sample (forward, backward) seconds of each top-level layer of a ``Sequential``,
    the seconds of one optimizer step, at the batch of ``x``, and the coefficient of
    variation of the forward + backward time."""
    from mpidl.engine.module import Sequential  # noqa: PLC0415

    layers = model.children() if isinstance(model, Sequential) else [("model", model)]
    samples = len(x)
    per = {key: ([], []) for key, _ in layers}
    updates = []
    # each repeat starts from the same weights (repeated updates along one made-up
    # gradient would drive them to overflow, and arithmetic on inf/NaN times differently)
    saved = [(q, q.data.copy()) for _, q in model.named_parameters()]
    for rep in range(repeats + 1):
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

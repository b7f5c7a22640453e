"""Autoregressive sampling from a language model (``mpidl sample``)."""

import numpy as np

from mpidl.backend import to_device, to_numpy


def next_token_probs(logits, temperature=1.0, top_k=None, banned=()):
    """Float64 probabilities of the next token from one row of ``logits``.

    ``temperature`` divides the logits (0: all mass on the most likely token), ``top_k``
    keeps the k most likely tokens, ``banned`` ids get none (a reserved unknown id)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    if len(banned):
        z[list(banned)] = -np.inf
    if top_k is not None and 0 < top_k < len(z):
        kth = np.partition(z, len(z) - top_k)[len(z) - top_k]
        z[z < kth] = -np.inf
    if temperature == 0:
        p = np.zeros_like(z)
        p[int(np.argmax(z))] = 1.0
        return p
    z /= temperature
    z -= z.max()
    p = np.exp(z)
    return p / p.sum()


def generate(model, ids, tokens, context, temperature=1.0, top_k=None, seed=0, banned=()):
    """``ids`` followed by ``tokens`` sampled ids (a list of ints).

    Each step runs the model (in eval mode) on the last ``context`` ids and draws the
    next one from ``next_token_probs`` with ``numpy.random.default_rng(seed)``: the same
    model, prompt and seed give the same text."""
    rng = np.random.default_rng(seed)
    out = [int(i) for i in ids]
    model.eval()
    try:
        for _ in range(int(tokens)):
            window = np.asarray(out[-context:], dtype=np.int64)[None, :]
            logits = to_numpy(model(to_device(window)))[0, -1]
            model.discard_saved(all_keys=True)
            p = next_token_probs(logits, temperature, top_k, banned)
            # inverse-CDF draw: one uniform number per token, the same on every platform
            nxt = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
            out.append(min(nxt, len(p) - 1))
    finally:
        model.train()
    return out

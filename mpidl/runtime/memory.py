"""Memory per rank: what ZeRO's formula predicts, and what a running rank holds.

Training state on a data-parallel rank is four things (Rajbhandari et al., SC20):

* **parameters**, in the compute format (p bytes per element: 4 for fp32, 2 for
  bf16/fp16, 8 for float64);
* **gradients**, in the compute format (g = p bytes);
* **optimizer state**: its slots (SGD with momentum: 1; Adam, AdamW: 2; plain SGD: 0)
  in the master format (s bytes: 4 under mixed precision, else the compute format) and,
  under mixed precision only, the fp32 **master weights** (4 bytes);
* communication and activation buffers, which are not part of the formula.

With Ψ elements and K = slots·s + master bytes, ZeRO stage 0 holds (p + g + K)·Ψ on
every rank; stage 1 shards the optimizer state (p + g)·Ψ + K·Ψ/N; stage 2 also the
gradients p·Ψ + (g + K)·Ψ/N; stage 3 also the parameters (p + g + K)·Ψ/N
(``paper_formula``). mpidl's stage 1 holds g·Ψ/N more than the paper's: the reduced
gradient chunk beside the packed buckets (which let the reduce-scatter overlap
backward); ``predict`` says so. Communication buffers (stage 2-3's shared packing
buffer, gathered parameters, the algorithms' scratch) and activations are reported
apart (``mem_comm``, ``mem_activations``).

mpidl shards each fused bucket (``mpidl.runtime.fusion``) with ``layout.even_split``:
rank r holds ``counts[r]`` of a bucket's n elements, which is n/N rounded up or down.
So the exact per-rank figure is the sum of its shards, not Ψ/N: ``predict`` computes
that sum (the documented difference from Ψ/N is below one element per bucket; there
is no padding).
"""

from dataclasses import dataclass

import numpy as np

from mpidl.backend import is_gpu_array
from mpidl.comm.layout import even_split

#: bytes of one element in each compute format
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STAGES = (0, 1, 2, 3)
#: the per-rank categories every ledger and prediction reports, in bytes
CATEGORIES = ("mem_params", "mem_grads", "mem_optimizer")


def optimizer_slots(optimizer, momentum=0.0):
    """How many per-element arrays ``optimizer`` (a name) keeps."""
    name = optimizer.lower()
    if name == "sgd":
        return 1 if momentum else 0
    if name in ("adam", "adamw"):
        return 2
    raise ValueError(f"unknown optimizer {optimizer!r}: expected sgd, adam or adamw")


@dataclass(frozen=True)
class Prediction:
    """Bytes per rank of each category, for one rank of one layout."""

    rank: int
    mem_params: int
    mem_grads: int
    mem_optimizer: int
    elements: int        # Ψ
    shard: int           # elements this rank owns (the sum of its bucket shards)

    @property
    def total(self):
        return self.mem_params + self.mem_grads + self.mem_optimizer

    def as_dict(self):
        return {"rank": self.rank, "mem_params": self.mem_params,
                "mem_grads": self.mem_grads, "mem_optimizer": self.mem_optimizer,
                "total": self.total, "elements": self.elements, "shard": self.shard}


def element_bytes(precision="fp32", dtype="float32"):
    """(p, s, master): bytes per element of the compute format, of an optimizer slot and
    of the master copy (0 when the parameters themselves are the master)."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got "
                         f"{precision!r}")
    full = np.dtype(dtype).itemsize
    if precision == "fp32":
        return full, full, 0
    return PRECISION_BYTES[precision], 4, 4


def predict(bucket_sizes, ranks, stage, *, slots, precision="fp32", dtype="float32",
            rank=0):
    """The formula for rank ``rank`` of ``ranks``, at ZeRO ``stage``, for a model whose
    fused buckets hold ``bucket_sizes`` elements each (``fusion.plan``). Under bf16/fp16
    the working copies are held in the 2-byte format between passes
    (``runtime/working_copy.py``) and the optimizer decodes one tensor's (or chunk's)
    float32 gradient at a time into a scratch buffer (communication, not here)."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of 0, 1, 2, 3, got {stage!r}")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks} ranks")
    p, s, master = element_bytes(precision, dtype)
    k = slots * s + master
    psi = int(sum(bucket_sizes))
    shard = sum(even_split(int(n), ranks)[0][rank] for n in bucket_sizes)
    params = p * (shard if stage >= 3 else psi)
    # stage 1 keeps the packed buckets (a full gradient, which lets the reduce-scatter
    # overlap backward) and the reduced chunk beside them
    grads = p * (shard if stage >= 2 else psi + shard if stage == 1 else psi)
    optim = k * (shard if stage >= 1 else psi)
    return Prediction(rank, params, grads, optim, psi, shard)


def bucket_sizes(named_params, bucket_mb, precision="fp32"):
    """Elements per fused bucket, as the data-parallel sync lays them out (2-byte
    buckets under a low precision hold twice the elements)."""
    from mpidl.runtime.fusion import MiB, plan  # noqa: PLC0415

    itemsize = None if precision == "fp32" else PRECISION_BYTES[precision]
    return [sum(p.data.size for _, p in group)
            for group in plan(named_params, int(bucket_mb * MiB), itemsize)]


def paper_formula(psi, ranks, stage, slots, precision="fp32", dtype="float32"):
    """ZeRO's closed form with Ψ/N (fractional), for the README's table and checks."""
    p, s, master = element_bytes(precision, dtype)
    k = slots * s + master
    share = psi / ranks
    return {0: (p + p + k) * psi,
            1: (p + p) * psi + k * share,
            2: p * psi + (p + k) * share,
            3: (p + p + k) * share}[stage]


# -- the ledger: what a running rank holds -------------------------------------------------

#: every category an epoch line reports, in the order arrays are attributed: memory that
#: two categories reach (stage 0's gradients are views of the fused buckets) counts once,
#: in the first
LEDGER = ("mem_params", "mem_grads", "mem_optimizer", "mem_comm")


def _root(a):
    """The array that owns ``a``'s memory (a view's base, followed to the end)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def _address(a):
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)  # CuPy
    if ptr is not None:
        return ("gpu", int(ptr))
    return ("cpu", int(a.__array_interface__["data"][0]))


class Ledger:
    """Bytes held per category, each distinct piece of memory counted once.

    ``add(category, arrays)`` attributes arrays (views count at the size of the memory
    they keep alive, once, in the first category that reaches them); ``extra`` adds bytes
    that are not arrays of this process's Python objects (communication scratch)."""

    def __init__(self):
        self.bytes = dict.fromkeys(LEDGER, 0)
        self._seen = set()

    def add(self, category, arrays):
        if category not in self.bytes:
            raise KeyError(f"unknown ledger category {category!r}: expected one of "
                           f"{', '.join(LEDGER)}")
        for a in arrays:
            # (by type: a ZeRO-3 parameter that is not gathered is a placeholder that
            # refuses every attribute)
            if not (isinstance(a, np.ndarray) or is_gpu_array(a)):
                continue
            root = _root(a)
            key = _address(root) + (int(root.nbytes),)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.bytes[category] += int(root.nbytes)
        return self

    def extra(self, category, nbytes):
        self.bytes[category] += int(nbytes)
        return self

    def as_dict(self):
        return dict(self.bytes)

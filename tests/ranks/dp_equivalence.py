"""N ranks with per-rank batch b train like one process with batch N*b (run under mpiexec).

Every case (allreduce algorithm x overlap on/off x bucket size, plus an Embedding model
with row-sparse gradients) trains a float64 model for STEPS SGD-momentum steps with the
data-parallel strategy, each rank on its slice of the global batch, and compares the
parameters with a one-process reference computed here, on every rank, from the same seed
and data. Checks per case:

* parameters within TOL (absolute, float64; values are O(1)) of the reference;
* parameters bitwise identical on every rank (the all-reduce gives every rank the same
  bits, and every rank applies the same update).

Any failure raises, and ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
Usage: mpiexec -n N python -m mpi4py tests/ranks/dp_equivalence.py [--quick]
"""

import hashlib
import sys
import time

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import (SGD, BatchNorm1d, Embedding, Flatten, Linear, ReLU, Sequential,
                          SoftmaxCrossEntropy, SparseGrad, Tanh)
from mpidl.runtime import build
from mpidl.runtime.sync import FusedAllreduce

STEPS = 6
B = 3              # per-rank batch
TOL = 1e-12        # float64: only summation order differs from the reference
TOL_COMPRESSED = 1e-6  # the exchanger decodes in float32
ALGORITHMS = ("auto", "ring", "tree", "recursive_doubling", "mpi")
# 0.0004 MiB (~420 bytes): about one bucket per tensor (small tensors share one);
# 4 MiB: every gradient in one bucket
BUCKETS_MB = (0.0004, 4.0)


def mlp(seed):
    rng = np.random.default_rng(seed)
    return Sequential(Linear(12, 16, rng=rng, dtype="float64"), ReLU(),
                      Linear(16, 16, rng=rng, dtype="float64"), Tanh(),
                      Linear(16, 5, init="glorot_uniform", rng=rng, dtype="float64"))


def embed(seed):
    rng = np.random.default_rng(seed)
    return Sequential(Embedding(40, 6, rng=rng, dtype="float64"), Flatten(),
                      Linear(4 * 6, 8, rng=rng, dtype="float64"), ReLU(),
                      Linear(8, 5, rng=rng, dtype="float64"))


def data(kind, n_global, seed=7):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        x = rng.standard_normal((STEPS, n_global, 12))
    else:  # few distinct ids, so rows repeat within and across ranks
        x = rng.integers(0, 40, size=(STEPS, n_global, 4))
    y = rng.integers(0, 5, size=(STEPS, n_global))
    return x, y


BUILD = {"mlp": mlp, "embed": embed}


def optimizer(model):
    return SGD(model.named_parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def reference(kind, n, densify=False):
    """One process, batch n*B: the plain forward/backward/step loop (``densify``: the
    Embedding's row-sparse gradient made dense before the step, which is what
    sparse="dense" gives the optimizer: dense momentum instead of lazy)."""
    model = BUILD[kind](seed=3)
    opt, loss = optimizer(model), SoftmaxCrossEntropy()
    x, y = data(kind, n * B)
    for s in range(STEPS):
        opt.zero_grad()
        loss.forward(model.forward(x[s]), y[s])
        model.backward(loss.backward())
        if densify:
            for _, p in model.named_parameters():
                if isinstance(p.grad, SparseGrad):
                    p.grad = p.grad.to_dense()
        opt.step()
    return {k: p.data.copy() for k, p in model.named_parameters()}


def run_case(comm, kind, algorithm, overlap, bucket_mb, sparse="allgather", compression=None):
    n, r = comm.size, comm.rank
    # rank 0's model is the reference's; the others start from other weights, which the
    # strategy's broadcast must overwrite
    model = BUILD[kind](seed=3 if r == 0 else 100 + r)
    opt, loss = optimizer(model), SoftmaxCrossEntropy()
    strategy = build("allreduce", comm, algorithm=algorithm, overlap=overlap,
                     bucket_mb=bucket_mb, sparse_grads=sparse,
                     compression=compression, ratio=1.0 if compression else None)
    strategy.setup(model, opt, loss)
    x, y = data(kind, n * B)
    for s in range(STEPS):
        strategy.train_step(x[s][r * B:(r + 1) * B], y[s][r * B:(r + 1) * B])
    strategy.finish()
    fused = next((s for _, s in strategy.syncs if isinstance(s, FusedAllreduce)), None)
    buckets = len(fused.fusion) if fused is not None else 0
    if overlap and buckets > 1 and not fused.launched_in_backward:
        raise AssertionError(f"rank {r}: overlap on, {buckets} buckets, but no "
                             "bucket was launched during backward (the grad-ready hook)")
    return {k: p.data.copy() for k, p in model.named_parameters()}, buckets


def check_batchnorm_buffers(comm):
    """BatchNorm running statistics differ per rank during training (each sees its own
    shard); before evaluation the strategy averages them, so every rank evaluates the
    same model."""
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(3)
    model = Sequential(Linear(12, 8, rng=rng, dtype="float64"),
                       BatchNorm1d(8, dtype="float64"), ReLU(),
                       Linear(8, 5, rng=rng, dtype="float64"))
    strategy = build("allreduce", comm)
    strategy.setup(model, optimizer(model), SoftmaxCrossEntropy())
    x, y = data("mlp", n * B)
    for s in range(STEPS):
        strategy.train_step(x[s][r * B:(r + 1) * B], y[s][r * B:(r + 1) * B])
    buffers = {k: np.array(v) for k, v in model.named_buffers()}
    mean = {k: sum(comm.mpi.allgather(v)) / n for k, v in buffers.items()}
    strategy.prepare_eval()
    synced = {k: np.array(v) for k, v in model.named_buffers()}
    digests = comm.mpi.allgather(digest(synced))
    if len(set(digests)) != 1:
        raise AssertionError(f"rank {r}: BatchNorm buffers differ across ranks after "
                             "prepare_eval")
    for k in synced:
        np.testing.assert_allclose(synced[k], mean[k], rtol=1e-12, atol=1e-14)
    if r == 0:
        print(f"[N={n}] BatchNorm running statistics averaged over the ranks before "
              "evaluation", flush=True)


def digest(params):
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode())
        h.update(np.ascontiguousarray(params[k]).tobytes())
    return h.hexdigest()


def main():
    quick = "--quick" in sys.argv
    comm = Communicator()
    n, r = comm.size, comm.rank
    refs = {kind: reference(kind, n) for kind in BUILD}
    refs["mlp", "dense"] = refs["mlp"]
    refs["embed", "dense"] = reference("embed", n, densify=True)
    cases = [("mlp", a, o, bmb) for a in ALGORITHMS for o in (True, False)
             for bmb in BUCKETS_MB]
    sparse_algs = ("auto",) if quick else ("ring", "mpi")
    cases += [("embed", a, o, 4.0) for a in sparse_algs for o in (True, False)]
    if quick:
        cases = [c for c in cases if c[1] in ("auto", "ring")]
    # Embedding gradients densified into the buckets instead of allgatherv
    cases += [("embed", "auto", o, 0.0004, "dense") for o in (True, False)]
    # compressed exchange (mpidl.compress) with top-k keeping every entry: the same
    # average, through the exchanger's float32 decode (hence the looser tolerance)
    cases += [(kind, "auto", o, 4.0, "allgather", "topk") for kind in ("mlp", "embed")
              for o in (True, False)]
    t0 = time.perf_counter()
    worst = 0.0
    for kind, alg, overlap, bmb, *sparse in cases:
        params, nbuckets = run_case(comm, kind, alg, overlap, bmb, *sparse)
        # densified Embedding gradients (sparse="dense", and any compression) give the
        # optimizer dense momentum: compare with the densified reference
        densified = bool(sparse) and (sparse[0] == "dense" or bool(sparse[1:]))
        ref = refs[(kind, "dense") if densified else kind]
        tol = TOL_COMPRESSED if sparse[1:] else TOL
        diff = max(float(np.max(np.abs(params[k] - ref[k]))) for k in ref)
        if not sparse[1:]:
            worst = max(worst, diff)
        digests = comm.mpi.allgather(digest(params))
        label = (f"{kind} algorithm={alg} overlap={overlap} bucket_mb={bmb} "
                 f"{'sparse=' + sparse[0] + ' ' if sparse else ''}"
                 f"{'compression=' + sparse[1] + ' ' if sparse[1:] else ''}({nbuckets} buckets)")
        if r == 0:
            print(f"[N={n}] {label}: max |param - reference| = {diff:.2e}", flush=True)
        if len(set(digests)) != 1:
            raise AssertionError(f"rank {r}: {label}: replicas differ across ranks")
        if not diff <= tol:
            raise AssertionError(f"rank {r}: {label}: parameters differ from the one-process "
                                 f"batch-{n * B} reference by {diff:.3e} > {tol}")
    check_batchnorm_buffers(comm)
    comm.close()
    if r == 0:
        print(f"[N={n}] ALL OK: {len(cases)} cases, {STEPS} steps each, worst difference "
              f"{worst:.2e} (tolerance {TOL}), {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

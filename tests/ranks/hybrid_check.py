"""``--hybrid conv-dp-fc-mp`` on N ranks against one process (run under mpiexec).

Checks, float64, on a small cnn (two conv + BatchNorm stages, a 2-layer FC block whose
widths N does not always divide), and on a one-stage net whose only FC layer is split by
classes (sliced logits, the parallel cross-entropy):

* equivalence: STEPS SGD steps (momentum, weight decay) of the hybrid, each rank on its
  piece of the global batch (uneven pieces when N does not divide it; the convolutions'
  gradients overlapped with backward or not; --sync-bn so the
  BatchNorm statistics are the global batch's), against one process at the global batch
  computed here on every rank from the same seed and data: every parameter of the whole
  model (gathered from the slices) within TOL relative (max |a - b| / max |b|), the
  losses too; the FC block's replicated parameters bitwise identical on every rank;
* bytes: with --algorithm ring, the bytes the communicator counts on each rank in one
  step equal ``Hybrid.bytes_per_step`` exactly (even and uneven pieces, and two
  micro-batches per step);
* evaluation: the test set split over the ranks, in lockstep (ranks with fewer batches
  run empty ones): the summed loss and correct count equal one process's.

Any failure raises; ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
Usage: mpiexec -n N python -m mpi4py tests/ranks/hybrid_check.py
"""

import sys

import numpy as np

from mpidl.comm import Communicator
from mpidl.comm.layout import even_split
from mpidl.engine import (SGD, BatchNorm2d, Conv2d, Flatten, Linear, MaxPool2d, ReLU,
                          Sequential, SoftmaxCrossEntropy)
from mpidl.engine.models import cnn
from mpidl.runtime import build
from mpidl.training.tasks import ClassificationTask

STEPS = 20
TOL = 1e-12
SHAPE = (1, 8, 8)


def model(kind="cnn"):
    """``cnn``: two conv stages, Linear-ReLU-Dropout-Linear (a column/row pair, logits
    whole); ``head``: one conv stage and a single Linear, column-parallel over the classes
    (logits sliced, the parallel cross-entropy)."""
    rng = np.random.default_rng(3)
    if kind == "cnn":
        m = cnn(SHAPE, 5, rng, "float64", channels=(3, 4), hidden=10, dropout=0.3)
    else:
        m = Sequential(Conv2d(1, 3, 3, padding=1, bias=False, rng=rng, dtype="float64"),
                       BatchNorm2d(3, dtype="float64"), ReLU(), MaxPool2d(2), Flatten(),
                       Linear(48, 5, rng=rng, dtype="float64"))
    m.needs_input_grad = False
    return m


def optimizer(m):
    return SGD(m.named_parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def data(n_global, steps, seed=7):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps, n_global) + SHAPE),
            rng.integers(0, 5, size=(steps, n_global)))


def reference(n_global, kind="cnn"):
    m = model(kind)
    opt, loss = optimizer(m), SoftmaxCrossEntropy()
    x, y = data(n_global, STEPS)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses.append(loss.forward(m.forward(x[s]), y[s]))
        m.backward(loss.backward())
        opt.step()
    return m, losses


def hybrid(comm, kind="cnn", **options):
    m = model(kind)
    opt = optimizer(m)
    rt = build("allreduce", comm, hybrid="conv-dp-fc-mp", **options)
    rt.setup(m, opt, SoftmaxCrossEntropy())
    return rt, m, opt


def piece(a, counts, rank):
    lo = sum(counts[:rank])
    return a[lo:lo + counts[rank]]


def check_equivalence(comm, n_global, overlap="off", kind="cnn"):
    p, rank = comm.size, comm.rank
    counts, _ = even_split(n_global, p)
    rt, m, opt = hybrid(comm, kind, algorithm="ring", sync_bn=True, overlap=overlap)
    x, y = data(n_global, STEPS)
    ref, ref_losses = reference(n_global, kind)
    fc_replicated = [n for n, q in m.named_parameters()
                     if rt.tp.in_fc(n) and n not in rt.tp.slices]
    assert bool(fc_replicated) == (kind == "cnn"), fc_replicated  # the row layer's bias
    assert (rt.tp.output_slice is not None) == (kind == "head")
    for s in range(STEPS):
        loss = rt.train_step(piece(x[s], counts, rank), piece(y[s], counts, rank))
        assert abs(loss - ref_losses[s]) <= TOL * abs(ref_losses[s]), (s, loss, ref_losses[s])
        for n in fc_replicated:  # computed on the same rows everywhere: the same bits
            q = dict(m.named_parameters())[n].data
            everyone = comm.mpi.allgather(q.tobytes())
            assert len(set(everyone)) == 1, f"step {s}: {n} differs across ranks"
    state, _ = rt.full_state(m)
    if rank == 0:
        want = ref.state_dict()
        assert set(state) == set(want), (sorted(state), sorted(want))
        worst = 0.0
        for k, b in want.items():
            a = state[k]
            assert a.shape == b.shape, (k, a.shape, b.shape)
            if b.dtype.kind == "f" and b.size:
                scale = max(float(np.abs(b).max()), 1e-300)
                worst = max(worst, float(np.abs(a - b).max()) / scale)
            else:
                assert np.array_equal(a, b), k
        assert worst <= TOL, f"batch {n_global} on {p} ranks: relative error {worst:.3g}"
        print(f"equivalence {kind} p={p} global batch {n_global} pieces {counts} overlap "
              f"{overlap}: "
              f"max relative {worst:.2e} over {STEPS} steps", flush=True)
    return rt, m


def check_bytes(comm, n_global, accumulate=1, kind="cnn"):
    """Counted bytes of one step == the formula, on every rank."""
    p, rank = comm.size, comm.rank
    rt, m, _ = hybrid(comm, kind, algorithm="ring", accumulate=accumulate)
    counts, _ = even_split(n_global, p)
    if accumulate > 1:  # every rank's piece splits into equal micro-batches
        counts = [accumulate * (1 + (r % 2)) for r in range(p)]
    x, y = data(sum(counts), 2)
    rt.train_step(piece(x[0], counts, rank), piece(y[0], counts, rank))  # warm
    rt.group.reset_counters()
    rt.train_step(piece(x[1], counts, rank), piece(y[1], counts, rank))
    counted = rt.group.counters()["total"]["bytes"]
    rows = [c // accumulate for c in counts]
    formula = rt.tp.bytes_per_step(rows, rank)
    assert counted == formula["total"], (f"rank {rank} of {p}, pieces {counts}, "
                                         f"accumulate {accumulate}: counted {counted} != "
                                         f"formula {formula}")
    assert rt.metrics()["bytes_sent_per_step"] == counted
    totals = comm.mpi.gather(counted, root=0)
    if rank == 0:
        print(f"bytes {kind} p={p} pieces {counts} accumulate {accumulate}: counted == formula "
              f"per rank {totals}; data parallel {rt.tp.dp_bytes_per_step(0)} on rank 0",
              flush=True)


def check_eval(comm, rt, m, ref, n_test=11, batch=3):
    rng = np.random.default_rng(11)
    tx, ty = rng.standard_normal((n_test,) + SHAPE), rng.integers(0, 5, size=n_test)
    task = rt.adapt_task(ClassificationTask())
    m.eval()
    sums = {}
    for x, y in rt.eval_batches(tx, ty, batch, dtype="float64"):
        for k, v in task.eval_sums(m, x, y).items():
            sums[k] = sums.get(k, 0) + v
    m.train()
    total = rt.reduce(sums, "sum")
    ref.eval()
    logits = ref.forward(tx)
    want_loss = SoftmaxCrossEntropy().forward(logits, ty) * n_test
    want_correct = int((logits.argmax(axis=1) == ty).sum())
    assert total["n"] == n_test and total["correct"] == want_correct, (total, want_correct)
    assert abs(total["loss_sum"] - want_loss) <= 1e-9 * abs(want_loss), (total, want_loss)
    if comm.rank == 0:
        print(f"eval p={comm.size}: {n_test} samples in batches of {batch}, correct "
              f"{want_correct}, loss matches", flush=True)


def main():
    comm = Communicator()
    p = comm.size
    n_global = 3 * p + 1  # uneven pieces
    rt, m = check_equivalence(comm, n_global)
    ref, _ = reference(n_global)
    check_eval(comm, rt, m, ref)
    check_equivalence(comm, 4 * p, overlap="on")  # even pieces, overlapped conv sync
    check_bytes(comm, 4 * p)
    check_bytes(comm, 3 * p + 1)
    check_bytes(comm, 0, accumulate=2)
    rt, m = check_equivalence(comm, n_global, kind="head")  # logits sliced by class
    check_eval(comm, rt, m, reference(n_global, "head")[0])
    check_bytes(comm, n_global, kind="head")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ZeRO stage 3 of a lazily built model: never whole on a rank, in training or evaluation.

``mpiexec -n N python -m mpi4py tests/ranks/zero3_lazy.py``

An MLP of 784-1024x8-10 in float64 (65 MB of parameters, small layers: buckets of one
tensor each) built lazily under ``--zero 3`` over the N ranks, trained two steps, then
evaluated on a test set that does not split evenly (so some ranks run an empty batch to
keep in step with the others: evaluation gathers layer by layer, a collective forward).
Checks, on every rank:

* the evaluation's extra memory (tracemalloc, above what the rank held before it) is a
  few buckets, never the whole model (what pinning every bucket for it took before);
* its outputs and the parameters are bitwise those of stage 0 on an eagerly built model;
* its gathers are not counted as a training pass's.

Prints one line per rank; any failure raises (``python -m mpi4py`` aborts every rank).
"""

import tracemalloc

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SGD, SoftmaxCrossEntropy
from mpidl.engine.models import build_model
from mpidl.runtime import build

HIDDEN = (1024,) * 8
TEST = 7  # samples: pieces of 3, 2, 2 on 3 ranks, 2 to a batch


def setup(comm, stage, lazy):
    model = build_model("mlp", (1, 28, 28), 10, seed=5, dtype="float64", hidden=HIDDEN,
                        lazy=lazy)
    opt = SGD(model.named_parameters(), lr=0.05, momentum=0.9, fused=False)
    options = {"zero": 3} if stage == 3 else {}
    rt = build("allreduce", comm, algorithm="ring", **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    return model, rt


def evaluate(model, rt, x, y):
    """Every batch's logits (this rank's), as the trainer's evaluation runs them."""
    rt.prepare_eval()
    model.eval()
    out = [np.asarray(model(bx)).copy() for bx, _ in rt.eval_batches(x, y, 2, "float64")]
    model.train()
    return out


def main():
    comm = Communicator()
    rng = np.random.default_rng(3)
    r, n = comm.rank, comm.size
    train = [(rng.standard_normal((4 * n, 1, 28, 28)), rng.integers(0, 10, 4 * n))
             for _ in range(2)]
    xt, yt = rng.standard_normal((TEST, 1, 28, 28)), rng.integers(0, 10, TEST)

    results = {}
    for stage, lazy in ((0, False), (3, True)):
        model, rt = setup(comm, stage, lazy)
        for x, y in train:
            rt.train_step(x[4 * r:4 * (r + 1)], y[4 * r:4 * (r + 1)])
        if stage == 3:
            sync = rt.syncs[0][1]
            gathers_before = sync.gathers.gathers
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
        logits = evaluate(model, rt, xt, yt)
        if stage == 3:
            extra = tracemalloc.get_traced_memory()[1] - before
            tracemalloc.stop()
            assert sync.gathers.gathers == gathers_before, "evaluation counted as training"
            largest = max(sh.bucket.buffer.nbytes for sh in sync.shards)
            whole = sum(sh.bucket.buffer.nbytes for sh in sync.shards)
            assert extra <= 4 * largest + (1 << 20) and extra < whole / 2, (
                f"rank {r}: evaluation took {extra / 1e6:.1f} MB more; the largest bucket "
                f"is {largest / 1e6:.1f} MB, the model {whole / 1e6:.1f} MB")
            state, _ = rt.full_state(model)  # (collective) gathered, to compare
        else:
            state = dict(model.state_dict())
        results[stage] = (logits, state)
        rt.finish()
    (l0, s0), (l3, s3) = results[0], results[3]
    empty = [b for b in l3 if len(b) == 0]  # (run to keep in step with the other ranks)
    l3 = [b for b in l3 if len(b)]
    assert len(l0) == len(l3) and all(np.array_equal(a, b) for a, b in zip(l0, l3)), \
        f"rank {r}: evaluation differs from stage 0's"
    assert len(empty) == (1 if r > 0 and n == 3 else 0), (r, len(empty))
    if s3 is not None:
        assert all(np.array_equal(s0[k], s3[k]) for k in s0), "parameters differ"
    print(f"zero3_lazy rank {r}/{n}: {len(l3)} evaluation batch(es) "
          f"({sum(len(b) for b in l3)} samples; {len(empty)} empty one to keep in step), "
          f"bitwise stage 0's; evaluation took "
          f"{extra / 1e6:.1f} MB more (largest bucket {largest / 1e6:.1f} MB, model "
          f"{whole / 1e6:.1f} MB)", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

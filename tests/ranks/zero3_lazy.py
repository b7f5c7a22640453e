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
* its gathers are not counted as a training pass's;
* ``--save``'s stream writes the whole model on the root a bucket at a time (a few
  buckets' worth held), bitwise what ``Runtime.full_state`` gathers.

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


def save_stream(comm, rt, model, largest, whole):
    """``--save``'s stream (``Runtime.whole_tensors``) written on the root: a bucket at a
    time, so it holds a few buckets' worth while writing (the arrays written, read back)."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from mpidl.training import checkpoint as ckpt  # noqa: PLC0415

    tensors = rt.whole_tensors(model)
    if not rt.is_root:
        for _ in tensors:
            pass
        return None
    path = os.path.join(tempfile.mkdtemp(), "model.npz")
    tracemalloc.start()
    ckpt.save_model(path, tensors)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= 3 * largest + (1 << 20) and peak < whole / 2, (
        f"--save peaked at {peak / 1e6:.1f} MB on the root (largest bucket "
        f"{largest / 1e6:.1f} MB, model {whole / 1e6:.1f} MB)")
    print(f"zero3_lazy: --save wrote the {whole / 1e6:.1f} MB model, the root's peak "
          f"{peak / 1e6:.1f} MB", flush=True)
    arrays, _ = ckpt.load_model_arrays(path)
    return arrays


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
            saved = save_stream(comm, rt, model, largest, whole)
            state, _ = rt.full_state(model)  # (collective) gathered, to compare
            if rt.is_root:
                assert set(saved) == set(state) and all(
                    np.array_equal(saved[k], state[k]) for k in state), "--save differs"
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

"""A split model resumes, and is saved, without the whole model on any rank (mpiexec).

``mpiexec -n N python -m mpi4py tests/ranks/split_resume.py tp|pp|tp-pp OUT``

An MLP of 784-1024x6-10 in float64 (48 MB of parameters, as much again of SGD momentum) built lazily under ``--tensor-parallel N`` (or ``--pipeline-stages N``, or 2 stages of
``--tensor-parallel N/2``), one
step, then a checkpoint written as the trainer writes it (a shard per rank, its slices or
its stage's tensors, and the root's index). A second model, built and
set up the same way, resumes from it as ``Trainer.restore`` does: the root reads the
checkpoint with its tensors left on disk (``checkpoint.load(path, read=False)``) and
broadcasts that, each rank reads its part. Checks, on every rank:

* writing the checkpoint allocates next to nothing (each rank writes its own tensors,
  no rank gathers another's);
* what the broadcast carries is small (no tensor travels);
* the resumed parameters and momentum are bitwise the first model's;
* the peak of NumPy's allocations while loading (tracemalloc) is the momentum the
  optimizer takes (new arrays) plus two of the rank's tensors, below the whole model;
* ``--save``'s stream (``Runtime.whole_tensors``) writes the whole model on the root
  (bitwise what ``Runtime.full_state`` gathers),
  which holds no more than three of its tensors' worth at a time while writing it (a
  sliced one's pieces as they arrive, and the joined tensor), under half the model.

Prints one line per rank; any failure raises (``python -m mpi4py`` aborts every rank).
"""

import os
import pickle
import sys
import tracemalloc

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SGD, SoftmaxCrossEntropy
from mpidl.engine.models import build_model
from mpidl.runtime import build
from mpidl.training import checkpoint as ckpt

HIDDEN = (1024,) * 6  # many tensors, none large: --save's bound is per tensor
STEP = 1


def setup(comm, mode):
    model = build_model("mlp", (1, 28, 28), 10, seed=5, dtype="float64", hidden=HIDDEN,
                        lazy=True)
    opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9, fused=False)
    options = ({"tensor_parallel": comm.size} if mode == "tp" else
               {"pipeline_stages": comm.size, "stage_costs": "layers"} if mode == "pp" else
               {"pipeline_stages": 2, "tensor_parallel": comm.size // 2,
                "stage_costs": "layers"})  # tp-pp: 2 stages of T ranks
    rt = build("allreduce", comm, **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    return model, opt, rt


def write_checkpoint(rt, model, opt, directory):
    """As ``Trainer.save_checkpoint``: the shards, then the root's file."""
    parts = rt.checkpoint_parts(model, opt)
    if parts.shard is not None:
        ckpt.save_shard(directory, STEP, parts.index, parts.count, parts.shard)
        rt.shards_written(parts)
    if rt.is_root:
        state = {"config": {}, "progress": {"step": STEP}, "ranks": [],
                 "model": parts.model, "optimizer": parts.optimizer}
        if parts.shards is not None:
            state["shards"] = dict(parts.shards, files=[
                ckpt.shard_name(STEP, i, parts.count) for i in range(parts.count)])
        ckpt.save(directory, STEP, state)


def main():
    mode, directory = sys.argv[1], sys.argv[2]
    comm = Communicator()
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 1, 28, 28)), rng.integers(0, 10, 8)

    model, opt, rt = setup(comm, mode)
    rt.train_step(x, y)  # (every rank the same batch: the data-parallel degree is 1)
    tracemalloc.start()
    write_checkpoint(rt, model, opt, directory)
    written = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    comm.barrier()

    model2, opt2, rt2 = setup(comm, mode)
    state = None
    if rt2.is_root:
        state = ckpt.load(ckpt.checkpoint_path(directory, STEP), read=False)
    state = comm.mpi.bcast(state, root=0)
    carried = len(pickle.dumps(state))
    tracemalloc.start()
    rt2.load_full_state(model2, opt2, state["model"], state["optimizer"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    params = dict(model.named_parameters())
    mine = 0
    for name, p in model2.named_parameters():
        assert np.array_equal(p.data, params[name].data), f"rank {comm.rank}: {name} differs"
        assert np.array_equal(opt2.state[name]["momentum"], opt.state[name]["momentum"]), name
        mine += p.data.nbytes
    largest = max(p.data.nbytes for _, p in model2.named_parameters())
    whole = sum(p.nbytes for p in state["model"].values())
    assert carried < 100_000, f"the broadcast state takes {carried} bytes"
    assert peak <= mine + 2 * largest + (1 << 20), (
        f"rank {comm.rank}: loading peaked at {peak / 1e6:.1f} MB; it keeps {mine / 1e6:.1f} "
        f"MB of parameters, its largest tensor is {largest / 1e6:.1f} MB")
    assert peak < whole, (peak, whole)
    # writing: a shard of the rank's own tensors, views of them (no gather to the root)
    assert written < (1 << 20), f"rank {comm.rank}: writing allocated {written} bytes"
    print(f"split_resume {mode} rank {comm.rank}/{comm.size}: wrote its shard allocating "
          f"{written / 1e6:.2f} MB; read {mine / 1e6:.1f} MB of "
          f"parameters (and as much momentum) of the {whole / 1e6:.1f} MB model, peak while "
          f"loading {peak / 1e6:.1f} MB; the broadcast state took {carried} bytes", flush=True)

    # --save: the whole model written on the root as its tensors come
    saved = os.path.join(directory, "model.npz")
    tensors = rt2.whole_tensors(model2)
    if rt2.is_root:
        tracemalloc.start()
        ckpt.save_model(saved, tensors, {"model": "mlp"})
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        arrays, meta = ckpt.load_model_arrays(saved)
        assert meta == {"model": "mlp"}
        largest_whole = max(a.nbytes for a in arrays.values())
        assert peak <= 3 * largest_whole + (1 << 20) and peak < whole / 2, (
            f"--save peaked at {peak / 1e6:.1f} MB on the root; the largest tensor is "
            f"{largest_whole / 1e6:.1f} MB, the model {whole / 1e6:.1f} MB")
        print(f"split_resume {mode}: --save wrote the {whole / 1e6:.1f} MB model from "
              f"{comm.size} ranks, the root's peak while writing {peak / 1e6:.1f} MB",
              flush=True)
    else:
        for _ in tensors:
            pass
    whole_state, _ = rt2.full_state(model2)  # (collective) the gathered whole, to compare
    if rt2.is_root:
        assert set(arrays) == set(whole_state), (sorted(arrays), sorted(whole_state))
        for k, a in whole_state.items():
            assert np.array_equal(arrays[k], a) and arrays[k].dtype == a.dtype, k
    comm.close()


if __name__ == "__main__":
    main()

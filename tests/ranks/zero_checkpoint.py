"""ZeRO's sharded checkpoints: written and resumed without the whole model or optimizer
state on any rank (mpiexec).

``mpiexec -n N python -m mpi4py tests/ranks/zero_checkpoint.py write DIR``
``mpiexec -n M python -m mpi4py tests/ranks/zero_checkpoint.py resume DIR STAGE``

An MLP of 784-1024x6-10 in float64 (48 MB of parameters, as much again of SGD momentum),
built lazily. ``write``: at ``--zero 3`` on N ranks, one step, then a checkpoint as
``Trainer.save_checkpoint`` writes it: every rank its shard (the elements of its chunks),
the root the index; and the whole model through ``--save``'s stream (``model.npz``).
Checks: writing allocates next to nothing (the pieces are views of the chunks); each
shard holds 1/N of the parameters and momentum; the index holds none of them.

``resume``: at ``--zero STAGE`` on M ranks (any M), resumed as ``Trainer.restore`` does:
the root reads the checkpoint with its tensors left on disk and broadcasts that, each rank
reads the elements of its own chunks. Checks: the broadcast is small; at stage 3 the
loading peak is about the momentum chunk the rank takes (never the whole model); the
parameters are bitwise ``model.npz``; a checkpoint written again here (M shards) joins
into bitwise the first one's parameters and momentum (``checkpoint.load``, whole).

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

HIDDEN = (1024,) * 6
STEP = 1


def setup(comm, stage):
    model = build_model("mlp", (1, 28, 28), 10, seed=5, dtype="float64", hidden=HIDDEN,
                        lazy=True)
    opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9, fused=False)
    rt = build("allreduce", comm, zero=stage, bucket_mb=4)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    return model, opt, rt


def write_checkpoint(rt, model, opt, directory):
    """As ``Trainer.save_checkpoint``: the shards, then the root's index."""
    assert rt.shards_checkpoints
    runtime_state, _ = rt.checkpoint_state(STEP)  # (collective: the syncs' state)
    parts = rt.checkpoint_parts(model, opt)
    assert rt.parameters_finite(model, parts)
    ckpt.save_shard(directory, STEP, parts.index, parts.count, parts.shard)
    rt.shards_written(parts)
    if rt.is_root:
        state = {"config": {}, "progress": {"step": STEP}, "ranks": [],
                 "model": parts.model, "optimizer": parts.optimizer,
                 "runtime": runtime_state}
        state["shards"] = dict(parts.shards, files=[
            ckpt.shard_name(STEP, i, parts.count) for i in range(parts.count)])
        ckpt.save(directory, STEP, state)


def chunk_bytes(rt):
    placement = rt.placement
    mine = sum(sh.param.data.nbytes for sh in placement.shards.values())
    whole = sum(sh.bucket.buffer.nbytes for sh in placement.shards.values())
    return mine, whole


def write(comm, directory):
    model, opt, rt = setup(comm, 3)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 1, 28, 28)), rng.integers(0, 10, 8)
    rt.train_step(x, y)
    mine, whole = chunk_bytes(rt)
    tracemalloc.start()
    write_checkpoint(rt, model, opt, directory)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (1 << 20), f"rank {comm.rank}: writing its shard allocated {peak} bytes"
    shard = os.path.join(directory, ckpt.shard_name(STEP, comm.rank, comm.size))
    size = os.path.getsize(shard)
    # its chunks of the parameters and of the momentum, and the members' headers
    assert 2 * mine <= size <= 2 * mine + 200_000, (size, mine)
    tensors = rt.whole_tensors(model)  # --save's stream (a bucket at a time)
    if rt.is_root:
        ckpt.save_model(os.path.join(directory, "model.npz"), tensors)
        index = os.path.getsize(ckpt.checkpoint_path(directory, STEP))
        assert index < 100_000, f"the index takes {index} bytes"
    else:
        for _ in tensors:
            pass
    print(f"zero_checkpoint write rank {comm.rank}/{comm.size}: its shard {size / 1e6:.1f} MB "
          f"of the {2 * whole / 1e6:.1f} MB of parameters and momentum, {peak} bytes "
          "allocated while writing it", flush=True)


def resume(comm, directory, stage):
    model, opt, rt = setup(comm, stage)
    state = None
    if rt.is_root:
        state = ckpt.load(ckpt.checkpoint_path(directory, STEP), read=False)
    state = comm.mpi.bcast(state, root=0)
    carried = len(pickle.dumps(state))
    assert carried < 100_000, f"the broadcast state takes {carried} bytes"
    tracemalloc.start()
    rt.load_full_state(model, opt, state["model"], state["optimizer"])
    rt.load_state_dict(state["runtime"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mine, whole = chunk_bytes(rt)
    largest = max(int(np.prod(v.shape)) * 8 for v in state["model"].values())
    if stage == 3:  # the momentum chunks (new arrays), a piece of a tensor at a time
        assert peak <= mine + largest + (1 << 20) and peak < whole, (
            f"rank {comm.rank}: loading peaked at {peak / 1e6:.1f} MB; its chunks are "
            f"{mine / 1e6:.1f} MB, the model {whole / 1e6:.1f} MB")
    saved, _ = ckpt.load_model_arrays(os.path.join(directory, "model.npz"))
    again = os.path.join(directory, f"again-{comm.size}-{stage}")
    write_checkpoint(rt, model, opt, again)
    tensors = rt.whole_tensors(model)
    for name, a in tensors:
        if rt.is_root:
            assert np.array_equal(a, saved[name]), f"{name} differs after the resume"
    if rt.is_root:
        first = ckpt.load(ckpt.checkpoint_path(directory, STEP))
        second = ckpt.load(ckpt.checkpoint_path(again, STEP))
        for name, a in first["model"].items():
            assert np.array_equal(second["model"][name], a), name
        for name, st in first["optimizer"]["state"].items():
            st2 = second["optimizer"]["state"][name]
            assert st2["step"] == st["step"], name
            assert np.array_equal(st2["momentum"], st["momentum"]), name
        assert len(first["optimizer"]["state"]) == 2 * (len(HIDDEN) + 1)
    print(f"zero_checkpoint resume rank {comm.rank}/{comm.size} at --zero {stage}: "
          f"bitwise; peak while loading {peak / 1e6:.1f} MB (its chunks "
          f"{mine / 1e6:.1f} MB of {whole / 1e6:.1f} MB); the broadcast state took "
          f"{carried} bytes", flush=True)


def main():
    comm = Communicator()
    if sys.argv[1] == "write":
        write(comm, sys.argv[2])
    else:
        resume(comm, sys.argv[2], int(sys.argv[3]))
    comm.close()


if __name__ == "__main__":
    main()

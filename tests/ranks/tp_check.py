"""Tensor parallelism (x data parallelism) trains like one process (run under mpiexec).

``mpiexec -n N python -m mpi4py tests/ranks/tp_check.py MODEL T STEPS OPTIMIZER [DROPOUT]``

Builds ``MODEL`` (a small zoo model, float64) from one seed on every rank, lazily (each
rank draws only its slices, ``mpidl.engine.lazy``), and trains it STEPS steps with ``--tensor-parallel T`` on N ranks (data parallelism over
N / T, each data-parallel rank its piece of the global batch), beside a one-process
reference trained here on the whole global batch. Checks:

* after every step, every replicated parameter (row-parallel biases, BatchNorm, the
  convolutions) holds the same bits on every rank of the tensor-parallel group, and the
  step's loss is the same bits on every rank of the group;
* at the end, the whole model gathered from the slices equals the reference within TOL
  (relative to each tensor's largest value), and so does the optimizer's state;
* BatchNorm statistics are synchronized over the data-parallel group (``sync_bn``), and
  dropout is only tested with one data-parallel rank: a data-parallel rank draws the mask
  of its own piece, which is not the slice of one process's mask;
* the layout really is split: some parameters are sliced, and their slices differ.

Any failure raises; ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
"""

import sys

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.engine import SGD, Adam
from mpidl.engine.losses import TokenCrossEntropy
from mpidl.engine.models import build_model
from mpidl.runtime import build

TOL = 1e-12
B = 6  # per data-parallel rank
SHAPES = {"mlp": (1, 8, 8), "cnn": (1, 8, 8), "gpt-tiny": (7,), "gpt-tied": (7,)}
OPTIONS = {"mlp": dict(hidden=(40, 31)), "cnn": dict(channels=(4, 6), hidden=21),
           "gpt-tiny": dict(layers=2, heads=4, width=24, context=8),  # 4 heads of 6
           "gpt-tied": dict(layers=1, heads=4, width=16, context=8, tie_weights=True)}
CLASSES = {"gpt-tiny": 11, "gpt-tied": 13}  # a vocabulary T does not divide


def batch(name, rng, shape):
    """Inputs and labels: images and classes, or token ids and next-token ids."""
    k = CLASSES.get(name, 10)
    if name.startswith("gpt"):
        return rng.integers(0, k, shape), rng.integers(0, k, shape)
    return rng.standard_normal(shape), rng.integers(0, k, shape[:2])


def make(name, optimizer, dropout, lazy=False):
    """The model and its optimizer; ``lazy``: built lazily, as ``mpidl train`` builds a
    split model (each rank draws only its slices)."""
    opts = dict(OPTIONS[name], dropout=dropout)
    model = build_model("gpt-tiny" if name.startswith("gpt") else name,
                        input_shape=SHAPES[name], num_classes=CLASSES.get(name, 10), seed=3,
                        dtype="float64", lazy=lazy, **opts)
    named = model.named_parameters()
    # NumPy updates (fused=False): the models are tiny, and loading Numba would cost each of
    # up to 8 ranks a second; the fused kernels are bitwise these (tests/test_optim.py)
    opt = (SGD(named, lr=0.05, momentum=0.9, weight_decay=1e-4, fused=False)
           if optimizer == "sgd" else Adam(named, lr=1e-3, fused=False))
    return model, opt


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-300))


def main():
    name, t, steps, optimizer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dropout = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    comm = Communicator(MPI.COMM_WORLD)
    dp = comm.size // t
    rng = np.random.default_rng(11)
    x, y = batch(name, rng, (steps, B * dp) + SHAPES[name])

    ref, ref_opt = make(name, optimizer, dropout)
    ref_rt = build("local")
    ref_rt.setup(ref, ref_opt, TokenCrossEntropy())
    model, opt = make(name, optimizer, dropout, lazy=True)
    # BatchNorm over the global batch, as one process computes it
    rt = build("allreduce", comm, tensor_parallel=t, sync_bn=True)
    rt.setup(model, opt, TokenCrossEntropy())
    index, count = rt.shard()
    assert count == dp, (count, dp)
    tp = rt.tp_group
    sliced = [n for n, p in model.named_parameters() if p.placement.kind == "sharded"]
    assert sliced, "nothing was split"
    for s in range(steps):
        ref_rt.train_step(x[s], y[s])
        piece = slice(index * B, (index + 1) * B)
        loss = rt.train_step(x[s, piece], y[s, piece])
        losses = tp.mpi.allgather(loss)
        assert len(set(losses)) == 1, f"step {s}: losses differ in the tp group {losses}"
        for n, p in model.named_parameters():
            if p.placement.kind != "sharded":
                bits = tp.mpi.allgather(p.data.tobytes())
                assert len(set(bits)) == 1, (f"step {s}: replicated parameter {n!r} differs "
                                             f"across the tensor-parallel group")
    first = sliced[0]
    pieces = tp.mpi.allgather(dict(model.named_parameters())[first].data.tobytes())
    assert len(set(pieces)) == t, f"{first!r}: the ranks hold the same slice"
    state, opt_state = rt.full_state(model, opt)
    if rt.is_root:
        worst = 0.0
        ref_state = ref.state_dict()
        assert set(state) == set(ref_state), (sorted(state), sorted(ref_state))
        for k, a in ref_state.items():
            assert state[k].shape == a.shape, (k, state[k].shape, a.shape)
            if a.dtype.kind == "f" and a.size:
                worst = max(worst, rel(a, state[k]))
            else:
                assert np.array_equal(a, state[k]), k
        assert worst <= TOL, f"parameters differ from one process: {worst:.3g} > {TOL}"
        ref_opt_state = ref_opt.state_dict()["state"]
        for k, st in ref_opt_state.items():
            for slot, v in st.items():
                if hasattr(v, "shape"):
                    r = rel(v, opt_state["state"][k][slot])
                    assert r <= 1e-9 or np.max(np.abs(v)) < 1e-300, (k, slot, r)
        print(f"tp_check {name} T={t} dp={dp} {optimizer} dropout={dropout}: {steps} steps, "
              f"worst relative difference {worst:.3g}, {len(sliced)} sliced tensors",
              flush=True)
    comm.close()


if __name__ == "__main__":
    main()

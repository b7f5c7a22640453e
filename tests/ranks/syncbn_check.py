"""SyncBatchNorm on N ranks equals BatchNorm on one process with the concatenated batch.

Every rank builds the same global batch (seeded), takes its slice, and runs a BatchNorm
whose ``sync_group`` is the world; the one-process reference runs on the whole batch,
here, on every rank. Float64, two training steps (so the running statistics move twice)
and an eval step. Cases: BatchNorm1d on (b, C) and (b, C, L), BatchNorm2d on (b, C, H, W)
and on the NHWC memory the conv layers produce; equal per-rank batches with the per-rank
loss the mean over the rank's own samples (as data parallelism trains), and unequal
per-rank batches with a summed loss.

Checked against the reference to TOL: outputs (each rank's slice), input gradients (each
rank's slice), weight and bias gradients (summed over ranks), running mean and variance
(every rank bitwise the same too); and the number of all-reduces: two per training
forward, one per training backward, none in eval mode.

Any failure raises, and ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
Usage: mpiexec -n N python -m mpi4py tests/ranks/syncbn_check.py
"""

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.engine import BatchNorm1d, BatchNorm2d

TOL = 1e-10


class Counting:
    """The communicator, counting its all-reduces."""

    def __init__(self, comm):
        self.comm, self.size, self.calls = comm, comm.size, 0

    def allreduce(self, x, out=None, op="sum"):
        self.calls += 1
        return self.comm.allreduce(x, out=out, op=op)


def close(what, got, want, rank):
    err = np.max(np.abs(got - want)) if np.size(want) else 0.0
    bound = TOL * max(1.0, float(np.max(np.abs(want))) if np.size(want) else 1.0)
    if not err <= bound:
        raise AssertionError(f"rank {rank}: {what} differs from one process by {err:.3g} "
                             f"(bound {bound:.3g})")


def make(cls, c, group=None):
    rng = np.random.default_rng(3)
    bn = cls(c, dtype="float64", momentum=0.3, sync_group=group)
    bn.weight.data[...] = rng.standard_normal(c) + 1
    bn.bias.data[...] = rng.standard_normal(c)
    return bn


def run_case(comm, group, cls, sample_shape, sizes, mean_loss, nhwc):
    rank, n = comm.rank, comm.size
    c = sample_shape[0]
    total = sum(sizes)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    ref = make(cls, c)
    bn = make(cls, c, group)
    for step in range(3):
        rng = np.random.default_rng(100 + step)
        x = rng.standard_normal((total,) + sample_shape) * 3 + 2
        if nhwc:  # channels-last memory, as Conv2d's outputs are laid out
            x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        r = rng.standard_normal(x.shape)
        train = step < 2
        ref.train(train)
        bn.train(train)
        ref.zero_grad()
        bn.zero_grad()
        before = group.calls
        # one process: loss = mean over all samples (or the sum) of sum(y * r)
        y_ref = ref(x)
        dx_ref = ref.backprop(r / total if mean_loss else r.copy())
        y = bn(x[mine])
        forward_calls = group.calls - before
        dx = bn.backprop(r[mine] / sizes[rank] if mean_loss else r[mine].copy())
        calls = group.calls - before
        want_calls = (2, 3) if train else (0, 0)
        if (forward_calls, calls) != want_calls:
            raise AssertionError(f"rank {rank}: {forward_calls} all-reduce(s) in forward and "
                                 f"{calls} in all, expected {want_calls} (train={train})")
        # with the per-rank mean loss, the ranks' losses sum to n times one process's loss
        scale = n if mean_loss else 1
        what = f"{bn!r} on {sample_shape} step {step}"
        close(f"{what}: output", y, y_ref[mine], rank)
        close(f"{what}: input gradient", dx / scale, dx_ref[mine], rank)
        for name in ("weight", "bias"):
            g = getattr(bn, name).grad.copy()
            comm.mpi.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            close(f"{what}: {name} gradient summed over ranks", g / scale,
                  getattr(ref, name).grad, rank)
        for name in ("running_mean", "running_var"):
            mine_stat = bn.state_dict()[name]
            close(f"{what}: {name}", mine_stat, ref.state_dict()[name], rank)
            first = comm.mpi.bcast(mine_stat, root=0)
            if not np.array_equal(first, mine_stat):
                raise AssertionError(f"rank {rank}: {what}: {name} not bitwise rank 0's")
        if bn.activation_nbytes():
            raise AssertionError(f"rank {rank}: {what}: activations left after backward")


def main():
    comm = Communicator()
    group = Counting(comm)
    n = comm.size
    b = 3
    cases = 0
    for cls, sample_shape, nhwc in ((BatchNorm1d, (4,), False), (BatchNorm1d, (4, 5), False),
                                    (BatchNorm2d, (3, 4, 2), False),
                                    (BatchNorm2d, (3, 4, 2), True)):
        run_case(comm, group, cls, sample_shape, [b] * n, mean_loss=True, nhwc=nhwc)
        run_case(comm, group, cls, sample_shape, [1 + k for k in range(n)], mean_loss=False,
                 nhwc=nhwc)
        cases += 2
    comm.mpi.Barrier()
    if comm.rank == 0:
        print(f"syncbn ok: {n} ranks, {cases} cases")


if __name__ == "__main__":
    main()

"""A training loop of one's own under ``mpidl.training.elastic.run`` (tests/test_elastic.py).

    mpiexec --with-ft ulfm -n N python -m mpi4py elastic_loop.py STEPS KILL_RANK KILL_STEP OUT

Linear least squares on fixed data, data parallel: every step each rank takes its share
of the same global batch (by ``state.comm``'s rank and size, which change after a death),
the gradients are summed with the Communicator's all-reduce, and SGD with momentum
steps; ``state.commit()`` every step. World rank KILL_RANK kills itself (SIGKILL) at the
start of step KILL_STEP, after the commit. Rank 0 of the survivors writes OUT (.npz): the
final weights, the steps taken and what ``state.failures`` says. Whatever the ranks, the
update is the mean gradient over the global batch, so the result must equal one process
doing the same steps (within rounding).
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from mpidl import env
from mpidl.comm import ft
from mpidl.engine import SGD, Linear, MSELoss
from mpidl.training.elastic import State, run

GLOBAL, FEATURES = 24, 5


def data(step):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((GLOBAL, FEATURES))
    return x, x @ np.arange(1.0, FEATURES + 1) + 0.1 * rng.standard_normal(GLOBAL)


def loop(state, steps, kill_rank, kill_step):
    comm = state.comm
    while state.step < steps:
        state.commit()
        if state.step == kill_step and MPI.COMM_WORLD.Get_rank() == kill_rank:
            env.kill_now()
        x, y = data(state.step)
        lo, hi = (comm.rank * GLOBAL) // comm.size, ((comm.rank + 1) * GLOBAL) // comm.size
        model, loss = state.model, state.loss
        model.zero_grad()
        out = model(x[lo:hi])
        loss.forward(out, y[lo:hi, None])
        dy = loss.backward() * ((hi - lo) / GLOBAL)  # this piece's share of the mean
        model.backprop(dy)
        for _, p in model.named_parameters():
            comm.allreduce(p.grad, out=p.grad, op="sum", algorithm="ring")
        state.optimizer.step()
        state.step += 1
    return comm


def main(steps, kill_rank, kill_step, out):
    model = Linear(FEATURES, 1, rng=np.random.default_rng(0), dtype="float64")
    optimizer = SGD(model.named_parameters(), lr=0.05, momentum=0.9, fused=False)
    state = State(model, optimizer, step=0, loss=MSELoss())
    comm = run(lambda s: loop(s, steps, kill_rank, kill_step), state)
    if comm.rank == 0:
        params = dict(model.named_parameters())
        np.savez(out, weight=params["weight"].data, bias=params["bias"].data,
                 meta=json.dumps({"steps": state.step, "size": comm.size,
                                  "failures": state.failures}))
    if ft.survived():
        ft.exit_survivor(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

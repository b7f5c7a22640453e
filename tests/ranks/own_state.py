"""Every rank's own state stays on its rank when a checkpoint is made (mpiexec).

``mpiexec -n N python -m mpi4py tests/ranks/own_state.py dgc|local-sgd``

An MLP of 784-1024x6-10 in float64 (48.5 MB), one step with DGC (error feedback: each
rank its residuals) or local SGD (each rank its own parameters and momentum). The peak
of each rank's allocations (tracemalloc) while the runtime's part of a checkpoint is
made: ``Runtime.state_dict`` (the Python API's, which gathers every rank's state on the
root: the anchor, in the same run) against ``Runtime.checkpoint_state`` (what
``mpidl train`` writes: each rank keeps its arrays for its own rank shard, only their
skeleton is gathered). Checks that the latter stays under 4 MB on every rank, that the
arrays it keeps are this rank's own (the same bits the gathered state holds at this
rank's position), and prints both peaks; any failure raises.
"""

import sys
import tracemalloc

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SGD, SoftmaxCrossEntropy
from mpidl.engine.models import build_model
from mpidl.runtime import build


def peak_of(fn):
    tracemalloc.start()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, peak


def main():
    kind = sys.argv[1]
    comm = Communicator()
    model = build_model("mlp", (1, 28, 28), 10, seed=5, dtype="float64",
                        hidden=(1024,) * 6)
    opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9, fused=False)
    options = ({"compression": "dgc", "ratio": 0.01} if kind == "dgc" else
               {"sync": "local-sgd", "period": 4})
    rt = build("allreduce", comm, **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    rng = np.random.default_rng(comm.rank)  # each rank its own batch: its own state
    rt.train_step(rng.standard_normal((8, 1, 28, 28)), rng.integers(0, 10, 8))

    gathered, before = peak_of(rt.state_dict)
    (index, own), after = peak_of(lambda: rt.checkpoint_state(1))
    assert own.arrays and after < 4 << 20, f"rank {comm.rank}: {after} bytes"
    whole = comm.mpi.bcast(gathered, root=0)
    for place, a in own.arrays:
        node = {"runtime": whole}
        for key in place:
            node = node[key]
        assert np.array_equal(np.asarray(node), a), place  # its own, at its position
    mine = sum(a.nbytes for _, a in own.arrays)
    print(f"own_state {kind} rank {comm.rank}/{comm.size}: its own state {mine / 1e6:.1f} "
          f"MB; peak {before / 1e6:.1f} MB gathered (state_dict), {after / 1e6:.1f} MB kept "
          "for its rank shard (checkpoint_state)", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

"""A lazily built model, cut by tensor or pipeline parallelism: no rank ever holds it whole.

``mpiexec -n N python -m mpi4py tests/ranks/lazy_build.py tp|pp|zero3 [measured] [eager]``

Builds an MLP of 784-2048-2048-2048-10 in float64 (80 MB) lazily on every rank and sets up
the runtime over all N ranks (``--tensor-parallel N``, ``--pipeline-stages N``, or
``--zero 3`` over N data-parallel ranks, each holding its chunk of every bucket; with
``measured`` the pipeline times the layers on a batch, drawing each layer only while it
times it). Checks, on every rank:

* the lazy build itself allocates no more than a few pieces of the draw (``lazy.CHUNK``);
* the peak of what NumPy allocated during the build and the runtime's set-up (tracemalloc)
  is at most what the rank keeps, plus what the memory ledger says the runtime holds
  beside the parameters (gradient buckets), plus a few pieces of the draw and (when the
  pipeline times the layers) one layer's parameters and gradients, where the eager build
  alone would take the whole model;
* every parameter it keeps (ZeRO: its chunk of every bucket) equals, bitwise, its piece
  of the eagerly built model.

``eager``: the anchor, built as before lazy builds existed: the build's peak is then the
whole model on every rank (asserted). Prints one line per rank; any failure raises (``python -m mpi4py`` aborts every rank).
"""

import sys
import tracemalloc

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SGD, SoftmaxCrossEntropy
from mpidl.engine.lazy import CHUNK
from mpidl.engine.models import build_model
from mpidl.runtime import build

HIDDEN = (2048, 2048, 2048)


def make(lazy):
    model = build_model("mlp", (1, 28, 28), 10, seed=5, dtype="float64", hidden=HIDDEN,
                        lazy=lazy)
    return model, SGD(model.named_parameters(), lr=0.1, fused=False)


def main():
    mode = sys.argv[1]
    measured = "measured" in sys.argv[2:]
    lazily = "eager" not in sys.argv[2:]
    comm = Communicator()
    n = comm.size
    options = {"tp": {"tensor_parallel": n},
               "pp": {"pipeline_stages": n, "micro_batches": 2,
                      "stage_costs": None if measured else "layers"},
               "zero3": {"zero": 3}}[mode]
    rt = build("allreduce", comm, **options)
    if measured:
        rt.sample_batch = (np.zeros((4, 1, 28, 28)), np.zeros(4, dtype=np.int64))
    comm.barrier()
    tracemalloc.start()
    model, opt = make(lazy=lazily)
    built = tracemalloc.get_traced_memory()[1]
    rt.setup(model, opt, SoftmaxCrossEntropy())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # what the set-up allocated for the step on purpose (the gradient buckets, ...), as
    # the ledger counts it
    held = rt.memory()
    runtime_bytes = sum(v for k, v in held.items() if k not in ("mem_params", "mem_peak"))

    eager, _ = make(lazy=False)
    whole = dict(eager.named_parameters())
    whole_bytes = sum(p.data.nbytes for p in whole.values())
    kept = 0
    if mode == "zero3":  # this rank's chunk of each bucket's flat layout
        for sh in rt.syncs[0][1].shards:
            flat = np.concatenate([whole[k].data.reshape(-1) for k in sh.bucket.names])
            assert np.array_equal(sh.param.data, flat[sh.lo:sh.hi]), sh.bucket.name
            kept += sh.param.data.nbytes
    for name, p in model.named_parameters() if mode != "zero3" else ():
        assert isinstance(p.data, np.ndarray), f"{name} was not drawn"
        full = whole[name].data
        sl = rt.tp.slices.get(name) if rt.tp is not None else None
        if sl is not None:
            full = sl.take(full)
        assert np.array_equal(p.data, full), f"rank {comm.rank}: {name} differs"
        kept += p.data.nbytes
    layer_bytes = max(sum(p.data.nbytes for _, p in layer.named_parameters())
                      for layer in eager.layers)
    # timing the layers (every rank times them; rank 0's times are used): one layer's
    # parameters and gradients at a time
    slack = 4 * CHUNK * 8 + (2 * layer_bytes if measured else 0)
    assert kept < whole_bytes, (kept, whole_bytes)
    if not lazily:  # the anchor: built eagerly, every rank held the whole model
        assert built >= whole_bytes and peak >= whole_bytes, (built, peak, whole_bytes)
        print(f"lazy_build {mode} eager rank {comm.rank}/{n}: keeps {kept / 1e6:.1f} MB of "
              f"{whole_bytes / 1e6:.1f} MB, peak while built and set up {peak / 1e6:.1f} MB",
              flush=True)
        comm.close()
        return
    assert built < 3 * CHUNK * 8, f"rank {comm.rank}: the lazy build took {built} bytes"
    assert held["mem_params"] == kept, (held, kept)
    assert peak <= kept + runtime_bytes + slack, (
        f"rank {comm.rank}: peak {peak / 1e6:.1f} MB, keeps {kept / 1e6:.1f} MB, the "
        f"runtime holds {runtime_bytes / 1e6:.1f} MB more ({held}), + {slack / 1e6:.1f} "
        "MB allowed")
    print(f"lazy_build {mode}{' measured' if measured else ''} rank {comm.rank}/{n}: keeps "
          f"{kept / 1e6:.1f} MB of {whole_bytes / 1e6:.1f} MB, peak while built and set up "
          f"{peak / 1e6:.1f} MB (the lazy build itself {built / 1e6:.2f} MB; the runtime's "
          f"buffers {runtime_bytes / 1e6:.1f} MB)", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

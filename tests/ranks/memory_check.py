"""The memory ledger against the formula on real ranks (tests/test_memory.py).

For every stage and optimizer asked for: three training steps of a small MLP, then every
rank's ledger (``Runtime.memory``; the epoch line's mem_params, mem_grads,
mem_optimizer) must equal ``mpidl.runtime.memory.predict`` for its rank to the byte, and
the epoch's metrics must carry the same figures, mem_activations > 0 and a mem_peak
that covers them. Prints one line per case.

    mpiexec -n N python -m mpi4py tests/ranks/memory_check.py --stages 0,1,2,3
"""

import argparse

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SoftmaxCrossEntropy
from mpidl.engine.models import build_model
from mpidl.engine.optim import make_optimizer
from mpidl.runtime import build, memory

SHAPE, CLASSES, B = (1, 8, 8), 5, 4
HYPER = {"sgd": dict(lr=0.05, momentum=0.9), "adam": dict(lr=1e-3)}

ap = argparse.ArgumentParser()
ap.add_argument("--stages", default="0,1,2,3")
ap.add_argument("--optimizers", default="sgd,adam")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--bucket-mb", type=float, default=0.002)  # several uneven buckets
ap.add_argument("--precision", default="fp32")
args = ap.parse_args()

comm = Communicator()
r, n = comm.rank, comm.size
rng = np.random.default_rng(3)
x = rng.standard_normal((3, n * B) + SHAPE).astype(args.dtype)
y = rng.integers(0, CLASSES, size=(3, n * B))
for opt_name in args.optimizers.split(","):
    for stage in map(int, args.stages.split(",")):
        model = build_model("mlp", SHAPE, CLASSES, seed=1, dtype=args.dtype,
                            hidden=(37, 23))
        opt = make_optimizer(opt_name, model.named_parameters(), **HYPER[opt_name])
        sizes = memory.bucket_sizes(model.named_parameters(), args.bucket_mb,
                                    args.precision)
        options = dict(algorithm="ring", bucket_mb=args.bucket_mb)
        if args.precision != "fp32":
            options["precision"] = args.precision
        if stage:
            options["zero"] = stage
        rt = build("allreduce", comm, **options)
        rt.setup(model, opt, SoftmaxCrossEntropy())
        for s in range(3):
            if s == 2:
                rt.metrics()  # the next step takes the ledger
            rt.train_step(x[s, r * B:(r + 1) * B], y[s, r * B:(r + 1) * B])
        held = rt.memory()
        want = memory.predict(sizes, n, stage, slots=memory.optimizer_slots(
            opt_name, HYPER[opt_name].get("momentum", 0)), dtype=args.dtype, rank=r,
            precision=args.precision)
        for key in memory.CATEGORIES:
            assert held[key] == getattr(want, key), (
                f"rank {r}, stage {stage}, {opt_name}: ledger {key} = {held[key]}, the "
                f"formula {getattr(want, key)} (buckets {sizes})")
        m = rt.metrics()  # the last step's ledger
        assert all(m[k] == held[k] for k in memory.LEDGER), (m, held)
        assert m["mem_activations"] > 0
        assert m["mem_peak"] >= max(sum(m[k] for k in memory.LEDGER), m["mem_activations"])
        print(f"rank {r} stage {stage} {opt_name}: params {held['mem_params']} grads "
              f"{held['mem_grads']} optimizer {held['mem_optimizer']} comm "
              f"{held['mem_comm']} = formula", flush=True)
comm.close()

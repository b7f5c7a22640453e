"""Sandblaster L-BFGS through the Python API on real ranks, run by test_lbfgs_mpi.py.

``python -m mpi4py lbfgs_check.py OUT SERVERS [STRAGGLER]``: float64 logistic regression
on 256 Fashion-MNIST images in portions of 64, with settings the command line does not
offer — a memory of 3 and line searches of one evaluation — so that a search fails with
pairs held (the coordinator sends RESTART, then a direction along -g) and then fails
again without (STOP with the shards put back on the last accepted point). The first
worker writes ``OUT.json`` (the iteration records, the final record) and ``OUT.npz``
(the final parameters); ``run()`` is the one-process run the test compares with.
"""

import json
import sys

import numpy as np

SETTINGS = {"history": 3, "max_line_search": 1, "iterations": 30}
PORTION = 64


def problem():
    from mpidl.data import load_dataset
    from mpidl.engine import build_model

    data = load_dataset("fashion-mnist").limit(256, 200)
    return build_model("logreg", dtype="float64"), data


def run(runtime=None):
    """(iteration records, final record, {name: parameters}) on the root, else None."""
    from mpidl.engine.lbfgs import LbfgsSettings
    from mpidl.training.lbfgs import LbfgsTrainer

    model, data = problem()
    trainer = LbfgsTrainer(model, data, LbfgsSettings(**SETTINGS), runtime=runtime,
                           portion_size=PORTION, dtype="float64", quiet=True)
    final = trainer.fit()
    if not trainer.is_root:
        return None
    records = [{k: v for k, v in r.items() if k != "elapsed"} for r in trainer.records[:-1]]
    final = {k: v for k, v in final.items() if k != "elapsed"}
    return records, final, {n: np.array(p.data) for n, p in model.named_parameters()}


def main(out, servers, straggler=None):
    from mpi4py import MPI

    from mpidl.comm import Communicator
    from mpidl.engine.lbfgs import LbfgsSettings
    from mpidl.runtime.lbfgs import build

    runtime = build(Communicator(MPI.COMM_WORLD), LbfgsSettings(**SETTINGS), PORTION,
                    servers=servers, straggler=straggler)
    got = run(runtime)
    if got is not None:
        records, final, params = got
        with open(out + ".json", "w") as f:
            json.dump({"records": records, "final": final}, f)
        np.savez(out + ".npz", **params)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)

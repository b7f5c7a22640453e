"""ZeRO checkpoints resume at another number of ranks and another stage (under mpiexec).

``save OUT STAGE STEPS``: train ``STEPS`` steps at ``--zero STAGE`` and, for reference,
at ``--zero 0`` (same data, same ranks); write both checkpoints (the model, the
optimizer's state after ``Runtime.state_dict`` and the runtime's state, as the trainer
writes them) to OUT. The two optimizer states must be bitwise equal: a checkpoint holds
the stage-0 form whatever the stage.

``resume OUT STAGE STEPS``: on this launch's number of ranks, load the stage-S
checkpoint into ``--zero STAGE`` and the stage-0 one into ``--zero 0``, train ``STEPS``
more steps on the same global batches; the parameters must be bitwise equal after every
step (stage 0 resuming a stage-0 checkpoint at a new N is what the ZeRO run must equal).
"""

import hashlib
import pickle
import sys

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SoftmaxCrossEntropy
from mpidl.engine.models import build_model
from mpidl.engine.optim import make_optimizer
from mpidl.runtime import build

GLOBAL = 12  # divisible by 2, 3 and 4: the same global batch at every N
SHAPE = (1, 8, 8)


def batches(start, steps):
    rng = np.random.default_rng(9)
    for s in range(start + steps):
        x = rng.standard_normal((GLOBAL,) + SHAPE).astype(np.float32)
        y = rng.integers(0, 5, size=GLOBAL)
        if s >= start:
            yield x, y


def setup(comm, stage):
    model = build_model("mlp", SHAPE, 5, seed=4, dtype="float32", hidden=(24, 16))
    opt = make_optimizer("adam", model.named_parameters(), lr=1e-3, weight_decay=1e-3)
    options = {"zero": stage} if stage else {}
    rt = build("allreduce", comm, algorithm="ring", bucket_mb=0.001, **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    return model, opt, rt


def train(comm, model, rt, start, steps):
    r, n = comm.rank, comm.size
    per = GLOBAL // n
    out = []
    for x, y in batches(start, steps):
        rt.train_step(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
        rt.prepare_eval()  # (--zero 3: the parameters gathered to be read)
        h = hashlib.sha256()
        for _, p in model.named_parameters():
            h.update(p.data.tobytes())
        out.append(h.hexdigest())
    return out


def save(comm, out, stage, steps):
    states = {}
    for s in (stage, 0):
        model, opt, rt = setup(comm, s)
        train(comm, model, rt, 0, steps)
        runtime_state = rt.state_dict()
        if rt.is_root:
            states[s] = {"model": {k: v.copy() for k, v in model.state_dict().items()},
                         "optimizer": opt.state_dict(), "runtime": runtime_state}
        if s and rt.is_root and not opt.state:
            raise AssertionError("the root's optimizer holds no state after state_dict")
        rt.train_step(*[a[:GLOBAL // comm.size] for a in next(batches(0, 1))])
        if s and opt.state:  # the root let go of the gathered copy at the next step
            raise AssertionError("the gathered optimizer state outlived the checkpoint")
        rt.finish()
    if comm.rank == 0:
        a, b = states[stage]["optimizer"], states[0]["optimizer"]
        assert sorted(a["state"]) == sorted(b["state"]), "other parameter names"
        for name in b["state"]:
            for k, v in b["state"][name].items():
                w = a["state"][name][k]
                same = v == w if isinstance(v, int) else np.array_equal(v, w)
                if not same:
                    raise AssertionError(f"checkpoint of --zero {stage}: {name}/{k} differs "
                                         "from --zero 0's")
        with open(out, "wb") as f:
            pickle.dump(states, f)
        print(f"[p={comm.size}] --zero {stage} checkpoint after {steps} steps == --zero 0's "
              "(optimizer state bitwise)", flush=True)


def resume(comm, path, stage, steps):
    with open(path, "rb") as f:
        states = pickle.load(f)
    saved = next((s for s in states if s), 0)
    start = None
    runs = {}
    for s, ckpt in ((stage, states[saved]), (0, states[0])):
        model, opt, rt = setup(comm, s)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        rt.load_state_dict(ckpt["runtime"])
        start = ckpt["optimizer"]["state"][next(iter(ckpt["optimizer"]["state"]))]["step"]
        runs[s] = train(comm, model, rt, start, steps)
        rt.finish()
    for i, (a, b) in enumerate(zip(runs[stage], runs[0])):
        if a != b:
            raise AssertionError(f"rank {comm.rank}: resumed at --zero {stage} on {comm.size} "
                                 f"ranks differs from --zero 0 after step {start + i + 1}")
    if comm.rank == 0:
        print(f"[p={comm.size}] the --zero {saved} checkpoint resumed at --zero {stage}: "
              f"bitwise --zero 0 resumed from its own, {steps} steps", flush=True)


def main():
    what, path, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    comm = Communicator()
    (save if what == "save" else resume)(comm, path, stage, steps)
    if comm.rank == 0:
        print("zero resume checks passed", flush=True)


if __name__ == "__main__":
    main()

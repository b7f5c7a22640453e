"""Local SGD, post-local SGD and DiLoCo against all-reduce (run under mpiexec; float64).

Checks, every one on every rank:

* local SGD with H = 1 and SGD (momentum 0.9, Nesterov, weight decay; and plain SGD) is
  all-reduce data parallelism: parameters within 1e-13 after every step; each rank keeps
  its own momentum buffer (they differ by rank), and their mean is the all-reduce run's
  buffer within 1e-13 (momentum is linear in the gradient). With Adam it is not (the
  moments are not linear): the parameters differ by far more than rounding;
* local SGD (H = 3) on N ranks is one process training the N replicas itself and
  averaging them every H steps, within 1e-13 after every step; with ``--clip-grad-norm``
  too (each replica clips its own gradient), and DiLoCo (outer lr 1, no momentum) with it;
* DiLoCo with outer lr 1 and no outer momentum is local SGD bitwise (H = 3);
* post-local SGD (4 warm-up steps) is all-reduce bitwise up to its switch;
* after every averaging the replicas are bitwise equal (``verify_averaging``), DiLoCo's
  default outer step included;
* the communicator's counters: local SGD over T steps sends exactly T/H times the bytes
  all-reduce sends per step (same algorithm, same buckets; one and several buckets).

Any failure raises; ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
Usage: mpiexec -n N python -m mpi4py tests/ranks/local_sgd_check.py
"""

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SGD, Adam, Linear, ReLU, Sequential, SoftmaxCrossEntropy, Tanh
from mpidl.runtime import build

B = 3
TOL = 1e-13


def mlp(seed):
    rng = np.random.default_rng(seed)
    return Sequential(Linear(12, 16, rng=rng, dtype="float64"), ReLU(),
                      Linear(16, 16, rng=rng, dtype="float64"), Tanh(),
                      Linear(16, 5, init="glorot_uniform", rng=rng, dtype="float64"))


MAX_STEPS = 32


def data(steps, n_global, seed=7):
    """The first ``steps`` batches of one fixed sequence (the same whatever ``steps``)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((MAX_STEPS, n_global, 12))
    y = rng.integers(0, 5, size=(MAX_STEPS, n_global))
    return x[:steps], y[:steps]


def sgd(model, momentum=0.9, nesterov=False):
    return SGD(model.named_parameters(), lr=0.1, momentum=momentum, nesterov=nesterov,
               weight_decay=1e-3)


def params(model):
    return {k: p.data.copy() for k, p in model.named_parameters()}


def train(comm, steps, make_opt=sgd, overlap="off", **options):
    """Yields (step, model, optimizer, runtime) after each step; rank 0's weights win."""
    r, n = comm.rank, comm.size
    model = mlp(3 if r == 0 else 100 + r)
    opt = make_opt(model)
    options.setdefault("bucket_mb", 0.0004)  # several buckets
    rt = build("allreduce", comm, algorithm="ring", overlap=overlap, **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    x, y = data(steps, n * B)
    for s in range(steps):
        rt.train_step(x[s][r * B:(r + 1) * B], y[s][r * B:(r + 1) * B])
        yield s + 1, model, opt, rt
    rt.finish()


def trajectory(comm, steps, make_opt=sgd, **options):
    return [params(m) for _, m, _, _ in train(comm, steps, make_opt, **options)]


def max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def bitwise(a, b):
    return all(np.array_equal(a[k], b[k]) and a[k].tobytes() == b[k].tobytes() for k in a)


def same_on_every_rank(comm, p, what):
    digests = comm.mpi.allgather(b"".join(p[k].tobytes() for k in sorted(p)))
    if any(d != digests[0] for d in digests):
        raise AssertionError(f"rank {comm.rank}: {what}: replicas differ")


def check_h1_is_allreduce(comm, steps=6):
    for name, make_opt in (("SGD momentum 0.9", sgd),
                           ("SGD Nesterov", lambda m: sgd(m, nesterov=True)),
                           ("plain SGD", lambda m: sgd(m, momentum=0.0))):
        ref_params, ref_bufs = [], []
        for _, m, o, _ in train(comm, steps, make_opt):
            ref_params.append(params(m))
            ref_bufs.append({k: st["momentum"].copy() for k, st in o.state.items()
                             if "momentum" in st})
        for s, m, o, _ in train(comm, steps, make_opt, sync="local-sgd", period=1,
                                verify_averaging=True):
            p = params(m)
            d = max_diff(p, ref_params[s - 1])
            if d > TOL:
                raise AssertionError(f"{name}: local SGD H=1 step {s}: {d:.3g} from "
                                     "all-reduce")
            same_on_every_rank(comm, p, f"{name} H=1 step {s}")
            bufs = {k: st["momentum"] for k, st in o.state.items() if "momentum" in st}
            for k, v in bufs.items():
                mean = sum(comm.mpi.allgather(v)) / comm.size
                dm = float(np.max(np.abs(mean - ref_bufs[s - 1][k])))
                if dm > TOL:
                    raise AssertionError(f"{name}: mean momentum of {k} at step {s}: "
                                         f"{dm:.3g} from all-reduce's")
                if s == steps and comm.size > 1:
                    every = comm.mpi.allgather(v)
                    if all(np.array_equal(every[0], e) for e in every[1:]):
                        raise AssertionError(f"{name}: local momentum buffers {k} are "
                                             "equal on every rank (expected their own)")
        if comm.rank == 0:
            print(f"[N={comm.size}] {name}: local SGD H=1 == all-reduce (params and mean "
                  f"momentum within {TOL})", flush=True)

    def adam(m):
        return Adam(m.named_parameters(), lr=0.01)
    ref = trajectory(comm, steps, adam)
    loc = trajectory(comm, steps, adam, sync="local-sgd", period=1)
    d = max_diff(loc[-1], ref[-1])
    if comm.size > 1 and d < 1e-9:
        raise AssertionError(f"Adam: local SGD H=1 equals all-reduce ({d:.3g}): expected "
                             "the nonlinear moments to differ")
    if comm.rank == 0:
        print(f"[N={comm.size}] Adam: local SGD H=1 differs from all-reduce by {d:.3g} "
              "(moments are not linear in the gradient)", flush=True)


def check_diloco_lr1_is_local_sgd(comm, steps=9):
    loc = trajectory(comm, steps, sync="local-sgd", period=3, verify_averaging=True)
    dil = trajectory(comm, steps, sync="diloco", period=3, outer_lr=1.0, outer_momentum=0.0,
                     verify_averaging=True)
    for s, (a, b) in enumerate(zip(loc, dil)):
        if not bitwise(a, b):
            raise AssertionError(f"DiLoCo (lr 1, momentum 0) differs from local SGD at step "
                                 f"{s + 1}: {max_diff(a, b):.3g}")
    if comm.size > 1 and bitwise(loc[1], loc[2]):  # (the periods did something)
        raise AssertionError("local SGD did not move")
    # the default outer step: replicas still bitwise equal after each averaging
    for s, m, _, _ in train(comm, steps, sync="diloco", period=3, verify_averaging=True):
        if s % 3 == 0:
            same_on_every_rank(comm, params(m), f"DiLoCo step {s}")
    if comm.rank == 0:
        print(f"[N={comm.size}] DiLoCo outer lr 1, momentum 0 == local SGD bitwise; "
              "replicas bitwise equal after every averaging", flush=True)


def check_post_local_switch(comm, warmup=4, steps=10):
    ref = trajectory(comm, warmup)
    post = trajectory(comm, steps, sync="local-sgd", period=3, warmup_steps=warmup,
                      verify_averaging=True)
    # the warm-up's all-reduce overlapped with backward (grad-ready hooks, several
    # buckets), then hooks off for the local steps: the same bits
    hooked = trajectory(comm, steps, overlap="on", sync="local-sgd", period=3,
                        warmup_steps=warmup, verify_averaging=True)
    for s in range(steps):
        if not bitwise(post[s], hooked[s]):
            raise AssertionError(f"post-local SGD with overlap differs at step {s + 1}")
    for s in range(warmup):
        if not bitwise(post[s], ref[s]):
            raise AssertionError(f"post-local SGD differs from all-reduce at step {s + 1}, "
                                 f"before its switch at {warmup}")
    if comm.size > 1:
        every = comm.mpi.allgather(post[warmup + 1])  # mid-period: replicas differ
        if all(bitwise(every[0], e) for e in every[1:]):
            raise AssertionError("post-local SGD: replicas agree in the middle of a period")
    if comm.rank == 0:
        print(f"[N={comm.size}] post-local SGD == all-reduce bitwise for its {warmup} "
              "warm-up steps", flush=True)


def check_is_one_process_simulation(comm, steps=9, period=3, sync="local-sgd", clip=None):
    """Local SGD (H = 3, SGD with momentum) on N ranks equals one process that trains N
    replicas itself, each on its shard with its own optimizer, and averages their
    parameters every H steps (summed in rank order; the ring sums in another order, hence
    within 1e-13). Every rank runs the simulation and compares after every step.
    ``clip``: ``--clip-grad-norm`` on both sides, each replica clipping its own gradient
    (the runs must clip some steps and not others); with ``sync="diloco"`` (outer lr 1, no
    outer momentum: an averaging) too."""
    n = comm.size
    x, y = data(steps, n * B)
    replicas = []
    own = {} if clip is None else {"clip_grad_norm": clip}
    for _ in range(n):
        model = mlp(3)  # the runtime starts every replica from rank 0's weights
        rt = build("local", None, **own)
        rt.setup(model, sgd(model), SoftmaxCrossEntropy())
        replicas.append((model, rt))
    outer = dict(outer_lr=1.0, outer_momentum=0.0) if sync == "diloco" else {}
    for s, m, _, run in train(comm, steps, sync=sync, period=period, **outer, **own):
        for r, (_, rt) in enumerate(replicas):
            rt.train_step(x[s - 1][r * B:(r + 1) * B], y[s - 1][r * B:(r + 1) * B])
        if s % period == 0:
            named = [dict(model.named_parameters()) for model, _ in replicas]
            for k in named[0]:
                mean = sum(nm[k].data for nm in named) / n
                for nm in named:
                    nm[k].data[...] = mean
        d = max_diff(params(m), params(replicas[comm.rank][0]))
        if d > TOL:
            raise AssertionError(f"{sync} step {s}: rank {comm.rank} is {d:.3g} from "
                                 "its replica in the one-process simulation")
    what = f"{sync} H={period}"
    if clip is not None:
        clipped = comm.mpi.allreduce(run.clip.clipped)
        if not 0 < clipped < n * steps:
            raise AssertionError(f"--clip-grad-norm {clip}: {clipped} of {n * steps} replica "
                                 "steps clipped; choose a bound that clips some only")
        what += f" --clip-grad-norm {clip} ({clipped} of {n * steps} replica steps clipped)"
    if comm.rank == 0:
        print(f"[N={n}] {what} == one process simulating {n} replicas "
              f"(within {TOL}, every step)", flush=True)


def check_bytes(comm, steps=12):
    for bucket_mb in (4.0, 0.0004):
        per_step = None
        for h in (1, 3, 4, 12):
            runs = {}
            for sync in (None, "local-sgd", "diloco"):
                if sync is None and per_step is not None:
                    continue
                opts = {"bucket_mb": bucket_mb}
                if sync is not None:
                    opts.update(sync=sync, period=h)
                models = list(train(comm, steps, **opts))
                rt = models[-1][3]
                runs[sync] = rt.group.counters()["allreduce"]["bytes"]
                if sync is None:
                    per_step = runs[None] // steps
                    if per_step * steps != runs[None] or per_step == 0:
                        raise AssertionError(f"all-reduce bytes {runs[None]} over {steps} "
                                             "steps are not steps x a constant")
            for sync in ("local-sgd", "diloco"):
                want = per_step * steps // h
                if runs[sync] != want:
                    raise AssertionError(f"{sync} H={h} bucket {bucket_mb} MiB: "
                                         f"{runs[sync]} bytes, expected {want} = "
                                         f"{per_step} x {steps}/{h}")
        if comm.rank == 0:
            print(f"[N={comm.size}] bucket {bucket_mb} MiB: all-reduce {per_step} B/step; "
                  f"local SGD and DiLoCo send exactly 1/H of it", flush=True)


def main():
    comm = Communicator()
    check_h1_is_allreduce(comm)
    check_is_one_process_simulation(comm)
    check_is_one_process_simulation(comm, clip=2.5)
    check_is_one_process_simulation(comm, sync="diloco", clip=2.5)
    check_diloco_lr1_is_local_sgd(comm)
    check_post_local_switch(comm)
    if comm.size > 1:
        check_bytes(comm)
    comm.close()
    if comm.rank == 0:
        print("local SGD checks passed", flush=True)


if __name__ == "__main__":
    main()

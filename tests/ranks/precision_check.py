"""Mixed precision on real ranks (run under mpiexec; any failure raises, and
``python -m mpi4py`` turns it into MPI_Abort for all ranks).

Sections (all by default, or ``--sections a,b``):

* ``allreduce``: float16 and bfloat16-word all-reduces, every algorithm (``mpi`` and
  ``auto`` included), equal the float64 sum of the same values rounded once to the
  format, within the bound below; bitwise at p = 2 (one addition, correctly rounded);
  bitwise the same on every rank; and no reduction of them ever reached MPI (the
  counters show no native call).

  The bound: the inputs are on the format's grid; each element's reduction is p - 1
  additions, each correctly rounded (float32 sum rounded once: double rounding is
  innocuous, see ``mpidl.bfloat16.add``), so each adds an error of at most u * |partial
  sum| <= u * S with S = sum_i |x_i| and u the unit roundoff (2**-11 float16, 2**-8
  bfloat16). Against the once-rounded reference r = round(s): |result - r| <=
  |result - s| + |s - r| <= (p - 1) u S (1 + u)**(p - 1) + u |s|, which we check as
  TOL = ((p - 1) u (1 + u)**p + u) S (values are far from float16's overflow and
  subnormals, so no other error enters).
* ``overflow``: fp16 data parallelism where rank 0 alone overflows at step OVERFLOW_STEP:
  every rank skips that step (the check reads the all-reduced gradients, identical
  everywhere), parameters and optimizer state bitwise untouched by it, the scale halved
  on every rank, and the replicas stay bitwise identical.
* ``replicas`` (p = 2 only): bf16 and fp16 data parallelism equals, bitwise, one process
  that simulates the 2 replicas: each replica's gradient rounded to the format, times
  1/2 into the wire format, the two added once with one rounding. (One process at the
  global batch differs from it only in where the sum is rounded: once over the whole
  batch instead of once per half and once for their sum.)

Usage: mpiexec -n P python -m mpi4py tests/ranks/precision_check.py [--sections ...]
"""

import sys

import numpy as np

from mpidl import bfloat16
from mpidl.comm import Communicator
from mpidl.engine import SGD, Adam, Linear, ReLU, Sequential, SoftmaxCrossEntropy, Tanh
from mpidl.runtime import build
from mpidl.runtime.precision import UNIT_ROUNDOFF

ALGORITHMS = ("auto", "mpi", "ring", "tree", "recursive_doubling")
OVERFLOW_STEP = 2


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


# -- allreduce -------------------------------------------------------------------------------
def grid_values(fmt, n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 2, n)).astype(np.float32)
    if fmt == "fp16":
        return x.astype(np.float16)
    return bfloat16.to_words(x)


def as_float64(fmt, a):
    return a.astype(np.float64) if fmt == "fp16" else bfloat16.from_words(a).astype(np.float64)


def round_once(fmt, s):
    """float64 sums (exact here: p grid values of exponents within ~2**+-10) rounded once
    to the format. Through float32 first, which cannot change the result: 24 >= 2*11 + 2
    and >= 2*8 + 2 bits, so that double rounding is innocuous."""
    f32 = s.astype(np.float32)
    if fmt == "fp16":
        return f32.astype(np.float16).astype(np.float64)
    return bfloat16.round_(f32).astype(np.float64)


def section_allreduce(comm):
    p, rank = comm.size, comm.rank
    n = 20011
    worst = {}
    for fmt in ("fp16", "bf16"):
        u = UNIT_ROUNDOFF[fmt]
        xs = [grid_values(fmt, n, 100 + r) for r in range(p)]
        exact = sum(as_float64(fmt, x) for x in xs)
        ref = round_once(fmt, exact)
        bound = ((p - 1) * u * (1 + u) ** p + u) * sum(np.abs(as_float64(fmt, x)) for x in xs)
        for alg in ALGORITHMS:
            comm.reset_counters()
            mine = xs[rank].copy()
            buf = mine if fmt == "fp16" else mine.view(bfloat16.BFLOAT16)
            comm.allreduce(buf, out=buf, op="sum", algorithm=alg, name=f"{fmt}-{alg}")
            got = as_float64(fmt, mine)
            err = np.abs(got - ref)
            check(np.all(err <= bound), f"{fmt} {alg} p={p}: error {err.max()} above the "
                  f"bound at {int(np.argmax(err - bound))}")
            if p == 2:
                check(np.array_equal(got, ref), f"{fmt} {alg} p=2: not the once-rounded sum")
            everyone = comm.mpi.allgather(mine.tobytes())
            check(all(b == everyone[0] for b in everyone), f"{fmt} {alg}: ranks differ")
            native = comm.counters()["allreduce"]["native_calls"]
            check(native == 0, f"{fmt} {alg}: {native} reduction(s) went to MPI")
            worst[(fmt, alg)] = float(np.max(err / np.maximum(bound, 1e-300)))
        # the other reductions take the same road
        comm.reset_counters()
        src = xs[rank] if fmt == "fp16" else xs[rank].view(bfloat16.BFLOAT16)
        part = comm.reduce_scatter(src, algorithm="mpi")
        red = comm.reduce(src, root=0, algorithm="mpi")
        c = comm.counters()
        check(c["reduce_scatter"]["native_calls"] == 0 and c["reduce"]["native_calls"] == 0,
              f"{fmt}: reduce/reduce_scatter went to MPI")
        check(part.size > 0 and (red is not None) == (rank == 0), f"{fmt}: bad results")
    if rank == 0:
        print(f"section allreduce: p={p} worst error / bound "
              + ", ".join(f"{f}/{a} {w:.3f}" for (f, a), w in sorted(worst.items())))


# -- models ------------------------------------------------------------------------------
def mlp(seed):
    rng = np.random.default_rng(seed)
    return Sequential(Linear(12, 16, rng=rng), ReLU(), Linear(16, 16, rng=rng), Tanh(),
                      Linear(16, 5, init="glorot_uniform", rng=rng))


def batches(steps, n, seed=7):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps, n, 12)).astype(np.float32),
            rng.integers(0, 5, size=(steps, n)))


def snapshot(rt):
    rt.gather_params()  # (the working copies are 2-byte between steps)
    params = {n: p.data.copy() for n, p in rt.model.named_parameters()}
    masters = {n: m.data.copy() for n, m in rt.precision.masters.items()}
    state = {n: {k: (v.copy() if hasattr(v, "copy") else v) for k, v in st.items()}
             for n, st in rt.optimizer.state.items()}
    return params, masters, state


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return a == b


def section_overflow(comm):
    p, rank = comm.size, comm.rank
    steps, b = 5, 4
    x, y = batches(steps, p * b)
    model = mlp(3)
    opt = Adam(model.named_parameters(), lr=1e-2)
    loss = SoftmaxCrossEntropy()
    rt = build("allreduce", comm, precision="fp16", loss_scale=2.0 ** 10,
               loss_scale_window=2, algorithm="mpi")
    rt.setup(model, opt, loss)
    scaled = loss.backward  # the precision's wrapper (times the loss scale)
    for s in range(steps):
        if s == OVERFLOW_STEP and rank == 0:  # this rank alone overflows float16
            loss.backward = lambda: scaled() * np.float32(1e30)
        before = snapshot(rt)
        scale = rt.precision.scale
        lo = rank * b
        with np.errstate(all="ignore"):  # the overflow's infs and NaNs are the point
            rt.train_step(x[s, lo:lo + b], y[s, lo:lo + b])
        loss.backward = scaled
        after = snapshot(rt)
        if s == OVERFLOW_STEP:
            check(same(before, after), f"rank {rank}: the skipped step changed something")
            check(rt.precision.scale == scale / 2, f"rank {rank}: scale {rt.precision.scale}"
                  f", expected {scale / 2}")
        else:
            check(not same(before[0], after[0]), f"rank {rank}: step {s} did not update")
        everyone = comm.mpi.allgather((rt.precision.scale, rt.precision.skipped_total,
                                       {n: a.tobytes() for n, a in after[0].items()}))
        check(all(e == everyone[0] for e in everyone), f"step {s}: ranks disagree on the "
              "scale, the skipped steps or the parameters")
    # window 2: one doubling after steps 0-1 (2**11), halving at step 2 (2**10), then
    # steps 3-4 double it again (2**11)
    check(rt.precision.scale == 2.0 ** 11 and rt.precision.skipped_total == 1,
          f"scale {rt.precision.scale}, skipped {rt.precision.skipped_total}")
    if rank == 0:
        print(f"section overflow: p={p} every rank skipped step {OVERFLOW_STEP} only")


def section_replicas(comm):
    p, rank = comm.size, comm.rank
    steps, b = 4, 3
    x, y = batches(steps, p * b, seed=11)
    for fmt in ("bf16", "fp16"):
        for alg in ("ring", "mpi"):
            model = mlp(5)
            opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9)
            rt = build("allreduce", comm, precision=fmt, algorithm=alg, bucket_mb=0.0004)
            rt.setup(model, opt, SoftmaxCrossEntropy())
            for s in range(steps):
                rt.train_step(x[s, rank * b:(rank + 1) * b], y[s, rank * b:(rank + 1) * b])
            rt.gather_params()
            mine = {n: q.data.copy() for n, q in model.named_parameters()}
            masters = {n: m.data.copy() for n, m in rt.precision.masters.items()}
            ref, ref_masters = simulate(fmt, p, b, x, y, steps)
            check(same(mine, ref) and same(masters, ref_masters),
                  f"{fmt} {alg}: p={p} ranks differ from the simulated replicas")
    if rank == 0:
        print(f"section replicas: p={p} bf16 and fp16 equal the simulated replicas bitwise")


def simulate(fmt, p, b, x, y, steps):
    """One process, p = 2 replicas: each one's gradient rounded to the format, times 1/p
    into the wire format, the two contributions added once (``ring_sum``), the float32
    masters stepped by ``Precision.step`` as a rank does."""
    from mpidl.runtime.precision import Precision, Wire  # noqa: PLC0415
    from mpidl.runtime.placement import Replicated  # noqa: PLC0415

    models = [mlp(5) for _ in range(p)]
    opt = SGD(models[0].named_parameters(), lr=0.1, momentum=0.9)
    losses = [SoftmaxCrossEntropy() for _ in range(p)]
    precs = [Precision(fmt) for _ in range(p)]
    opts = [opt] + [SGD(m.named_parameters(), lr=0.1) for m in models[1:]]
    for m, o, loss, pr in zip(models, opts, losses, precs):
        m.needs_input_grad = False
        pr.setup(m, o, loss)
    wire = Wire(fmt)
    placement = Replicated(opt)
    names = [n for n, _ in models[0].named_parameters()]
    for s in range(steps):
        contributions = []
        for r, (m, loss) in enumerate(zip(models, losses)):
            m.zero_grad()
            loss.forward(m(x[s, r * b:(r + 1) * b]), y[s, r * b:(r + 1) * b])
            m.backprop(loss.backward())
            mine = {}
            for n, q in m.named_parameters():
                buf = np.zeros(q.data.shape, dtype=wire.storage)
                wire.encode(q.grad, 1.0 / p, buf)
                mine[n] = buf
            contributions.append(mine)
        total = {}
        for n in names:
            total[n] = ring_sum(fmt, [c[n] for c in contributions])
        opt.zero_grad()
        for n, q in models[0].named_parameters():
            q.grad = total[n]
        precs[0].step(placement, names)
        for m in models[1:]:  # the other replicas take replica 0's parameters
            for (_, q), (_, q0) in zip(m.named_parameters(), models[0].named_parameters()):
                q.data[...] = q0.data
    return ({n: q.data.copy() for n, q in models[0].named_parameters()},
            {n: m.data.copy() for n, m in precs[0].masters.items()})


def ring_sum(fmt, parts):
    """The sum of 2 contributions as any all-reduce computes it on 2 ranks: one addition
    in float32 rounded once (commutative, so the order does not matter)."""
    if len(parts) != 2:
        raise ValueError("the replica simulation covers p = 2")
    out = np.empty_like(parts[0])
    if fmt == "fp16":
        np.add(parts[0], parts[1], out=out)
    else:
        bfloat16.add(parts[0], parts[1], out)
    return out


SECTIONS = {"allreduce": section_allreduce, "overflow": section_overflow,
            "replicas": section_replicas}


def main(argv):
    names = list(SECTIONS)
    if "--sections" in argv:
        names = argv[argv.index("--sections") + 1].split(",")
    comm = Communicator()
    for name in names:
        if name == "replicas" and comm.size != 2:
            continue
        SECTIONS[name](comm)
    comm.close()
    if comm.rank == 0:
        print(f"PRECISION OK p={comm.size}")


if __name__ == "__main__":
    main(sys.argv[1:])

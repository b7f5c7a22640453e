"""Pipeline parallelism (x tensor x data parallelism) trains like one process (run under
mpiexec).

``mpiexec -n N python -m mpi4py tests/ranks/pp_check.py LAYOUTS MODELS SCHEDULES MICRO
OPTIMIZERS [STEPS] [FLAGS]``

* LAYOUTS: comma-separated ``PxT`` (pipeline stages x tensor-parallel degree; data
  parallelism takes the rest of the N ranks), e.g. ``2x1,4x2``;
* MODELS: ``mlp`` (eight hidden layers, so every stage has work), ``resnet``
  (resnet-tiny), ``gpt`` (gpt-tiny);
* SCHEDULES: ``gpipe,1f1b,interleaved:2,zb,async``; MICRO: micro-batch counts, where ``P-1``,
  ``P`` and ``4P`` stand for those values; OPTIMIZERS: ``sgd`` (momentum 0.9, weight
  decay), ``adam`` and/or ``adamw`` (gpt-tiny's recipe: lr 2e-3, weight decay 0.01);
  FLAGS: ``recompute``, ``zero1``, ``dropout``, ``tied`` (gpt-tiny's head tied to its
  token embedding, on the first and last stages), ``tiedstep`` (that with
  ``--tied-exchange step``: held to 1e-12, its sum being rounded in another order),
  ``syncbn`` (``--sync-bn``: BatchNorm statistics over the data-parallel replicas, so the
  one process's micro-batch is theirs together), ``bf16`` / ``fp16`` (``--precision``,
  float32 models; fp16 from a loss scale of 2**20, so the first steps overflow and are
  skipped: the same steps and the same scale as the one process).

For every combination, the model is built whole from one seed, trained STEPS steps
(default 20, float64) with the layout, and compared on the root with one process
running gradient accumulation over the same micro-batches in the same order (under
``async``, applying each step's gradient one step later: PipeDream-2BW's rule; its
micro-batch i is every data-parallel replica's micro-batch i). With one data-parallel
replica and no tensor parallelism the parameters must be **bitwise** equal; otherwise
(an all-reduce sums the replicas' or slices' pieces in another order) within 1e-12 of
the largest value of each tensor. The step's loss must be the same bits on every stage.

Memory: the most micro-batches a stage holds is the schedule's formula
(``Plan.in_flight_formula``), and (one chunk per rank) the activation bytes it held at
its peak are that count times the bytes of one micro-batch (measured by the M = 1 run
of the same model, layout and flags, which must come first in MICRO); with
``recompute``, that count times the stage's input. ``async``: the most weight versions
a stage held is 2BW's bound (``Plan.weight_versions``: 2, 1 on the last stage).

A combination the layout cannot take (fewer top-level layers than P x v) must be
refused with the one-line ConfigError, which is checked instead.
Any failure raises; ``python -m mpi4py`` turns it into MPI_Abort for all ranks.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.engine import SGD, Adam
from mpidl.engine.optim import AdamW
from mpidl.engine.losses import TokenCrossEntropy
from mpidl.engine.module import SparseGrad
from mpidl.engine.models import build_model
from mpidl.errors import ConfigError
from mpidl.runtime import build

TOL = 1e-12
B = 2  # samples per micro-batch and data-parallel rank
SHAPES = {"mlp": (1, 6, 6), "resnet": (1, 8, 8), "gpt": (7,)}
CLASSES = {"mlp": 10, "resnet": 10, "gpt": 11}


def make(name, optimizer, dropout, tied=False, dtype="float64", lazy=False):
    """The model and its optimizer; ``lazy``: built lazily, as ``mpidl train`` builds a
    split model (the pipeline draws only its stages' layers)."""
    if name == "gpt":
        model = build_model("gpt-tiny", input_shape=SHAPES[name], num_classes=11, seed=3,
                            dtype=dtype, layers=2, heads=4, width=16, context=8,
                            dropout=dropout, tie_weights=tied, lazy=lazy)
    elif name == "resnet":
        model = build_model("resnet-tiny", input_shape=SHAPES[name], num_classes=10, seed=3,
                            dtype=dtype, widths=(4, 6, 8), lazy=lazy)
    else:
        model = build_model("mlp", input_shape=SHAPES[name], num_classes=10, seed=3,
                            dtype=dtype, hidden=(12,) * 8, dropout=dropout, lazy=lazy)
    named = model.named_parameters()
    # NumPy updates (fused=False): the models are tiny, and loading Numba would cost each of
    # up to 8 ranks a second; the fused kernels are bitwise these (tests/test_optim.py)
    if optimizer == "sgd":
        opt = SGD(named, lr=0.05, momentum=0.9, weight_decay=1e-4, fused=False)
    elif optimizer == "adamw":
        opt = AdamW(named, lr=2e-3, weight_decay=0.01, fused=False)
    else:
        opt = Adam(named, lr=1e-3, fused=False)
    return model, opt


def data(name, rng, n):
    shape = (n, B) + SHAPES[name]
    k = CLASSES[name]
    if name == "gpt":
        return rng.integers(0, k, shape), rng.integers(0, k, shape)
    return rng.standard_normal(shape), rng.integers(0, k, shape[:2])


def ref_step(rt, x, y, dense):
    """One process's step; ``dense``: row-sparse gradients made dense before the update,
    as ZeRO (``--sparse-grads dense``) does (SGD's momentum of untouched rows differs)."""
    if not dense:
        return rt.train_step(x, y)
    rt.begin_step()
    rt.schedule.run(rt.model, rt.loss, x, y)
    for _, p in rt.named_params:
        if isinstance(p.grad, SparseGrad):
            p.grad = p.grad.to_dense()
    rt.finish_step()


def ref_delayed_step(rt, x, y, dense, pending):
    """One process under PipeDream-2BW's rule (``--schedule async``): this step's
    gradient is taken at the current weights and applied a step later, W(t+1) = W(t) -
    lr grad f(W(t-1)); returns it (the next step's ``pending``)."""
    rt.begin_step()
    rt.schedule.run(rt.model, rt.loss, x, y)
    now = {}
    for n, p in rt.named_params:
        now[n] = p.grad.to_dense() if dense and isinstance(p.grad, SparseGrad) else p.grad
        p.grad = None if pending is None else pending[n]
    if pending is not None:
        rt.finish_step()
    return now


def run(comm, name, P, T, kind, M, optimizer, steps, flags, bytes_one):
    D = comm.size // (P * T)
    dropout = 0.1 if "dropout" in flags else 0.0
    options = dict(pipeline_stages=P, tensor_parallel=T, micro_batches=M,
                   pipeline_schedule=kind, recompute="recompute" in flags,
                   sync_bn="syncbn" in flags)
    for stage in (1, 2, 3):
        if f"zero{stage}" in flags:
            options.update(zero=stage, sparse_grads="dense")
    tied = "tied" in flags or "tiedstep" in flags
    fmt = next((f for f in ("bf16", "fp16") if f in flags), None)
    dtype = "float32" if fmt else "float64"
    # (fp16: a loss scale that overflows the first steps, so some are skipped)
    low = dict(precision=fmt, loss_scale=2.0 ** 18 if fmt == "fp16" else None)
    if fmt:  # (gpt-tiny: its embeddings' rows in the 2-byte buckets)
        options.update(low, sparse_grads="dense")
    if "tiedstep" in flags:
        options.update(tied_exchange="step")
    model, opt = make(name, optimizer, dropout, tied, dtype, lazy=True)
    try:
        rt = build("allreduce", comm, **options)
        rt.check(model, opt)
    except ConfigError as e:
        if P * int(kind.partition(":")[2] or 1) > len(model.layers):
            assert "top-level layers" in str(e) and "\n" not in str(e), e
            return "refused"
        raise
    rt.setup(model, opt, TokenCrossEntropy())
    index, count = rt.shard()
    assert count == D, (count, D)
    rng = np.random.default_rng(11)
    x, y = data(name, rng, steps * D * M)
    if fmt and x.dtype.kind == "f":  # (not gpt-tiny's token ids)
        x = x.astype(np.float32)
    ref = pending = None
    if rt.is_root:
        ref, ref_opt = make(name, optimizer, dropout, tied, dtype)
        ref_rt = build("local", accumulate=M, **(low if fmt else {}))
        ref_rt.setup(ref, ref_opt, TokenCrossEntropy())
    for s in range(steps):
        block = slice(s * D * M, (s + 1) * D * M)  # D replicas x M micro-batches of B
        xs, ys = x[block], y[block]
        mine = slice(index * M, (index + 1) * M)
        loss = rt.train_step(xs[mine].reshape((M * B,) + xs.shape[2:]),
                             ys[mine].reshape((M * B,) + ys.shape[2:]))
        if rt.pp_group is not None:
            losses = rt.pp_group.mpi.allgather(loss)
            assert len(set(losses)) == 1, f"step {s}: the stages' losses differ {losses}"
        if ref is not None:  # one process: micro-batch i is every replica's i-th
            order = xs.reshape((D, M) + xs.shape[1:]).swapaxes(0, 1)
            labels = ys.reshape((D, M) + ys.shape[1:]).swapaxes(0, 1)
            xr = order.reshape((M * D * B,) + xs.shape[2:])
            yr = labels.reshape((M * D * B,) + ys.shape[2:])
            dense = any(f.startswith("zero") for f in flags)
            if kind == "async":
                pending = ref_delayed_step(ref_rt, xr, yr, dense, pending)
            else:
                ref_step(ref_rt, xr, yr, dense)
    plan = rt.pp.plan if rt.pp is not None else None
    held = None
    if plan is not None:
        r = rt.pp.rank
        want = plan.in_flight_formula(r)
        assert rt.pp.peak_in_flight == want == plan.peak_in_flight(r), (
            f"stage {r}: held {rt.pp.peak_in_flight} micro-batches, formula {want}")
        if steps > 1:
            assert rt.pp.weight_versions == plan.weight_versions(r), (
                f"stage {r}: held {rt.pp.weight_versions} weight versions, "
                f"2BW's bound {plan.weight_versions(r)}")
        held = rt.schedule.activation_bytes
        if plan.v == 1 and bytes_one is not None:
            assert held == want * bytes_one, (f"stage {r}: {held} activation bytes at the "
                                              f"peak, expected {want} x {bytes_one}")
    rt.finish()  # (async: the carried backwards drained, nothing left in flight)
    state, _ = rt.full_state(model, opt)
    worst = 0.0
    if rt.is_root:
        exact = D == 1 and T == 1 and "tiedstep" not in flags
        ref_rt.gather_params()  # (mixed precision: 2-byte working copies between steps)
        ref_state = ref.state_dict()
        assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
        for k, a in ref_state.items():
            b = state[k]
            assert b.shape == a.shape, (k, b.shape, a.shape)
            if exact or a.dtype.kind != "f":
                assert np.array_equal(a, b), f"{k!r} is not bitwise equal to one process"
            elif a.size:
                worst = max(worst, float(np.max(np.abs(a - b)) /
                                         max(float(np.max(np.abs(a))), 1e-300)))
        assert worst <= TOL, f"parameters differ from one process: {worst:.3g} > {TOL}"
        if fmt == "fp16":  # the same steps skipped (every stage alike), the same scale
            got = (rt.precision.scale, rt.precision.skipped_total)
            want = (ref_rt.precision.scale, ref_rt.precision.skipped_total)
            assert got == want and want[1] > 0, f"fp16 (scale, skipped): {got} vs {want}"
    rt.mesh.close()
    return held, worst


def main():
    layouts, models, kinds, micro, optimizers = sys.argv[1:6]
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 20
    flags = set(sys.argv[7].split(",")) if len(sys.argv) > 7 else set()
    comm = Communicator(MPI.COMM_WORLD)
    t0 = time.perf_counter()
    done = refused = 0
    for layout in layouts.split(","):
        P, T = (int(v) for v in layout.split("x"))
        values = []
        for m in micro.split(","):
            v = {"P-1": P - 1, "P": P, "4P": 4 * P}.get(m) or int(m)
            if v >= 1 and v not in values:
                values.append(v)
        for name in models.split(","):
            for optimizer in optimizers.split(","):
                for kind in kinds.split(","):
                    one = None
                    for M in values:
                        if kind == "async" and M < P - 1:
                            continue  # (refused: see test_pipeline's one-line errors)
                        out = run(comm, name, P, T, kind, M, optimizer, steps, flags, one)
                        if out == "refused":
                            refused += 1
                            break
                        held, worst = out
                        if M == 1:
                            one = held
                        done += 1
                        if comm.rank == 0:
                            print(f"pp_check {name} P={P} T={T} D={comm.size // (P * T)} "
                                  f"{kind} M={M} {optimizer} {','.join(sorted(flags))}: "
                                  + ("bitwise" if worst == 0.0 else f"{worst:.2g}"),
                                  flush=True)
    if comm.rank == 0:
        print(f"pp_check: {done} layouts equal one process, {refused} refused, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

"""ZeRO stages 1-3 against stage 0 on real ranks (run under mpiexec).

For every optimizer and dtype asked for, stage 0 (replicated optimizer, fused all-reduce)
trains a small model for ``--steps`` steps on the same global batches; every other stage
asked for must give bitwise the same parameters after every step (stage 3: every other
step, gathered for it by evaluation, and the last, by ``Runtime.full_state``; the steps
between reuse the buffers of the one before), on every rank. With ``--algorithm ring``
the communicator's counters must also show, per step and rank,
exactly stage 0's bytes for stages 1 and 2 (the ring reduce-scatter and all-gather send
what the ring all-reduce sends), and summed over the ranks exactly 2(N-1)·Ψ·itemsize
((2k+1)(N-1)·Ψ·itemsize for stage 3 with k micro-batches); the metrics'
``bytes_sent_per_step`` equals the counters; at stage 3 some gathers are prefetched.

With ``--tensor-parallel T`` and/or ``--pipeline-stages P`` (``--schedule S``, its
micro-batches ``--accumulate``, ``--recompute``: stage 3 gathers for the forward backward
runs again too, (3k+1)) both stages run the same layout: ZeRO shards each rank's slices of
its pipeline stage over its data-parallel group of N/(P T) ranks (N above), and every
rank's parameters must be stage 0's bits.

With ``--lazy`` stage 3's model is built lazily (``mpidl.engine.lazy``): no rank holds it
whole, from set-up on, and it must still be stage 0's bits after every step.

With ``--precision bf16|fp16`` both stages train in it (float32 only): 2-byte buckets
and gathers (itemsize 2 in the byte checks), the float32 masters sharded with the
optimizer state. ``--loss-scale S`` (fp16): a scale large enough to overflow makes steps
be skipped, which every stage must skip alike (under ZeRO a rank sees only its chunks of
the gradients, so the ranks must agree on an overflow); ``skipped_steps`` must match.

Usage: mpiexec -n N python -m mpi4py tests/ranks/zero_check.py --model mlp
       --optimizers sgd,adam --dtypes float32 --stages 1,2 --steps 20
"""

import argparse
import hashlib

import numpy as np

from mpidl.comm import Communicator
from mpidl.engine import SoftmaxCrossEntropy
from mpidl.engine.losses import TokenCrossEntropy
from mpidl.engine.models import build_model
from mpidl.engine.optim import make_optimizer
from mpidl.runtime import build

B = 4
CLASSES = 5
SHAPE = (1, 8, 8)
SIZES = {"mlp": {"hidden": (24, 16)}, "cnn": {"channels": (4, 6), "hidden": 16},
         # its blocks' buckets have equal sizes: a spare serves another block's gather
         "gpt-tiny": {"layers": 2, "heads": 2, "width": 8, "context": 8}}
TOKENS = 6  # gpt-tiny: tokens per sample, and the vocabulary is CLASSES
HYPER = {"sgd": dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
         "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
         "adam": dict(lr=1e-3, weight_decay=1e-3),
         "adamw": dict(lr=1e-3, weight_decay=1e-2)}


def make(args, opt_name, dtype, lazy=False):
    """The model and optimizer; ``lazy``: the model built lazily (``--lazy``, stage 3: each
    rank draws its chunks only), the stage-0 reference eagerly."""
    shape = (TOKENS,) if args.model == "gpt-tiny" else SHAPE
    model = build_model(args.model, shape, CLASSES, seed=11, dtype=dtype, lazy=lazy,
                        **SIZES[args.model])
    kind = "sgd" if opt_name == "nesterov" else opt_name
    return model, make_optimizer(kind, model.named_parameters(), **HYPER[opt_name])


def batches(model, steps, n_global, dtype, seed=5):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        if model == "gpt-tiny":
            yield (rng.integers(0, CLASSES, size=(n_global, TOKENS)),
                   rng.integers(0, CLASSES, size=(n_global, TOKENS)))
        else:
            yield (rng.standard_normal((n_global,) + SHAPE).astype(dtype),
                   rng.integers(0, CLASSES, size=n_global))


def digest(model):
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


def run(comm, args, opt_name, dtype, stage):
    """Per-step digests, the counters' bytes per step, metrics' bytes, Ψ, itemsize."""
    model, opt = make(args, opt_name, dtype, lazy=args.lazy and stage == 3)
    options = dict(algorithm=args.algorithm, bucket_mb=args.bucket_mb, overlap=args.overlap)
    if args.accumulate > 1:
        options["accumulate"] = args.accumulate
    if args.tensor_parallel > 1:
        options["tensor_parallel"] = args.tensor_parallel
    if args.pipeline_stages > 1:
        options.update(pipeline_stages=args.pipeline_stages, pipeline_schedule=args.schedule,
                       recompute=args.recompute)
    if stage:
        options["zero"] = stage
    if stage == 3 and args.reuse:
        options["zero_reuse"] = "on"
    if args.model == "gpt-tiny":  # ZeRO exchanges the embeddings' gradients dense
        options["sparse_grads"] = "dense"
    if args.precision != "fp32":
        options["precision"] = args.precision
        if args.loss_scale:
            options["loss_scale"] = args.loss_scale
    rt = build("allreduce", comm, **options)
    rt.setup(model, opt, TokenCrossEntropy() if args.model == "gpt-tiny"
             else SoftmaxCrossEntropy())
    r, n = rt.shard()  # this rank's piece of the global batch (a tp group shares one)
    per = B * args.accumulate
    out = []
    lr = HYPER[opt_name]["lr"]
    sent = 0
    for s, (x, y) in enumerate(batches(args.model, args.steps, n * per, dtype)):
        opt.lr = lr * (1.0 - 0.5 * s / args.steps)  # a schedule: the shards must see it
        before = rt.group.counters()["total"]["bytes"]
        rt.train_step(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
        sent += rt.group.counters()["total"]["bytes"] - before
        if stage == 3:  # the parameters are gathered only for evaluation (collective):
            if s % 2 == 0 and s < args.steps - 1:  # every other step goes on without it,
                out.append(None)  # so spare buffers carry over to the next step's gathers
                continue
            if s == args.steps - 1 or args.lazy:
                # (what --save and checkpoints call: it gathers too; a lazily built
                # model's evaluation gathers layer by layer, not the whole model)
                rt.full_state(model)
            else:
                rt.prepare_eval()
        elif args.precision != "fp32":  # the working copies are 2-byte between steps
            rt.gather_params()
        out.append(digest(model))
    m = rt.metrics()
    metrics = m.get("bytes_sent_per_step")
    skipped = m.get("skipped_steps", 0)
    sync = rt.syncs[0][1]
    kept = 0  # elements of the buckets --zero-reuse on keeps from forward into backward
    if stage == 3 and args.reuse:
        if not sync.gathers.keep:
            raise AssertionError("--zero-reuse on kept no bucket")
        kept = sum(sh.bucket.buffer.size for sh in sync.shards
                   if sh.bucket.index in sync.gathers.keep)
    # (a pipeline stage of one layer, or whose layers share one bucket, has nothing to
    # prefetch: some rank's must)
    prefetched = comm.mpi.allreduce(m.get("param_prefetched", 0))
    if stage == 3 and len(sync.shards) > 1:
        if prefetched == 0:
            raise AssertionError(f"--zero 3: no gather was prefetched ({m})")
        if m["param_reused"] == 0 and not args.reuse:  # (reuse keeps what it would free)
            raise AssertionError("--zero 3: no gather reused a spare buffer")
    rt.finish()
    psi = model.num_parameters()  # (this rank's slices of its stage's layers)
    item = np.dtype(dtype).itemsize if args.precision == "fp32" else 2
    if skipped and stage in (1, 2):  # a skipped step (fp16) gathers no updated shards:
        p, me = rt.group.size, rt.group.rank  # count them as sent: the formula holds
        sent += skipped * item * sum(sh.bucket.buffer.size - sh.counts[(me + 1) % p]
                                     for sh in sync.shards)
    return (out, sent / args.steps, metrics, psi, item, rt.describe(), kept, rt.group,
            skipped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--optimizers", default="sgd")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--bucket-mb", type=float, default=0.002)
    ap.add_argument("--overlap", default="off")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="stage 3 with --zero-reuse on")
    ap.add_argument("--lazy", action="store_true", help="stage 3's model built lazily")
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--pipeline-stages", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--loss-scale", type=float, default=None)
    args = ap.parse_args()
    comm = Communicator()
    n = comm.size // (args.tensor_parallel * args.pipeline_stages)  # the dp group's ranks
    stages = [int(s) for s in args.stages.split(",")]
    for opt_name in args.optimizers.split(","):
        for dtype in args.dtypes.split(","):
            ref, ref_sent, _, psi, item, _, _, _, ref_skipped = run(comm, args, opt_name,
                                                                     dtype, 0)
            if ref[0] == ref[-1]:
                raise AssertionError("stage 0 did not move the parameters")
            if args.loss_scale and not 0 < ref_skipped < args.steps:
                raise AssertionError(f"--loss-scale {args.loss_scale:g} skipped "
                                     f"{ref_skipped} of {args.steps} steps: choose one "
                                     "that overflows some steps only")
            for stage in stages:
                got, sent, metrics, _, _, lines, kept, dp, skipped = run(
                    comm, args, opt_name, dtype, stage)
                if skipped != ref_skipped:
                    raise AssertionError(f"--zero {stage} skipped {skipped} steps, --zero 0 "
                                         f"{ref_skipped}")
                for s, (a, b) in enumerate(zip(ref, got)):
                    if b is not None and a != b:
                        raise AssertionError(
                            f"rank {comm.rank}: {args.model} {opt_name} {dtype} p={n}: "
                            f"--zero {stage} differs from --zero 0 after step {s + 1}")
                everyone = dp.mpi.allgather(got[-1])
                if any(d != everyone[0] for d in everyone):
                    raise AssertionError(f"--zero {stage}: replicas differ")
                if args.algorithm == "ring":
                    if metrics != sent:
                        raise AssertionError(f"--zero {stage}: metrics say {metrics} bytes "
                                             f"per step, the counters {sent}")
                    if stage < 3 and sent != ref_sent:
                        raise AssertionError(f"rank {comm.rank}: --zero {stage} sent {sent} "
                                             f"bytes per step, --zero 0 {ref_sent}")
                    total = sum(dp.mpi.allgather(sent))
                    # stage 3 gathers for every forward and every backward (the kept
                    # buckets of --zero-reuse on for every forward only; with a
                    # pipeline's --recompute also for the forward backward runs again)
                    passes = 3 if args.recompute else 2
                    factor = passes * args.accumulate + 1 if stage == 3 else 2
                    want = (factor * psi - args.accumulate * kept) * (n - 1) * item
                    if total != want:
                        raise AssertionError(
                            f"--zero {stage}: the ranks sent {total} bytes per step, not "
                            f"({factor}Ψ - {args.accumulate}·kept)(N-1)·itemsize = {want}")
                if comm.rank == 0:
                    tp = (f" x tp {args.tensor_parallel}" if args.tensor_parallel > 1 else "") \
                        + (f" x pp {args.pipeline_stages} {args.schedule}"
                           if args.pipeline_stages > 1 else "")
                    prec = "" if args.precision == "fp32" else \
                        f" {args.precision} ({skipped} skipped)"
                    print(f"[p={n}{tp}] {args.model} {opt_name} {dtype}{prec} --zero {stage} "
                          f"== --zero 0 bitwise over {args.steps} steps (Ψ={psi}); bytes/step "
                          f"rank 0: {sent:g}", flush=True)
                    if opt_name == args.optimizers.split(",")[0] and dtype == \
                            args.dtypes.split(",")[0]:
                        print("\n".join("    " + ln for ln in lines[:2]), flush=True)
    if comm.rank == 0:
        print("zero checks passed", flush=True)


if __name__ == "__main__":
    main()

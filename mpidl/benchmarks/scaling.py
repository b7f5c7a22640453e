"""Data-parallel training throughput, measured inside the ranks (``bench/scaling.py`` drives it).

One launch = one configuration::

    mpiexec -n N python -m mpidl.benchmarks.scaling mpidl --batch 128 --steps 60 --out r.json
    mpiexec -n N python -m mpidl.benchmarks.scaling torch --batch 128 --steps 60 --out r.json

``mpidl``: the MLP 784-1024-1024-10 (ReLU, softmax cross-entropy, SGD momentum 0.9,
float32) trained by mpidl's ``Trainer`` with the all-reduce runtime (``--strategy local``
for one plain process) on random in-memory data, so only the step is timed; the test
split is a few samples, so the trainer's evaluation after the last step costs nothing.
A ``StepTimer`` callback records on each rank every step's wall time after ``--warmup``
untimed steps (the trainer's loop iteration: the step and fetching its batch) and the
runtime's split of the timed steps (forward, backward, wait, update); with
``--timeline`` the communicator's Chrome trace gives the time the all-reduces really ran
(on the progress thread) and how much of it lay under backward. Rank 0 writes one JSON.

``torch``: the same MLP in PyTorch, ``DistributedDataParallel`` over gloo when N > 1
(one thread per process; the rank comes from the MPI launcher's environment, the
rendezvous from MASTER_ADDR/MASTER_PORT, which the driver sets).

Threads: OMP/OpenBLAS/MKL are pinned to 1 per rank before NumPy or torch is imported.
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
             "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from mpidl import env  # noqa: E402

SIZES = (784, 1024, 1024, 10)
LR, MOMENTUM = 0.01, 0.9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("framework", choices=["mpidl", "torch"])
    ap.add_argument("--batch", type=int, default=128, help="per-rank batch")
    ap.add_argument("--steps", type=int, default=60, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    ap.add_argument("--strategy", default="allreduce", help="mpidl: allreduce or local")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--bucket-mb", type=float, default=None)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--progress-wait", choices=["block", "poll"], default=None,
                    help="mpidl: how the progress thread waits (MPIDL_PROGRESS_WAIT): "
                    "inside MPI (block, MPICH spins) or polling and sleeping (poll; "
                    "affects the home-made algorithms, not MPI's own call)")
    ap.add_argument("--timeline", default=None,
                    help="mpidl: Chrome-trace path (with {rank}: one file per rank)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="mpidl: NumPy or CuPy arrays (on a GPU, ranks of a node share its "
                         "GPUs by node-local rank)")
    ap.add_argument("--out", required=True, help="JSON result (written by rank 0)")
    return ap.parse_args(argv)


def summarize(step_times, global_batch):
    t = np.asarray(step_times)
    med = float(np.median(t))
    return {"step_ms_median": 1e3 * med, "step_ms_mean": 1e3 * float(t.mean()),
            "step_ms_p10": 1e3 * float(np.percentile(t, 10)),
            "step_ms_p90": 1e3 * float(np.percentile(t, 90)),
            "images_per_sec": global_batch / med,
            "images_per_sec_mean": global_batch * len(t) / float(t.sum())}


# -- mpidl ---------------------------------------------------------------------------------------

def random_dataset(batch, count, steps, batches=4, seed=1, test=8):
    """Random images and labels for ``steps`` steps of ``count`` ranks x ``batch``: the
    data of ``batches`` global batches, seen again and again (an ``IndexedView``, nothing
    copied), so only the step is timed; and a ``test``-sample test split, so the
    trainer's evaluation at the end costs nothing."""
    from mpidl.benchmarks.callbacks import IndexedView  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    n = batches * batch * count
    x = rng.random((n + test, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, n + test)
    index = np.arange(steps * batch * count) % n
    return SimpleNamespace(train_x=IndexedView(x[:n], index), train_y=IndexedView(y[:n], index),
                           test_x=x[n:], test_y=y[n:])


def run_mpidl(args):
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.benchmarks.callbacks import StepTimer  # noqa: PLC0415
    from mpidl.comm import Communicator  # noqa: PLC0415
    from mpidl.engine import SGD, Flatten, Linear, ReLU, Sequential  # noqa: PLC0415
    from mpidl.runtime import build  # noqa: PLC0415
    from mpidl.runtime.sync.fused import overlap_pays  # noqa: PLC0415
    from mpidl.training.trainer import Trainer  # noqa: PLC0415

    if args.progress_wait:
        os.environ["MPIDL_PROGRESS_WAIT"] = args.progress_wait
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    # one process: the local runtime (no packing, no communication), which still
    # reports its time split
    local = args.strategy == "local" or size == 1
    timeline = None if local else args.timeline
    comm = None if local else Communicator(world, timeline=timeline)
    from mpidl import backend  # noqa: PLC0415

    backend.use(args.device, comm.local_rank if comm is not None else 0)
    rng = np.random.default_rng(0)
    layers = [Flatten()]
    for a, b in zip(SIZES[:-2], SIZES[1:-1]):
        layers += [Linear(a, b, rng=rng), ReLU()]
    layers.append(Linear(SIZES[-2], SIZES[-1], init="glorot_uniform", rng=rng))
    model = Sequential(*layers)
    opt = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    if local:
        runtime = build("local")
    else:
        options = {"algorithm": args.algorithm,
                   "overlap": "off" if args.no_overlap else "on"}
        if args.bucket_mb:
            options["bucket_mb"] = args.bucket_mb
        runtime = build(args.strategy, comm, **options)
    # what the default (overlap="auto") would choose here; collective
    auto_choice = overlap_pays(comm, model.named_parameters())
    _, count = runtime.shard()
    data = random_dataset(args.batch, count, args.warmup + args.steps)
    timer = StepTimer(args.warmup, args.steps)
    trainer = Trainer(model, opt, data, runtime=runtime, callbacks=[timer], epochs=1,
                      batch_size=args.batch, lr=LR, seed=0, progress=False,
                      eval_batch_size=len(data.test_y))
    trainer.fit()
    mine = {"rank": rank, "times": timer.times, "stats": timer.stats,
            "t_first": timer.t_first, "t_last": timer.t_last}
    describe = runtime.describe()
    # what algorithm="auto" takes for a 4 MiB all-reduce of these arrays
    resolves = (comm.selector.choose("allreduce", 1 << 22,
                                     staged=args.device == "gpu" and not comm.cuda_aware)
                if comm is not None else None)
    bucket_mb = next((s.bucket_mb for _, s in runtime.syncs if hasattr(s, "bucket_mb")),
                     None)
    if comm is not None:
        comm.close()  # writes the timeline
    gathered = world.gather(mine, root=0)
    if rank != 0:
        return
    n = args.steps
    # the step of the slowest rank sets the pace: take per step the max over ranks
    per_step = np.max(np.array([g["times"] for g in gathered]), axis=0)
    result = {"framework": "mpidl", "ranks": size, "batch_per_rank": args.batch,
              "global_batch": args.batch * size,
              "strategy": "local" if local else runtime.name,
              "algorithm": args.algorithm, "auto_resolves_to": resolves,
              "overlap": not args.no_overlap, "device": args.device,
              "progress_wait": env.get("MPIDL_PROGRESS_WAIT"),
              "overlap_auto": {"on": auto_choice[0], "why": auto_choice[1]},
              "bucket_mb": bucket_mb, "steps": n, "layout": describe}
    result.update(summarize(per_step, args.batch * size))
    phases = {}
    for key in ("forward", "backward", "wait", "update"):
        if all(key in g["stats"] for g in gathered):
            phases[key + "_ms"] = 1e3 * float(np.mean([g["stats"][key] for g in gathered])) / n
    if phases:
        phases["compute_ms"] = phases["forward_ms"] + phases["backward_ms"] + phases["update_ms"]
        result.update(phases)
    if timeline:
        path = timeline.format(rank=0) if "{rank}" in timeline else timeline
        result.update(timeline_summary(path, pid=0, last_steps=n))
    write_json(args.out, result)


def _merge(spans):
    spans = sorted(spans)
    out = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(spans, cover):
    """Total length of ``spans`` that lies inside the merged intervals ``cover``."""
    total = 0.0
    for a, b in spans:
        for c, d in cover:
            if d <= a:
                continue
            if c >= b:
                break
            total += min(b, d) - max(a, c)
    return total


def timeline_summary(path, pid=0, last_steps=None):
    """Per-step communication figures from a Chrome trace written by the communicator.

    comm_ms: time the bucket all-reduces ran (progress thread), per step;
    overlap_backward: the fraction of it that ran while backward was computing;
    hidden: the fraction that did not show up as waiting on the caller's thread.
    """
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    events = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid]
    backward = [e for e in events if e["name"] == "compute backward"]
    if last_steps:
        backward = backward[-last_steps:]
    if not backward:
        return {}
    t0 = backward[0]["ts"]
    allreduce = [e for e in events if e.get("cat") == "allreduce" and e["tid"] == 1
                 and e["ts"] >= t0 and str(e["name"]).startswith("allreduce bucket")]
    waits = [e for e in events if e.get("cat") == "wait" and e["ts"] >= t0]
    blocking = [e for e in events if e.get("cat") == "allreduce" and e["tid"] == 0
                and e["ts"] >= t0 and str(e["name"]).startswith("allreduce bucket")]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in allreduce + blocking]
    comm_us = sum(b - a for a, b in spans)
    bw = _merge([(e["ts"], e["ts"] + e["dur"]) for e in backward])
    under_bw = _overlap(spans, bw)
    wait_us = sum(e["dur"] for e in waits) + sum(e["dur"] for e in blocking)
    n = len(backward)
    out = {"timeline_comm_ms": comm_us / n / 1e3,
           "timeline_wait_ms": wait_us / n / 1e3,
           "overlap_backward": under_bw / comm_us if comm_us else 0.0,
           "hidden": max(0.0, 1.0 - wait_us / comm_us) if comm_us else 0.0}
    # GPU arrays staged through host memory in chunks: how much of the copying ran while
    # chunks were on the wire
    from mpidl.comm.timeline import TID_TO_DEVICE, TID_TO_HOST, TID_WIRE  # noqa: PLC0415

    staging = [e for e in events if e.get("cat") == "staging" and e["ts"] >= t0]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in staging
              if e["tid"] in (TID_TO_HOST, TID_TO_DEVICE)]
    wire = _merge([(e["ts"], e["ts"] + e["dur"]) for e in staging if e["tid"] == TID_WIRE])
    copy_us = sum(b - a for a, b in copies)
    if copy_us:
        out.update({"staged_copy_ms": copy_us / n / 1e3,
                    "staged_wire_ms": sum(b - a for a, b in wire) / n / 1e3,
                    "copies_under_transfers": _overlap(copies, wire) / copy_us})
    return out


# -- torch ---------------------------------------------------------------------------------------

def _env_rank():
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"), ("RANK", "WORLD_SIZE")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def run_torch(args):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    rank, size = _env_rank()
    if size > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.manual_seed(0)
    layers = [torch.nn.Flatten()]
    for a, b in zip(SIZES[:-2], SIZES[1:-1]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(SIZES[-2], SIZES[-1]))
    model = torch.nn.Sequential(*layers)
    if size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.rand(args.batch, 1, 28, 28, generator=g),
                torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(4)]

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    for i in range(args.warmup):
        step(*batches[i % 4])
    if size > 1:
        dist.barrier()
    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        step(*batches[i % 4])
        times.append(time.perf_counter() - t)
    if size > 1:
        gathered = [None] * size
        dist.all_gather_object(gathered, times)
    else:
        gathered = [times]
    if rank == 0:
        per_step = np.max(np.array(gathered), axis=0)
        result = {"framework": "torch-ddp-gloo" if size > 1 else "torch", "ranks": size,
                  "batch_per_rank": args.batch, "global_batch": args.batch * size,
                  "steps": args.steps, "torch": torch.__version__}
        result.update(summarize(per_step, args.batch * size))
        write_json(args.out, result)
    if size > 1:
        dist.barrier()  # the figures are written before any rank leaves
        sys.stdout.flush()
        sys.stderr.flush()
        # DDP's and gloo's threads often abort in C++ teardown here ("terminate called
        # without an active exception"), and the launcher then kills every rank: skip it
        os._exit(0)


def write_json(path, obj):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    if args.framework == "mpidl":
        run_mpidl(args)
    else:
        run_torch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

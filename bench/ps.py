"""Parameter server against all-reduce: throughput and time-to-accuracy, with and without
a straggler; and final accuracy of every mode after the same number of epochs.

    python bench/ps.py speed      # -> bench/results/ps.json + ps.png
    python bench/ps.py accuracy   # -> bench/results/ps_accuracy.json (mpidl train runs)

``speed``: the MLP (784-1024-1024-10) on Fashion-MNIST, W workers (default 3) with batch
128 each, SGD at a constant lr 0.05 with momentum 0.9 (async/SSP: lr 0.15, no momentum,
a quarter-epoch warm-up; see ASYNC below; or Adam for all, ``--optimizer adam``, with
async/SSP's rate from ``--async-lr``), for a fixed number of epochs of each
worker's shard; configurations allreduce (W ranks), ps-sync, async, ssp (s = 1, 4) and
backup (first W-1 of W) (W + 1 ranks: one server), each without and with one worker
slowed 2x (the runtime's ``straggler`` option: it sleeps as long as it computed, every
step). Every rank runs mpidl's ``Trainer``; the ``--epochs`` epochs are handed to it as
one long epoch (``mpidl.benchmarks.callbacks.batches_as_one_epoch``: the same batches in
the same order), so that no worker waits for the others between epochs, as the trainer's
end-of-epoch barrier would make it. During training nothing is evaluated: the
server (all-reduce: rank 0) keeps a copy of the parameters every ``--every`` seconds
(``Snapshots``, a trainer callback);
afterwards each copy is evaluated on the test set, giving accuracy against wall time and
the time to reach ``--target``. Models with BatchNorm (``--model cnn``) have their
running statistics recomputed for each copy on the first ``--calibrate`` training images
(the server never sees the workers' statistics). Throughput is images computed per second over all workers
(for backup, some of them are dropped). Also measured: the server's CPU time over its wall
time, against the same run with blocking MPI receives (MPICH polls inside them). Every
configuration runs ``--repeats`` times, interleaved, and the median is reported. The
figure to quote is the ratio sync / async (or ssp) time-to-target with the straggler:
absolute times move with the shared machine's load.

``accuracy``: ``mpidl train`` for allreduce (W ranks) and each PS mode (W + 1 ranks), the
model's recipe (cosine schedule) over ``--epochs``; reports the final test accuracy.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402
from mpidl.training.callbacks import Callback  # noqa: E402

# name, runtime options (ps preset) or None (allreduce)
SPEED_CONFIGS = [
    ("allreduce", None),
    ("ps-sync", {"mode": "sync"}),
    ("async", {"mode": "async"}),
    ("ssp-1", {"mode": "ssp", "staleness": 1}),
    ("ssp-4", {"mode": "ssp", "staleness": 4}),
    ("backup", {"mode": "backup"}),
]
EXTRA_SPEED_CONFIGS = [  # run with --only
    ("async-salr", {"mode": "async", "staleness_aware_lr": True}),
    ("ssp-1-salr", {"mode": "ssp", "staleness": 1, "staleness_aware_lr": True}),
    ("ssp-4-salr", {"mode": "ssp", "staleness": 4, "staleness_aware_lr": True}),
]
#: async/SSP: the recipe (lr 0.05, momentum 0.9) diverges with stale gradients; asynchrony
#: itself acts like momentum (about 1 - 1/W with W workers; Mitliagkas et al. 2016). So no
#: momentum, and lr 0.15 = the same step per sample as sync's lr/(1 - momentum) = 0.5 at
#: a 3x larger batch, with half an epoch of warm-up against the early instability.
ASYNC = ["--momentum", "0", "--lr", "0.15", "--warmup-epochs", "0.5"]
ACCURACY_CONFIGS = [
    ("allreduce", []),
    ("ps-sync", ["--mode", "sync"]),
    ("ps-sync-2-servers", ["--mode", "sync", "--servers", "2"]),
    ("async", ["--mode", "async"] + ASYNC),
    ("async-salr", ["--mode", "async", "--staleness-aware-lr"] + ASYNC + ["--lr", "0.3"]),
    ("ssp-1", ["--mode", "ssp", "--staleness", "1"] + ASYNC),
    ("ssp-4", ["--mode", "ssp", "--staleness", "4"] + ASYNC),
    ("backup", ["--mode", "backup"]),
    # n-softsync, async's settings: c = 1 is async with weighted gradients; c = W averages
    # W gradients per update, so W times the lr for async's step per sample
    ("softsync", ["--mode", "softsync"] + ASYNC + ["--lr", "0.45"]),
    ("softsync-1", ["--mode", "softsync", "--wait", "1"] + ASYNC),
]


# ----------------------------------------------------------------------------- one run

class RunClock(Callback):
    """Lines the ranks up after set-up, then measures this rank's run: wall and CPU time,
    its own loop's end (a fast worker is not charged for the straggler's tail), the
    images it computed, and its compute and straggler-sleep time (the schedule's)."""

    def __init__(self, world):
        self.world = world
        self.images = 0
        self.compute_s = self.straggle_s = 0.0
        self.loop_wall = None

    def on_fit_start(self, trainer):
        self.world.Barrier()  # every rank, servers included
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()

    def on_step_end(self, trainer, loss):
        sched = trainer.runtime.schedule
        self.images += trainer.loader.batch_size
        self.compute_s += sched.forward_s + sched.backward_s
        self.straggle_s += sched.straggle_s
        self.loop_wall = time.perf_counter() - self.t0

    def on_fit_end(self, trainer):
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0


def run_rank(a):
    """One configuration, on every rank of this launch; rank 0 writes ``a.out``."""
    from mpi4py import MPI

    from mpidl import backend
    from mpidl.benchmarks.callbacks import Snapshots, batches_as_one_epoch
    from mpidl.comm import Communicator
    from mpidl.data import BatchLoader, eval_batches, load_dataset
    from mpidl.engine.models import build_model
    from mpidl.engine.normalization import recalibrate_batchnorm
    from mpidl.engine.optim import SGD, Adam
    from mpidl.runtime import build
    from mpidl.runtime.sync.pushpull import summarize
    from mpidl.training.trainer import Trainer

    backend.use("cpu")
    world = MPI.COMM_WORLD
    ds = load_dataset("fashion-mnist", a.data_dir)
    model = build_model(a.model, input_shape=ds.input_shape, num_classes=ds.num_classes,
                        seed=a.seed)
    if a.optimizer == "adam":
        opt = Adam(model.named_parameters(), lr=a.lr)
    else:
        opt = SGD(model.named_parameters(), lr=a.lr, momentum=a.momentum)
    options = json.loads(a.ps) if a.ps else {}
    if a.straggler > 1:  # the last rank: a worker in either preset
        options["straggler"] = f"{world.size - 1}:{a.straggler}"
    if a.transient:  # transient:FACTOR:Q[:SEED] (bench/stragglers.py)
        options["straggler"] = a.transient
    if a.pace:  # emulated compute: seconds per sample (bench/stragglers.py)
        options["compute_pace"] = a.pace
    # poll_max_ms 0 is the anchor: blocking MPI receives (Poller longest=0)
    runtime = build("ps" if a.ps else "allreduce", Communicator(world), **options)
    index, count = runtime.shard()

    # the data: --epochs shuffled epochs of the (limited) training set, one after the
    # other; the trainer walks them as a single epoch, so no worker stops at an epoch's
    # end to wait for the others (the trainer's end-of-epoch barrier would make the fast
    # workers of async/SSP wait for the straggler there)
    x_train, y_train = ds.train_x, ds.train_y
    if a.limit_train:
        x_train, y_train = x_train[:a.limit_train], y_train[:a.limit_train]
    order = BatchLoader(x_train, y_train, a.batch, shard=(0, count), seed=a.seed)
    batches = [order.global_indices(e, s) for e in range(a.epochs) for s in range(len(order))]
    train_x, train_y = batches_as_one_epoch(x_train, y_train, batches, a.seed)
    # nothing is evaluated during training (the snapshots are, afterwards)
    data = SimpleNamespace(train_x=train_x, train_y=train_y, test_x=ds.test_x[:0],
                           test_y=ds.test_y[:0])

    def warmup(base_lr, total_steps, warmup_steps):  # linear over --warmup-steps steps
        def lr(step):
            return a.lr * min(1.0, (step + 1) / a.warmup_steps) if a.warmup_steps else a.lr
        return lr

    record = world.rank == 0  # the server, or (all-reduce) the first worker
    clock = RunClock(world)
    snaps = Snapshots(a.every, active=record)
    trainer = Trainer(model, opt, data, runtime=runtime, callbacks=[clock, snaps],
                      lr_schedule=warmup, epochs=1, batch_size=a.batch, lr=a.lr,
                      seed=a.seed, progress=False)
    trainer.fit()
    mine = {"rank": world.rank, "images": clock.images, "wall": clock.wall,
            "cpu": clock.cpu, "trains": runtime.trains_on_data}
    if runtime.trains_on_data:
        mine["loop_wall"] = clock.loop_wall  # this worker's own steps, before the others end
        mine["compute_s"] = round(clock.compute_s, 3)
        mine["straggle_s"] = round(clock.straggle_s, 3)
        if a.pace:  # did the real compute keep the emulated pace? (schedule.py)
            sched = runtime.schedule
            mine["pace"] = {"paced": sched.paced, "over_pace": sched.over_pace,
                            "worst_ratio": round(sched.worst_pace_ratio, 3)}
        sync = runtime.syncs[0][1]
        if getattr(sync, "worker", None) is not None:
            # the worker's counts; compute and straggler sleep are the schedule's (the
            # worker's own compute clock runs through the schedule's sleep)
            stats = dict(sync.worker.stats, compute_s=clock.compute_s,
                         straggle_s=clock.straggle_s)
            mine["worker"] = {k: round(v, 3) for k, v in stats.items()}
    per_rank = world.gather(mine)
    if not record:
        return
    # evaluate the copies now that training is over (timing is not disturbed)
    x_test, y_test = ds.test_x, ds.test_y
    if a.test_limit:
        x_test, y_test = x_test[:a.test_limit], y_test[:a.test_limit]
    named = model.named_parameters()
    model.eval()
    curve = []
    for t, params in snaps.items:
        for n, p in named:
            p.data[...] = params[n]
        recalibrate_batchnorm(model, ds.train_x[:a.calibrate])
        correct = 0
        for xb, yb in eval_batches(x_test, y_test, 1000):
            correct += int((model.forward(xb).argmax(axis=1) == yb).sum())
        curve.append((round(t, 3), correct / len(y_test)))
    workers = [r for r in per_rank if r["trains"]]
    train_wall = max(r["wall"] for r in workers)
    # each worker's images over its own loop time: a fast worker that finished early
    # is not charged for the straggler's tail
    out = {"images": sum(r["images"] for r in workers), "wall_s": train_wall,
           "images_per_sec": sum(r["images"] / r["loop_wall"] for r in workers),
           "curve": curve, "final_acc": curve[-1][1], "ranks": per_rank}
    if a.pace:
        out["pace"] = pace_summary(workers, a.pace)
    if a.ps:
        out.update(summarize(runtime.server.final_stats))
        out["server_cpu_fraction"] = per_rank[0]["cpu"] / per_rank[0]["wall"]
        out["useful_images_per_sec"] = out["images_per_sec"] * (
            out["ps_applied"] / max(1, out["ps_pushed"]))
    with open(a.out, "w") as f:
        json.dump(out, f)


def pace_summary(workers, pace):
    """Whether every worker's real compute stayed within its emulated (paced) time:
    computations (steps, or dealt portions) paced and over their pace, summed over the
    workers; the largest real compute over ``pace`` per sample on any of them (under 1:
    even an unslowed step had room); ``kept``: no computation overran."""
    paced = sum(r["pace"]["paced"] for r in workers)
    over = sum(r["pace"]["over_pace"] for r in workers)
    return {"pace_s_per_sample": pace, "paced": paced, "over_pace": over,
            "worst_ratio": max(r["pace"]["worst_ratio"] for r in workers),
            "kept": over == 0}


def poll_rank(a):
    """Rank 0 waits for one message from each other rank while they compute for
    ``a.seconds``; it waits with a blocking probe (MPICH polls inside) or with mpidl's
    sleeping probe. Reports the waiter's CPU time and the workers' work done."""
    import numpy as np
    from mpi4py import MPI

    from mpidl.ps.protocol import Poller

    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        cpu0, t0 = time.process_time(), time.perf_counter()
        poller = Poller(comm, longest=0 if a.how == "blocking" else 1e-3)
        buf = np.zeros(1)
        for _ in range(comm.size - 1):
            st = poller.wait(MPI.ANY_SOURCE, 5)
            comm.Recv(buf, source=st.Get_source(), tag=5)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        work = comm.gather(0)
        with open(a.out, "w") as f:
            json.dump({"waiter_cpu_s": cpu, "wall_s": wall, "work": sum(work)}, f)
    else:
        m = np.random.default_rng(comm.rank).random((256, 256))
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < a.seconds:
            m @ m
            n += 1
        comm.Send(np.ones(1), dest=0, tag=5)
        comm.gather(n)


def poll(a):
    """The server's waiting, measured: 4 ranks on this machine's cores."""
    os.makedirs(a.work, exist_ok=True)
    rows = {}
    for how, heavy in (("blocking", "0"), ("blocking", "1"), ("sleeping", "0"),
                       ("sleeping", "1")):
        key = f"{how}-probe, MPIR_CVAR_ENABLE_HEAVY_YIELD={heavy}"
        out = os.path.join(a.work, f"poll-{how}-{heavy}.json")
        env = launch_env(ROOT)
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = heavy
        cmd = [mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "mpi4py",
               os.path.abspath(__file__), "_poll", "--how", how, "--seconds",
               str(a.seconds), "--out", out]
        subprocess.run(cmd, env=env, check=True, timeout=120, stdout=subprocess.DEVNULL)
        with open(out) as f:
            r = json.load(f)
        r["waiter_cpu_fraction"] = r["waiter_cpu_s"] / r["wall_s"]
        rows[key] = r
        print(f"{key:50s} waiter CPU {100 * r['waiter_cpu_fraction']:5.1f}% of "
              f"{r['wall_s']:.1f} s, workers' GEMMs {r['work']}", flush=True)
    return rows


# ----------------------------------------------------------------------------- drivers

def time_to(curve, target):
    """First time the accuracy curve reaches ``target`` (linear between points)."""
    prev = None
    for t, acc in curve:
        if acc >= target:
            if prev is None or prev[1] >= target:
                return t
            (t0, a0) = prev
            return t0 + (t - t0) * (target - a0) / (acc - a0)
        prev = (t, acc)
    return None


def run_one(n, args, out, log, target, timeout):
    """Launch one ``_run`` on ``n`` ranks; its result, with its time to ``target``."""
    t = time.time()
    launch(n, args, timeout, log)
    with open(out) as f:
        r = json.load(f)
    r["time_to_target_s"] = time_to(r["curve"], target)
    r["launch_s"] = time.time() - t
    return r


def launch(n, args, timeout, log):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py"] + [str(a) for a in args]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=launch_env(ROOT),
                              timeout=timeout)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")


def speed(a):
    os.makedirs(a.work, exist_ok=True)
    results = {"machine": describe_machine(), "settings": vars(a), "runs": {}}
    if not a.no_anchor:
        results["waiting"] = poll(SimpleNamespace(work=a.work, ranks=a.workers + 1,
                                                  seconds=3.0))
    only = set(a.only.split(",")) if a.only else None
    configs = SPEED_CONFIGS + (EXTRA_SPEED_CONFIGS if only else [])
    plan = [(name, opts, f) for f in sorted({1.0, a.factor}) for name, opts in configs]
    if not a.no_anchor:
        plan.append(("ps-sync-blocking", {"mode": "sync", "poll_max_ms": 0}, 1.0))
    plan = [(name, opts, f, rep) for rep in range(a.repeats) for name, opts, f in plan]
    repeats = {}
    for name, opts, factor, rep in plan:
        key = f"{name}{'+straggler' if factor > 1 else ''}"
        if only and name not in only and key not in only:
            continue
        out = os.path.join(a.work, f"{key}.{rep}.json")
        n = a.workers + (0 if opts is None else 1)
        args = [os.path.abspath(__file__), "_run", "--out", out, "--epochs", a.epochs,
                "--batch", a.batch, "--lr", a.lr, "--every", a.every, "--seed", a.seed,
                "--model", a.model, "--straggler", factor, "--test-limit", a.test_limit,
                "--limit-train", a.limit_train, "--optimizer", a.optimizer]
        if opts is not None:
            opts = dict(opts)
            if opts.get("mode") == "backup":
                opts["wait"] = a.workers - 1
            if opts.get("mode") in ("async", "ssp"):  # see ASYNC above
                steps = (a.limit_train or 60000) // (a.batch * a.workers)
                # staleness-aware lr divides by the staleness, about W - 1 on average
                lr = a.async_lr * (max(1, a.workers - 1) if opts.get("staleness_aware_lr")
                                   else 1)
                args += ["--momentum", a.async_momentum, "--lr", lr,
                         "--warmup-steps", int(a.async_warmup * steps),
                         "--optimizer", a.async_optimizer or a.optimizer]
            args += ["--ps", json.dumps(opts)]
        if a.data_dir:
            args += ["--data-dir", a.data_dir]
        r = run_one(n, args, out, os.path.join(a.work, f"{key}.{rep}.log"), a.target,
                    a.timeout)
        repeats.setdefault(key, []).append(r)
        r = results["runs"][key] = median_run(repeats[key])
        print(f"{key:28s} {r['images_per_sec']:8.0f} img/s  final acc {r['final_acc']:.4f}  "
              f"to {a.target:.2f}: {fmt(r['time_to_target_s'])}"
              + (f"  server CPU {100 * r['server_cpu_fraction']:.0f}%"
                 if "server_cpu_fraction" in r else ""), flush=True)
    summarize_speed(results, a.target)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot, a.target)
    return results


def summarize_speed(results, target):
    """Ratios of sync's time to target over each configuration's; the goal's verdict."""
    runs = results["runs"]
    summary = {}
    for tag in ("", "+straggler"):
        sync = runs.get("ps-sync" + tag, {}).get("time_to_target_s")
        for name in ("allreduce", "async", "ssp-1", "ssp-4", "backup"):
            t = runs.get(name + tag, {}).get("time_to_target_s")
            if sync and t:
                summary[f"sync/{name}{tag}"] = sync / t
    if "ps-sync" in runs and "ps-sync-blocking" in runs:
        summary["server_cpu_sleeping_probe"] = runs["ps-sync"]["server_cpu_fraction"]
        summary["server_cpu_blocking_probe"] = runs["ps-sync-blocking"]["server_cpu_fraction"]
    results["speedup_vs_sync"] = summary
    best = max((v for k, v in summary.items() if k.endswith("+straggler")
                and (k.startswith("sync/async") or k.startswith("sync/ssp"))), default=None)
    results["goal"] = {"best_async_or_ssp_speedup_with_straggler": best,
                       "goal": 1.4, "met": bool(best and best >= 1.4)}
    for k, v in summary.items():
        print(f"  {k}: {v:.2f}")
    print(f"goal (with the straggler, async or SSP >= 1.4x faster than sync to "
          f"{target}): best {fmt(best, 'x')} -> {'met' if results['goal']['met'] else 'NOT met'}")
    return results


def resummarize(a):
    """Recompute medians, ratios and the plot of a finished ``speed`` run from its
    per-run files in ``--work`` (no training)."""
    with open(a.out) as f:
        results = json.load(f)
    for key in list(results["runs"]):
        reps = []
        for rep in range(100):
            path = os.path.join(a.work, f"{key}.{rep}.json")
            if not os.path.exists(path):
                break
            with open(path) as f:
                r = json.load(f)
            r["time_to_target_s"] = time_to(r["curve"], a.target)
            reps.append(r)
        if reps:
            results["runs"][key] = median_run(reps)
    summarize_speed(results, a.target)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot, a.target)


def median_run(runs):
    """One run's curve (the repeat nearest the median time to target) with the medians
    of the repeats' time to target (None if the median is not reached) and throughput,
    and every repeat's figures alongside."""
    import statistics

    times = [r["time_to_target_s"] if r["time_to_target_s"] is not None else float("inf")
             for r in runs]
    med = statistics.median(times)
    pick = min(range(len(runs)), key=lambda i: abs(times[i] - med)
               if med != float("inf") else -times[i])
    mid = dict(runs[pick])
    mid["time_to_target_s"] = med if med != float("inf") else None
    mid["images_per_sec"] = statistics.median(r["images_per_sec"] for r in runs)
    mid["repeats"] = [{"time_to_target_s": r["time_to_target_s"],
                       "images_per_sec": r["images_per_sec"]} for r in runs]
    return mid


def fmt(v, unit=" s"):
    return "-" if v is None else f"{v:.2f}{unit}"


def plot(results, path, target):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    runs = results["runs"]
    names = [n for n, _ in SPEED_CONFIGS]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, tag, title in ((axes[0], "", "no straggler"),
                           (axes[1], "+straggler", "one worker 2x slower")):
        for name in names:
            r = runs.get(name + tag)
            if r:
                t, acc = zip(*r["curve"])
                ax.plot(t, acc, marker=".", label=name)
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(f"test accuracy vs wall time — {title}")
        ax.set_xlabel("seconds")
        ax.set_ylim(max(0.5, target - 0.15), None)
        ax.legend(fontsize=8)
    ax = axes[2]
    width = 0.38
    xs = range(len(names))
    for off, tag, label in ((-width / 2, "", "no straggler"), (width / 2, "+straggler",
                                                                "straggler 2x")):
        vals = [runs.get(n + tag, {}).get("time_to_target_s") or 0 for n in names]
        ax.bar([x + off for x in xs], vals, width, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=20)
    ax.set_ylabel(f"seconds to {target:.0%} test accuracy (0: not reached)")
    ax.set_title("time to accuracy (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def accuracy(a):
    os.makedirs(a.work, exist_ok=True)
    mpidl = os.path.join(os.path.dirname(sys.executable), "mpidl")
    results = {"machine": describe_machine(), "settings": vars(a), "runs": {}}
    only = set(a.only.split(",")) if a.only else None
    if only and os.path.exists(a.out):  # re-run some: keep the others' results
        with open(a.out) as f:
            results["runs"] = json.load(f).get("runs", {})
    for name, flags in ACCURACY_CONFIGS:
        if only and name not in only:
            continue
        servers = int(flags[flags.index("--servers") + 1]) if "--servers" in flags else 1
        n = a.workers if name == "allreduce" else a.workers + servers
        metrics = os.path.join(a.work, f"acc-{name}.jsonl")
        if os.path.exists(metrics):
            os.unlink(metrics)
        cmd = [mpiexec(), "-n", str(n), mpidl, "train", "--model", a.model, "--epochs",
               str(a.epochs), "--seed", str(a.seed), "--no-progress", "--metrics", metrics,
               "--out-dir", os.path.join(a.work, f"acc-{name}"),
               "--strategy", "allreduce" if name == "allreduce" else "ps"] + flags
        if a.data_dir:
            cmd += ["--data-dir", a.data_dir]
        t = time.time()
        log = os.path.join(a.work, f"acc-{name}.log")
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=launch_env(ROOT),
                                  timeout=a.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed; see {log}")
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
        last = records[-1]
        results["runs"][name] = {"command": " ".join(cmd[1:]).replace(mpidl, "mpidl"),
                                 "ranks": n, "epochs": [r["test_acc"] for r in records],
                                 "test_acc": last["test_acc"], "wall_s": time.time() - t,
                                 **{k: v for k, v in last.items() if k.startswith("ps_")}}
        print(f"{name:20s} test_acc {last['test_acc']:.4f}  ({time.time() - t:.0f} s)",
              flush=True)
    ref = results["runs"].get("allreduce", {}).get("test_acc")
    if ref is not None:
        for name, r in results["runs"].items():
            r["minus_allreduce_points"] = round(100 * (r["test_acc"] - ref), 2)
            r["within_1_point"] = abs(r["test_acc"] - ref) <= 0.01
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| run | ranks | test acc per epoch | final | vs allreduce (points) |")
    print("|---|---|---|---|---|")
    for name, r in results["runs"].items():
        print(f"| {name} | {r['ranks']} | {', '.join(f'{v:.4f}' for v in r['epochs'])} | "
              f"{r['test_acc']:.4f} | {r.get('minus_allreduce_points', 0):+.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workers", type=int, default=3)
    common.add_argument("--model", default="mlp")
    common.add_argument("--seed", type=int, default=1)
    common.add_argument("--data-dir", default=None)
    common.add_argument("--only", default=None, help="comma-separated run names "
                        "(async: with and without the straggler; async+straggler: with)")
    common.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-ps"),
                        help="folder for per-run logs and results")
    common.add_argument("--timeout", type=float, default=1800)
    s = sub.add_parser("speed", parents=[common])
    s.add_argument("--epochs", type=int, default=2, help="epochs of each worker's shard")
    s.add_argument("--batch", type=int, default=128)
    s.add_argument("--lr", type=float, default=0.05)
    s.add_argument("--async-momentum", type=float, default=0.0,
                   help="momentum for async/SSP (sync and all-reduce use 0.9)")
    s.add_argument("--async-lr", type=float, default=0.15, help="lr for async/SSP")
    s.add_argument("--async-warmup", type=float, default=0.25,
                   help="linear lr warm-up for async/SSP, in epochs")
    s.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd (momentum 0.9) or adam (betas 0.9, 0.999), at --lr")
    s.add_argument("--async-optimizer", choices=("sgd", "adam"), default=None,
                   help="optimizer for async/SSP (default: --optimizer)")
    s.add_argument("--every", type=float, default=0.5, help="seconds between snapshots")
    s.add_argument("--target", type=float, default=0.85)
    s.add_argument("--factor", type=float, default=2.0, help="straggler slowdown")
    s.add_argument("--limit-train", type=int, default=0, help="train on the first N "
                   "training images (0: all 60000; for quick checks)")
    s.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N "
                   "test images (0: all 10000)")
    s.add_argument("--no-anchor", action="store_true", help="skip the blocking-probe run")
    s.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every "
                   "configuration; the median is reported (3)")
    s.add_argument("--out", default=os.path.join(HERE, "results", "ps.json"))
    s.add_argument("--plot", default=os.path.join(HERE, "results", "ps.png"))
    c = sub.add_parser("accuracy", parents=[common])
    c.add_argument("--epochs", type=int, default=4)
    c.add_argument("--out", default=os.path.join(HERE, "results", "ps_accuracy.json"))
    r = sub.add_parser("_run")  # one configuration, inside mpiexec
    for flag, typ, default in (("--out", str, None), ("--epochs", int, 2),
                               ("--batch", int, 128), ("--lr", float, 0.05),
                               ("--momentum", float, 0.9), ("--warmup-steps", int, 0),
                               ("--every", float, 0.5), ("--seed", int, 1),
                               ("--model", str, "mlp"), ("--straggler", float, 1.0),
                               ("--test-limit", int, 0), ("--ps", str, None),
                               ("--calibrate", int, 2000), ("--limit-train", int, 0),
                               ("--data-dir", str, None), ("--optimizer", str, "sgd"),
                               ("--transient", str, None), ("--pace", float, 0.0)):
        r.add_argument(flag, type=typ, default=default)
    m = sub.add_parser("summarize", parents=[common])
    m.add_argument("--target", type=float, default=0.85)
    m.add_argument("--out", default=os.path.join(HERE, "results", "ps.json"))
    m.add_argument("--plot", default=os.path.join(HERE, "results", "ps.png"))
    q = sub.add_parser("_poll")
    q.add_argument("--how", default="sleeping")
    q.add_argument("--seconds", type=float, default=3.0)
    q.add_argument("--out")
    a = ap.parse_args(argv)
    if a.cmd == "_run":
        return run_rank(a)
    if a.cmd == "_poll":
        return poll_rank(a)
    if a.cmd == "summarize":
        return resummarize(a)
    return speed(a) if a.cmd == "speed" else accuracy(a)


if __name__ == "__main__":
    main()

"""ZeRO's memory per rank, measured beside the formula, and each stage's step time.

    python bench/memory.py                 # -> bench/results/memory.json + memory.png
    python bench/memory.py --quick         # a small model, N = 1, 2 (the test's)
    python bench/memory.py --time-only     # only the step times at p = 2
    python bench/memory.py --memory-only --precision bf16 --out bench/results/memory_bf16.json

Memory: an MLP 784-4096-4096-10 (20 M parameters, Adam, float32) on N = 1, 2, 4, 8 ranks
at every ZeRO stage. Each rank traces its allocations (``tracemalloc``, which sees every
NumPy array) from just before the model is built (after the imports), trains ``--steps`` steps on random batches
of ``--batch`` per rank and reports, for its last step: the memory ledger
(``Runtime.memory``: parameters, gradients, optimizer state, communication buffers), the
activations kept for backward, the ledger's ``mem_peak`` (ledger + activations + the
gradients backward makes before they are packed, an upper bound of the step's high
water mark), ``tracemalloc``'s peak during that step, and the formula
(``mpidl.runtime.memory.predict``). The ranks oversubscribe 2 cores at N = 4, 8: memory
does not care. ``--precision bf16|fp16``: the same in mixed precision (2-byte working
copies and gradients, the float32 masters sharded with the optimizer state), against
ZeRO's mixed-precision formula.

Time: at p = 2 (one rank per core) ``--time-steps`` steps of each stage, and of stage 3
with ``--zero-reuse on``, ring algorithm, stage 0 as the anchor in the same run, the
median step; stage 3 against stage 1 as the median of the rounds' ratios (each round
runs every configuration in turn); and whether stage 3's prefetched gathers overlap
compute (``param_prefetched`` of ``param_gathers``). Memory is measured for every
configuration too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402


def rank_main(a):
    """One configuration on every rank of this launch; rank 0 prints a JSON line."""
    import tracemalloc

    import numpy as np

    from mpidl.comm import Communicator
    from mpidl.engine import SoftmaxCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_optimizer
    from mpidl.runtime import build, memory

    comm = Communicator(timeline=a.timeline)
    r, n = comm.rank, comm.size
    # compile the optimizer's fast kernels first (Numba's compiler keeps tens of MiB of
    # Python objects): what is traced from here on is the training's own memory
    warm = build_model("mlp", (1, 2, 2), 2, seed=0, hidden=(2,))
    for _, p in warm.named_parameters():
        p.grad = np.ones_like(p.data)
    make_optimizer("adam", warm.named_parameters(), lr=1e-4).step()
    del warm
    tracemalloc.start()
    hidden = tuple(int(h) for h in a.hidden.split(","))
    model = build_model("mlp", (1, 28, 28), 10, seed=0, hidden=hidden)
    opt = make_optimizer("adam", model.named_parameters(), lr=1e-4)
    sizes = memory.bucket_sizes(model.named_parameters(), 4.0, a.precision)
    options = {"algorithm": "ring", "overlap": "off"}
    if a.precision != "fp32":
        options["precision"] = a.precision
    if a.stage:
        options["zero"] = a.stage
    if a.reuse:
        options["zero_reuse"] = "on"
    rt = build("allreduce", comm, **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    rng = np.random.default_rng(r)
    x = rng.standard_normal((a.batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=a.batch)
    times = []
    for step in range(a.steps):
        if step == a.steps - 1:
            rt.metrics()  # the ledger is taken at the first step after a reset: this one
            tracemalloc.reset_peak()
        comm.barrier()
        t = time.perf_counter()
        rt.train_step(x, y)
        times.append(time.perf_counter() - t)
    _, peak = tracemalloc.get_traced_memory()
    m = rt.metrics()
    want = memory.predict(sizes, n, a.stage, slots=2, rank=r, precision=a.precision)
    mine = {k: m[k] for k in m if k.startswith("mem_")}
    mine.update(rank=r, tracemalloc_peak=peak, formula=want.as_dict(),
                step_s=times[1:] or times, param_gathers=m.get("param_gathers"),
                param_prefetched=m.get("param_prefetched"), param_reused=m.get("param_reused"))
    rows = comm.mpi.gather(mine, root=0)
    if r == 0:
        print("MEMORY " + json.dumps({"ranks": n, "stage": a.stage, "reuse": a.reuse,
                                      "precision": a.precision, "per_rank": rows,
                                      "parameters": int(sum(sizes))}), flush=True)
    comm.close()


#: (stage, --zero-reuse on) of every configuration measured
CONFIGS = [(0, False), (1, False), (2, False), (3, False), (3, True)]


def label(stage, reuse):
    return f"{stage}{' + reuse' if reuse else ''}"


def launch(n, stage, a, steps, batch, timeline=None, reuse=False):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", __file__, "--rank",
           "--stage", str(stage), "--hidden", a.hidden, "--steps", str(steps),
           "--batch", str(batch), "--precision", a.precision] + \
        (["--timeline", timeline] if timeline else []) + \
        (["--reuse"] if reuse else [])
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=launch_env(ROOT), timeout=3600)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("MEMORY "))
    return json.loads(line[len("MEMORY "):])


def gathers_under_compute(path, pid=0):
    """Stage 3's parameter gathers on rank ``pid``'s timeline, per step: the prefetched
    ones (the progress thread) and how much of them ran while forward or backward was
    computing; the exposed ones (blocking gathers and waits for a prefetch)."""
    from mpidl.benchmarks.scaling import _merge, _overlap

    with open(path, encoding="utf-8") as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("pid") == pid]
    compute = [e for e in events if e["name"] in ("compute forward", "compute backward")]
    steps = max(1, sum(e["name"] == "compute forward" for e in compute))
    gathers = [e for e in events if e.get("cat") == "allgather"
               and str(e["name"]).endswith(".params")]
    prefetched = [(e["ts"], e["ts"] + e["dur"]) for e in gathers if e["tid"] == 1]
    blocking = sum(e["dur"] for e in gathers if e["tid"] == 0)
    waits = sum(e["dur"] for e in events if e.get("cat") == "wait"
                and str(e["name"]).endswith(".params"))
    total = sum(b - a for a, b in prefetched)
    under = _overlap(prefetched, _merge([(e["ts"], e["ts"] + e["dur"]) for e in compute]))
    return {"prefetched_ms": total / steps / 1e3,
            "prefetched_under_compute": under / total if total else 0.0,
            "exposed_ms": (blocking + waits) / steps / 1e3,
            "blocking_ms": blocking / steps / 1e3, "wait_ms": waits / steps / 1e3}


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    mib = 2 ** 20
    for stage in range(4):
        runs = sorted((r for r in result["memory"]
                       if r["stage"] == stage and not r.get("reuse")),
                      key=lambda r: r["ranks"])
        if not runs:
            continue
        ns = [r["ranks"] for r in runs]
        held = [sum(r["per_rank"][0][k] for k in ("mem_params", "mem_grads",
                                                  "mem_optimizer")) / mib for r in runs]
        formula = [r["per_rank"][0]["formula"]["total"] / mib for r in runs]
        peak = [r["per_rank"][0]["tracemalloc_peak"] / mib for r in runs]
        line, = ax1.plot(ns, held, marker="o", label=f"stage {stage}: ledger")
        ax1.plot(ns, formula, ls="--", color=line.get_color(), label="formula")
        ax1.plot(ns, peak, ls=":", marker="x", color=line.get_color(),
                 label="tracemalloc peak")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("ranks N")
    ax1.set_ylabel("MiB on rank 0")
    fmt = result["settings"].get("precision", "fp32")
    ax1.set_title(f"{result['parameters'] / 1e6:.1f} M parameters, Adam, "
                  f"{'float32' if fmt == 'fp32' else fmt + ' (CPU emulation)'}")
    ax1.legend(fontsize=6, ncol=2)
    t = result.get("time")
    if t:
        ax2.bar([row.get("config", str(row["stage"])) for row in t["stages"]],
                [row["ratio_to_stage0"] for row in t["stages"]])
        ax2.axhline(1.0, color="k", lw=0.8)
        ax2.set_xlabel("ZeRO stage")
        ax2.set_ylabel("median step time / stage 0's (p = 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--reuse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", default="4096,4096")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--time-steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timing rounds, the four stages in turn in each (default 3)")
    ap.add_argument("--timeline", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    a = ap.parse_args()
    if a.rank:
        return rank_main(a)
    if a.quick:
        a.hidden, a.ranks, a.time_steps = "256,256", "1,2", 4
    result = {"machine": describe_machine(), "settings": vars(a).copy(), "memory": [],
              # the ranks' glibc malloc thresholds (mpidl.allocator; the launches inherit it)
              "MPIDL_MALLOC_KEEP": os.environ.get("MPIDL_MALLOC_KEEP", "1")}
    if not a.time_only:
        for n in map(int, a.ranks.split(",")):
            for stage, reuse in CONFIGS:
                run = launch(n, stage, a, a.steps, a.batch, reuse=reuse)
                result["memory"].append(run)
                result["parameters"] = run["parameters"]
                r0 = run["per_rank"][0]
                held = sum(r0[k] for k in ("mem_params", "mem_grads", "mem_optimizer"))
                bound = r0["mem_peak"]
                print(f"N={n} stage {label(stage, reuse)}: ledger {held / 2**20:.2f} MiB (formula "
                      f"{r0['formula']['total'] / 2**20:.2f}), comm "
                      f"{r0['mem_comm'] / 2**20:.2f}, activations "
                      f"{r0['mem_activations'] / 2**20:.2f}, mem_peak {bound / 2**20:.2f}"
                      f", tracemalloc peak {r0['tracemalloc_peak'] / 2**20:.2f} MiB "
                      f"({r0['tracemalloc_peak'] / bound:.3f} of mem_peak)", flush=True)
    if a.memory_only:
        return finish(result, a)
    medians = {c: [] for c in CONFIGS}
    runs = {}
    for _ in range(a.rounds):  # the stages in turn, so the machine's drift hits them alike
        for stage, reuse in CONFIGS:
            run = launch(2, stage, a, a.time_steps, a.batch, reuse=reuse)
            step = sorted(run["per_rank"][0]["step_s"])
            medians[stage, reuse].append(step[len(step) // 2])
            runs[stage, reuse] = run
            result.setdefault("parameters", run["parameters"])
    rows = []
    for stage, reuse in CONFIGS:
        r0 = runs[stage, reuse]["per_rank"][0]
        rows.append({"stage": stage, "reuse": reuse, "config": label(stage, reuse),
                     "median_step_s": statistics.median(medians[stage, reuse]),
                     "round_medians_s": medians[stage, reuse],
                     "param_gathers": r0["param_gathers"],
                     "param_prefetched": r0["param_prefetched"],
                     "param_reused": r0["param_reused"]})
    for row in rows:
        row["ratio_to_stage0"] = row["median_step_s"] / rows[0]["median_step_s"]
        print(f"p=2 stage {row['config']}: median step {1e3 * row['median_step_s']:.1f} ms, "
              f"{row['ratio_to_stage0']:.3f}x stage 0", flush=True)
    result["time"] = {"stages": rows, "rounds": a.rounds}
    for key, reuse in (("stage3", False), ("stage3_reuse", True)):
        per_round = [s3 / s1 for s1, s3 in zip(medians[1, False], medians[3, reuse])]
        result["time"][f"{key}_over_stage1"] = statistics.median(per_round)
        result["time"][f"{key}_over_stage1_per_round"] = per_round
        print(f"stage {label(3, reuse)} / stage 1 at p=2: "
              f"{result['time'][f'{key}_over_stage1']:.3f}x "
              f"(rounds: {', '.join(f'{x:.3f}' for x in per_round)})")
    for key, reuse in (("stage3", False), ("stage3_reuse", True)):
        with tempfile.TemporaryDirectory() as d:  # once more, its timeline recorded
            path = os.path.join(d, "timeline.json")
            launch(2, 3, a, a.time_steps, a.batch, timeline=path, reuse=reuse)
            t = result["time"][f"{key}_timeline"] = gathers_under_compute(path)
        print(f"stage {label(3, reuse)} timeline, rank 0: prefetched gathers "
              f"{t['prefetched_ms']:.1f} ms a step, {100 * t['prefetched_under_compute']:.0f} "
              f"% of it under forward/backward; gathers waited for {t['exposed_ms']:.1f} ms "
              "a step")
    if a.time_only and os.path.exists(a.out):  # keep the memory part of an earlier run
        with open(a.out) as f:
            result["memory"] = json.load(f).get("memory", [])
    finish(result, a)


def finish(result, a):
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(a.out)[0] + ".png")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

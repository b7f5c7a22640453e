"""Memory at start-up: each rank's peak while a split model is built and set up, eagerly
and lazily (``mpidl.engine.lazy``), against the whole model's size.

    python bench/startup_memory.py            # -> bench/results/startup_memory.json + .png
    python bench/startup_memory.py --quick    # a small model, N = 2

An MLP of 784-4096-4096-4096-10 in float32 (37.8 M parameters, 151 MB) on N = 2, 4 and 8
ranks under ``--tensor-parallel N``, ``--pipeline-stages N`` (the cut balanced one cost
per layer) and ``--zero 3`` over N ranks, SGD with momentum. Each rank traces its NumPy
allocations (``tracemalloc``) from just before the model is built to the end of the
runtime's set-up and reports the peak, what it keeps of the parameters (the ledger's
``mem_params``) and what else the ledger holds (gradient buckets, ZeRO's gradient chunks
and communication buffer: what training needs anyway). The eager build is the anchor,
measured in the same run: every rank draws the whole model before the runtime cuts it.
Memory does not depend on timing, so 8 ranks on 2 cores measure it as well as 8 cores.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402

LAYOUTS = {"tensor parallel": {"tensor_parallel": None},
           "pipeline": {"pipeline_stages": None, "stage_costs": "layers"},
           "zero 3": {"zero": 3}}


def rank_main(a):
    """One layout and build on every rank of this launch; rank 0 prints a JSON line."""
    import tracemalloc

    from mpidl.comm import Communicator
    from mpidl.engine import SGD, SoftmaxCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.runtime import build

    comm = Communicator()
    options = {k: comm.size if v is None else v for k, v in LAYOUTS[a.layout].items()}
    rt = build("allreduce", comm, **options)
    hidden = tuple(int(h) for h in a.hidden.split(","))
    comm.barrier()
    tracemalloc.start()
    model = build_model("mlp", (1, 28, 28), 10, seed=0, hidden=hidden, lazy=a.lazy)
    whole = sum(p.data.nbytes for _, p in model.named_parameters())  # (before the cut)
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = rt.memory()
    mine = {"rank": comm.rank, "peak": peak, "mem_params": held["mem_params"],
            "runtime_buffers": sum(v for k, v in held.items()
                                   if k not in ("mem_params", "mem_peak"))}
    rows = comm.mpi.gather(mine, root=0)
    if comm.rank == 0:
        print("STARTUP " + json.dumps({"layout": a.layout, "ranks": comm.size,
                                       "lazy": a.lazy, "whole_bytes": whole,
                                       "per_rank": rows}), flush=True)
    comm.close()


def launch(n, layout, lazy, a):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", __file__, "--rank",
           "--layout", layout, "--hidden", a.hidden] + (["--lazy"] if lazy else [])
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=launch_env(ROOT), timeout=1800)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("STARTUP "))
    return json.loads(line[len("STARTUP "):])


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(13, 4), sharey=True)
    whole = runs[0]["whole_bytes"] / 1e6
    for ax, layout in zip(axes, LAYOUTS):
        for lazy, style in ((False, "s--"), (True, "o-")):
            rs = [r for r in runs if r["layout"] == layout and r["lazy"] == lazy]
            ns = [r["ranks"] for r in rs]
            ax.plot(ns, [max(p["peak"] for p in r["per_rank"]) / 1e6 for r in rs], style,
                    label=("lazy" if lazy else "eager") + " build: peak (largest rank)")
            if lazy:
                ax.plot(ns, [max(p["mem_params"] + p["runtime_buffers"]
                                 for p in r["per_rank"]) / 1e6 for r in rs], ":",
                        label="kept + the runtime's buffers (ledger)")
        ax.axhline(whole, color="grey", lw=1, label=f"the whole model ({whole:.0f} MB)")
        ax.set_title(layout)
        ax.set_xlabel("ranks")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MB per rank while built and set up")
    axes[0].legend(fontsize=7)
    fig.suptitle("start-up memory per rank: MLP 784-4096x3-10, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="zero 3", help=argparse.SUPPRESS)
    ap.add_argument("--lazy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", default="4096,4096,4096")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "startup_memory.json"))
    a = ap.parse_args()
    if a.rank:
        return rank_main(a)
    if a.quick:
        a.hidden, a.ranks = "256,256,256", "2"
    result = {"machine": describe_machine(), "settings": vars(a).copy(), "runs": []}
    for n in map(int, a.ranks.split(",")):
        for layout in LAYOUTS:
            for lazy in (False, True):
                run = launch(n, layout, lazy, a)
                result["runs"].append(run)
                worst = max(run["per_rank"], key=lambda p: p["peak"])
                print(f"N={n} {layout}, {'lazy' if lazy else 'eager'}: peak "
                      f"{worst['peak'] / 1e6:.1f} MB (rank {worst['rank']}; it keeps "
                      f"{worst['mem_params'] / 1e6:.1f} MB, the runtime's buffers "
                      f"{worst['runtime_buffers'] / 1e6:.1f} MB) of a "
                      f"{run['whole_bytes'] / 1e6:.1f} MB model", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    png = plot(result, os.path.splitext(a.out)[0] + ".png")
    print(a.out + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()

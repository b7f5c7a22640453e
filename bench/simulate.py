"""The cost model (``mpidl simulate``) against measured steps, and its scaling prediction.

    python bench/simulate.py            # time: predicted vs measured step, 2 and 4 ranks
    python bench/simulate.py --quick    # fewer repeats and steps
    python bench/simulate.py --scale    # scale: mlp and cnn to 4096 ranks on a GPU cluster
    sudo python bench/simulate.py --vcluster 1gbit   # time: 2 nodes x 1 rank, 1 Gbit/s links
    sudo python bench/simulate.py --vcluster 1gbit --ppn 2   # 2 nodes x 2 ranks (emulated)
    sudo python bench/simulate.py --vcluster 1gbit --algorithms ps   # the parameter server

Time (writes bench/results/simulate_time.json + .png): each repeat first calibrates this
machine in the same run (``mpiexec -n P mpidl simulate --calibrate``: alpha, beta, gamma,
per-layer compute of the model at the batch size with all P ranks computing at once),
then, for the ring, tree and recursive doubling, overlap off and on, measures the mean
step of the data-parallel runtime on P ranks (random in-memory data: only the step is
timed) and asks ``mpidl simulate --json`` for its prediction (calibrating again before
each configuration unless ``--calibrate-every repeat``). Measured figures are the
median over the repeats (run in rotation, so drift on this shared machine spreads over
every configuration); the error is (predicted - measured) / measured.

- 2 ranks: the mlp's real compute (2 ranks on the 2 cores).
- 4 ranks: oversubscribed (2 cores), so each rank's compute is EMULATED: the runtime's
  ``compute_pace`` makes forward + backward take PACE seconds per sample (it sleeps what
  the real compute leaves), and the prediction is given the same pace
  (``--compute-s-per-sample``). What is predicted there is the communication and the
  update around a known compute.

Virtual cluster (``--vcluster RATE``, root: ``slurm/vcluster.sh``; writes
bench/results/simulate_time_vcluster_RATE.json + .png): the same on 2 nodes x 1 rank
joined by links of RATE (tbf), so the calibration measures alpha and beta between the
nodes and each rank has a core of its own (real compute). ``--ppn 2``: 2 nodes x 2 ranks
(4 ranks on 2 cores: emulated compute, as above) and the hierarchical all-reduce too;
the results file is then ..._vcluster_RATE_2x2. The script brings the cluster up if it
is down (and takes it down at the end).

``--algorithms ps`` (or a list with it): the parameter server (``--strategy ps --mode
sync``, one server: rank 0; the others push to it) instead of, or beside, the
all-reduces; overlap does not apply to it (one run, "off"); the step is the workers'
slowest mean step; results files end in ``_ps`` when only the server runs.

Scale (writes bench/results/simulate_scale.json + .png): ``mpidl simulate --ranks
1-4096`` for the mlp, the cnn and gpt-tiny on the cluster described in
bench/machines/gpu_cluster.json (8 GPUs per node, 200 Gbit/s between nodes), under each
modelled strategy (``STRATEGIES``: the ring, hierarchical and recursive-doubling
all-reduce, ZeRO 3, DiLoCo every 32 steps, the parameter server with a node of 8
servers, tensor parallelism over 4 ranks of a node with data parallelism across), with
the rank count where the predicted efficiency falls below 50 %. No compressor: the model
times a compressor's own work on the machine it runs on (this CPU), which says nothing
of a GPU cluster's. The mlp's and the cnn's compute is what mpidl measured on an H100;
gpt-tiny's was not measured there, so it stands in: the mlp's measured seconds per
sample scaled by the ratio of their training FLOPs (``gpt_pace``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MACHINES = os.path.join(ROOT, "bench", "machines")
sys.path.insert(0, ROOT)

ALGORITHMS = ("ring", "tree", "recursive_doubling")
MODEL, BATCH = "mlp", 64
PACE_4 = 0.003  # s/sample of emulated compute at 4 ranks (above the oversubscribed real one)
BATCH_4 = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scale", action="store_true", help="the 4096-rank prediction instead")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--algorithm", default="ring", help=argparse.SUPPRESS)
    p.add_argument("--overlap", default="off", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    p.add_argument("--pace", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--vcluster", default=None, metavar="RATE",
                   help="run on slurm/vcluster.sh's 2 nodes with links of RATE (root)")
    p.add_argument("--ppn", type=int, default=1, help="ranks per node on the virtual cluster")
    p.add_argument("--algorithms", default=None, metavar="A,B",
                   help="what to time: all-reduce algorithms and/or ps (default: ring, "
                   "tree, recursive_doubling, and hierarchical on 2 nodes x 2)")
    p.add_argument("--calibrate-every", choices=("config", "repeat"), default="config",
                   help="calibrate before every configuration (default: the prediction "
                   "and the run it is compared with are a minute apart at most) or once "
                   "per repeat")
    p.add_argument("--repredict", nargs="+", metavar="JSON", default=None,
                   help="predict the runs of these results files again with today's "
                   "model, from their stored calibrations (nothing is measured)")
    p.add_argument("--out", default=RESULTS)
    return p.parse_args(argv)


# ------------------------------------------------------------------ the measured step
def worker(a):
    """Under mpiexec: the mean step time of the data-parallel runtime (rank 0 prints)."""
    from mpidl.threads import share_blas_threads

    share_blas_threads()
    import numpy as np
    from mpi4py import MPI

    from mpidl.comm import Communicator
    from mpidl.engine import SGD, SoftmaxCrossEntropy
    from mpidl.engine.models import build_model
    from mpidl.runtime import build

    comm = Communicator(MPI.COMM_WORLD)
    model = build_model(MODEL, input_shape=(1, 28, 28), num_classes=10, seed=0)
    opt = SGD(model.named_parameters(), lr=0.01, momentum=0.9, fused=False)
    ps = a.algorithm == "ps"
    options = {"servers": 1, "mode": "sync"} if ps else {"algorithm": a.algorithm,
                                                         "overlap": a.overlap}
    if a.pace:
        options["compute_pace"] = a.pace
    rt = build("ps" if ps else "allreduce", comm, **options)
    rt.setup(model, opt, SoftmaxCrossEntropy())
    step, m = None, {}
    if rt.trains_on_data:
        rng = np.random.default_rng(comm.rank)
        x = rng.standard_normal((a.batch, 1, 28, 28)).astype("float32")
        y = rng.integers(0, 10, size=a.batch)
        warm = 5
        for _ in range(warm):
            rt.train_step(x, y)
        if not ps:  # (a server serves: no collective over every rank until the end)
            rt.metrics()
            comm.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            rt.train_step(x, y)
        step = (time.perf_counter() - t0) / a.steps
        m = {} if ps else rt.metrics()
    else:  # the server: serves until every worker is done
        rt.serve()
    rt.finish()
    steps = [s for s in comm.mpi.gather(step, root=0) or () if s is not None]
    if comm.rank == 0:
        print(json.dumps({"step_s": max(steps), "compute_ms": m.get("compute_ms"),
                          "wait_ms": m.get("wait_ms"), "overlap": m.get("overlap")}),
              flush=True)
    comm.close()


VCLUSTER = os.path.join(ROOT, "slurm", "vcluster.sh")
_ON_VCLUSTER = []  # set by --vcluster: launches go across its nodes, one rank per node


def launcher(p):
    """The command prefix that starts ``p`` ranks."""
    from mpidl.benchmarks.machine import mpiexec

    if _ON_VCLUSTER:
        return ["bash", VCLUSTER, "mpiexec", "-n", str(p), "-ppn", str(p // 2)]
    return [mpiexec(), "-n", str(p)]


def _env():
    from mpidl.benchmarks.machine import bench_env

    return bench_env(ROOT, "mpidl-bench-simulate-none")


def _run(cmd, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                       cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r.stdout


def _last_json(text):
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def mpidl_cmd():
    return [sys.executable, "-m", "mpidl.cli.main"]


def measure(p, algorithm, overlap, batch, pace, steps):
    cmd = launcher(p) + [sys.executable, os.path.abspath(__file__), "--worker",
           "--algorithm", algorithm, "--overlap", overlap, "--batch", str(batch),
           "--steps", str(steps)] + (["--pace", str(pace)] if pace else [])
    return _last_json(_run(cmd))


def calibrate(p, batch, path):
    out = _run(launcher(p) + mpidl_cmd() + [
        "simulate", "--calibrate", "--model", MODEL, "--batch-size", str(batch),
        "--fused-optimizer", "off", "--machine", path, "--json"])
    return _last_json(out)


def predict(p, algorithm, overlap, batch, pace, machine):
    how = ["--strategy", "ps", "--servers", "1"] if algorithm == "ps" else [
        "--algorithm", algorithm, "--overlap", overlap]
    cmd = mpidl_cmd() + ["simulate", "--model", MODEL, "--batch-size", str(batch),
                         "--ranks", str(p), *how,
                         "--machine", machine, "--limit-train", "1024", "--json"]
    if pace:
        cmd += ["--compute-s-per-sample", str(pace)]
    row = _last_json(_run(cmd))["predictions"][-1]
    t = row["time_s"]
    return {"step_s": row["step_s"], "time_s": t,
            "compute_s": t["forward"] + t["backward"] + t["update"],
            "bytes_per_step": row["bytes_per_step"],
            "messages_per_step": row["messages_per_step"]}


def time_bench(a):
    from mpidl.benchmarks.machine import describe

    repeats = 1 if a.quick else a.repeats
    steps = 10 if a.quick else a.steps
    algorithms = ALGORITHMS + (("hierarchical",) if _ON_VCLUSTER and a.ppn > 1 else ())
    if a.algorithms:
        algorithms = tuple(a.algorithms.split(","))
    configs = [(p, alg, ov) for p in a.ranks for alg in algorithms
               for ov in (("off",) if alg == "ps" else ("off", "on"))]
    runs = {c: [] for c in configs}
    machines = {p: [] for p in a.ranks}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for p in a.ranks:
                batch, pace = (BATCH, None) if p <= 2 else (BATCH_4, PACE_4)
                path = os.path.join(tmp, f"machine_p{p}_{rep}.json")
                for i, c in enumerate([c for c in configs if c[0] == p]):
                    if i == 0 or a.calibrate_every == "config":
                        machines[p].append(calibrate(p, batch, path))
                    got = measure(p, c[1], c[2], batch, pace, steps)
                    want = predict(p, c[1], c[2], batch, pace, path)
                    runs[c].append((got, want))
                    print(f"repeat {rep + 1}/{repeats} p={p} {c[1]:>18} overlap {c[2]:>3}: "
                          f"measured {1e3 * got['step_s']:7.2f} ms, predicted "
                          f"{1e3 * want['step_s']:7.2f} ms", flush=True)
    info = {**describe(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "repeats": repeats, "steps": steps, "model": MODEL,
            "calibrate_every": a.calibrate_every,
            "vcluster": _ON_VCLUSTER[0] if _ON_VCLUSTER else None,
            "load_avg_after": os.getloadavg()}
    name = (f"simulate_time_vcluster_{_ON_VCLUSTER[0]}" + (f"_2x{a.ppn}" if a.ppn > 1 else "")
            if _ON_VCLUSTER else "simulate_time") + ("_ps" if algorithms == ("ps",) else "")
    report(runs, machines, info, os.path.join(a.out, name + ".json"))


def compute_text(p):
    """How the step's compute ran at ``p`` ranks (the rows' ``compute``)."""
    if p <= 2:
        return ("real (2 nodes x 1 rank, a core each)" if _ON_VCLUSTER
                else "real (2 ranks, 2 cores)")
    return (f"emulated: {PACE_4} s/sample (2 nodes x {p // 2} ranks on 2 cores)"
            if _ON_VCLUSTER else f"emulated: {PACE_4} s/sample (4 ranks oversubscribe 2 cores)")


def report(runs, machines, info, path, compute=compute_text):
    """Rows and summary of ``runs`` ({(p, algorithm, overlap): [(measured, predicted)]}
    per repeat), written to ``path`` (JSON, and the plot beside it) and printed."""
    rows = []
    for (p, alg, ov), pairs in runs.items():
        measured = statistics.median(g["step_s"] for g, _ in pairs)
        predicted = statistics.median(w["step_s"] for _, w in pairs)
        # the model given the run's own compute: what the communication, overlap and
        # wait part predicts once load drift of the compute is taken out (emulated
        # compute is known: there the prediction itself)
        given = predicted if p > 2 or alg == "ps" else statistics.median(
            w["step_s"] - w["compute_s"] + g["compute_ms"] / 1e3 for g, w in pairs)
        rows.append({"ranks": p, "algorithm": alg, "overlap": ov, "compute": compute(p),
                     "batch": BATCH if p <= 2 else BATCH_4,
                     "measured_step_ms": 1e3 * measured, "predicted_step_ms": 1e3 * predicted,
                     "error": (predicted - measured) / measured,
                     "predicted_given_compute_ms": 1e3 * given,
                     "error_given_compute": (given - measured) / measured,
                     "measured_runs_ms": [1e3 * g["step_s"] for g, _ in pairs],
                     "measured_compute_ms": [g["compute_ms"] for g, _ in pairs],
                     "measured_wait_ms": [g["wait_ms"] for g, _ in pairs],
                     "predicted_runs": [w for _, w in pairs]})
    ranks = sorted({r["ranks"] for r in rows})
    errors = [abs(r["error"]) for r in rows]
    given = [abs(r["error_given_compute"]) for r in rows]
    summary = {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
               "given_compute": {"median_abs_error": statistics.median(given),
                                 "worst_abs_error": max(given)},
               "per_ranks": {str(p): {"median_abs_error": statistics.median(
                   abs(r["error"]) for r in rows if r["ranks"] == p),
                   "worst_abs_error": max(abs(r["error"]) for r in rows if r["ranks"] == p)}
                   for p in ranks}}
    result = {"info": info, "machines": {str(p): m for p, m in machines.items()},
              "rows": rows, "summary": summary}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{os.path.basename(path)}: median |error| {100 * summary['median_abs_error']:.1f} "
          f"%, worst {100 * summary['worst_abs_error']:.1f} %; given the run's own compute: "
          f"median {100 * summary['given_compute']['median_abs_error']:.1f} %, worst "
          f"{100 * summary['given_compute']['worst_abs_error']:.1f} %")
    for r in rows:
        print(f"p={r['ranks']} {r['algorithm']:>18} overlap {r['overlap']:>3}: measured "
              f"{r['measured_step_ms']:7.2f} ms, predicted {r['predicted_step_ms']:7.2f} ms, "
              f"error {100 * r['error']:+6.1f} % (given its compute "
              f"{100 * r['error_given_compute']:+6.1f} %)")
    plot_time(rows, path[:-len(".json")] + ".png", info.get("vcluster"))


def repredict(paths):
    """Predict the measured runs of earlier results files again with today's model, from
    the calibrations stored beside them (what was measured stays as it was); each file is
    rewritten, ``info.repredicted`` saying when."""
    for path in paths:
        with open(path) as f:
            old = json.load(f)
        info, rows = old["info"], old["rows"]
        repeats = info["repeats"]
        runs, ranks = {}, sorted({r["ranks"] for r in rows})
        with tempfile.TemporaryDirectory() as tmp:
            for p in ranks:
                batch, pace = (BATCH, None) if p <= 2 else (BATCH_4, PACE_4)
                mine = [r for r in rows if r["ranks"] == p]
                machines = old["machines"][str(p)]
                per_config = len(machines) == repeats * len(mine) and len(mine) > 1
                for i, r in enumerate(mine):
                    pairs = []
                    for rep in range(repeats):
                        machine = os.path.join(tmp, "machine.json")
                        with open(machine, "w") as f:
                            json.dump(machines[rep * len(mine) + i if per_config else rep], f)
                        got = {"step_s": r["measured_runs_ms"][rep] / 1e3,
                               "compute_ms": r["measured_compute_ms"][rep],
                               "wait_ms": r["measured_wait_ms"][rep]}
                        pairs.append((got, predict(p, r["algorithm"], r["overlap"], batch,
                                                   pace, machine)))
                    runs[(p, r["algorithm"], r["overlap"])] = pairs
        info["repredicted"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        texts = {r["ranks"]: r["compute"] for r in rows}
        report(runs, {int(p): m for p, m in old["machines"].items()}, info, path,
               compute=texts.get)


def plot_time(rows, path, vcluster=None):
    from mpidl.benchmarks.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len({r["ranks"] for r in rows}), figsize=(11, 4),
                             squeeze=False)
    for ax, p in zip(axes[0], sorted({r["ranks"] for r in rows})):
        sub = [r for r in rows if r["ranks"] == p]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["measured_step_ms"] for r in sub], 0.4,
               label="measured")
        ax.bar([x + 0.2 for x in xs], [r["predicted_step_ms"] for r in sub], 0.4,
               label="predicted")
        for x, r in zip(xs, sub):
            ax.annotate(f"{100 * r['error']:+.0f}%", (x, max(r["measured_step_ms"],
                                                           r["predicted_step_ms"])),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['algorithm'].replace('recursive_doubling', 'rd')[:5]}\n"
                            f"ov {r['overlap']}" for r in sub], fontsize=8)
        ax.set_ylabel("step (ms)")
        where = f" over {vcluster} links" if vcluster else ""
        ax.set_title(f"{p} ranks{where}, {MODEL}: {sub[0]['compute'].split(':')[0]} "
                     "compute", fontsize=9)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ scale
#: The described cluster: 8 GPUs per node (NVLink-class links inside a node, about
#: 100 GB/s between two GPUs), 200 Gbit/s (25 GB/s) between nodes; alpha includes mpidl's
#: Python cost per message (~10 us); reductions on the GPU at about 1 TB/s.
CLUSTER = {"name": "8 GPUs per node, 200 Gbit/s between nodes (described)",
           "ranks_per_node": 8, "alpha_intra": 10e-6, "beta_intra": 1 / 100e9,
           "alpha_inter": 15e-6, "beta_inter": 8 / 200e9, "gamma": 1e-12,
           "compute_cv": 0.0}


def cluster_machine(path):
    """Write the described cluster's machine file; its compute is the per-layer forward
    and backward times mpidl measured on an H100 at batch 128
    (bench/results/engine_gpu.json, ``layers_ms``), the loss folded into the last layer's
    forward, zero_grad into the update."""
    with open(os.path.join(RESULTS, "engine_gpu.json")) as f:
        gpu = json.load(f)
    compute = {}
    for model in ("mlp", "cnn"):
        entry = gpu["results"][f"{model}@128"]
        ms = entry["layers_ms"]
        batch = entry["batch"]
        layers = {}
        for key, value in ms.items():
            phase, _, name = key.partition(" ")
            if phase in ("forward", "backward"):
                index = name.split(":")[0]
                f_b = layers.setdefault(index, [0.0, 0.0])
                f_b[phase == "backward"] += value / 1e3 / batch
        last = max(layers, key=int)
        layers[last][0] += ms["loss"] / 1e3 / batch
        compute[model] = {"batch_size": batch, "dtype": "float32", "device": "gpu",
                          "layers": layers, "update_s": (ms["optimizer step"]
                                                         + ms["zero_grad"]) / 1e3,
                          "source": f"bench/results/engine_gpu.json ({gpu['device']['gpu']})"}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**CLUSTER, "compute": compute}, f, indent=1)
        f.write("\n")
    return path


#: (name, algorithm, mpidl simulate's flags) of each strategy the scale curves follow
STRATEGIES = (
    ("ring", "ring", ["--algorithm", "ring", "--overlap", "on"]),
    ("hierarchical", "hierarchical", ["--algorithm", "hierarchical", "--overlap", "on"]),
    ("recursive_doubling", "recursive_doubling",
     ["--algorithm", "recursive_doubling", "--overlap", "on"]),
    ("ZeRO 3", "hierarchical", ["--zero", "3", "--algorithm", "hierarchical",
                                "--sparse-grads", "dense"]),  # (gpt-tiny's Embedding)
    ("DiLoCo H=32", "hierarchical", ["--sync", "diloco", "--period", "32",
                                      "--algorithm", "hierarchical"]),
    ("parameter server (8 servers)", "-", ["--strategy", "ps", "--servers", "8"]),
    ("tensor parallel 4 x DP", "hierarchical", ["--tensor-parallel", "4", "--algorithm",
                                                "hierarchical", "--overlap", "on"]),
)
GPT = ["--model", "gpt-tiny", "--dataset", "text", "--limit-train", "20000"]


def gpt_pace(machine_file, batch=128):
    """gpt-tiny's stand-in seconds per sample on the described cluster (module doc): the
    mlp's measured forward + backward per sample times gpt-tiny's training FLOPs over the
    mlp's (6 per parameter per token for the matrices, 12 layers x context^2 x width for
    attention's products)."""
    from mpidl.data.text import DEFAULT_CONTEXT
    from mpidl.engine.models import build_model

    with open(machine_file) as f:
        mlp = json.load(f)["compute"]["mlp"]
    mlp_s = sum(f + b for f, b in mlp["layers"].values())
    mlp_flops = 6 * sum(q.data.size for _, q in build_model(
        "mlp", input_shape=(1, 28, 28), num_classes=10).named_parameters())
    gpt = build_model("gpt-tiny", input_shape=(DEFAULT_CONTEXT,), num_classes=96)
    matrices = sum(q.data.size for n, q in gpt.named_parameters() if q.data.ndim == 2
                   and not n.startswith(("0.", "1.")))  # (not the embeddings)
    layers, width = 4, 128  # (gpt-tiny's defaults)
    flops = DEFAULT_CONTEXT * 6 * matrices + 12 * layers * DEFAULT_CONTEXT ** 2 * width
    return mlp_s * flops / mlp_flops


def scale_bench(a):
    from mpidl.benchmarks.machine import describe
    from mpidl.benchmarks.plotting import pyplot

    machine = cluster_machine(os.path.join(MACHINES, "gpu_cluster.json"))
    pace = gpt_pace(machine)
    curves = []
    for model, batch in (("mlp", 128), ("cnn", 128), ("gpt-tiny", 128)):
        for name, alg, flags in STRATEGIES:
            given = GPT + ["--compute-s-per-sample", repr(pace)] if model == "gpt-tiny" \
                else ["--model", model]
            out = _run(mpidl_cmd() + ["simulate", *given, "--batch-size", str(batch),
                                      "--ranks", "1-4096", *flags, "--machine", machine,
                                      "--json"], timeout=1800)
            res = _last_json(out)
            curves.append({"model": model, "strategy": name, "algorithm": alg,
                           "flags": flags, "batch": batch, "layout": res["layout"],
                           "compute": res["compute"],
                           "below_50pct_at": res["efficiency_below_50pct_at"],
                           "points": [{"ranks": r["ranks"], "nodes": r["nodes"],
                                       "step_ms": 1e3 * r["step_s"],
                                       "comm_ms": 1e3 * r["time_s"]["comm"],
                                       "bytes_per_step": r["bytes_per_step"],
                                       "messages_per_step": r["messages_per_step"],
                                       "efficiency": r["efficiency"]}
                                      for r in res["predictions"]]})
            print(f"{model} {name}: efficiency below 50 % at "
                  f"{res['efficiency_below_50pct_at']} ranks; at 4096: "
                  f"{100 * res['predictions'][-1]['efficiency']:.1f} %", flush=True)
    with open(machine) as f:
        described = json.load(f)
    result = {"info": {**describe(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
              "machine": {k: v for k, v in described.items() if k != "compute"},
              "curves": curves}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "simulate_scale.json"), "w") as f:
        json.dump(result, f, indent=1)
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(c["model"] for c in curves))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.8), sharey=True)
    for ax, model in zip(axes, models):
        for c in (c for c in curves if c["model"] == model):
            ax.plot([q["ranks"] for q in c["points"]],
                    [100 * q["efficiency"] for q in c["points"]], marker="o", ms=3,
                    label=f"{c['strategy']} (<50% at {c['below_50pct_at']})")
        ax.axhline(50, color="grey", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (8 per node)")
        ax.set_title(model + (" (compute: FLOP-scaled stand-in)" if model == "gpt-tiny"
                              else " (compute measured on an H100)"), fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("predicted weak-scaling efficiency (%)")
    fig.suptitle("mpidl simulate: 8 GPUs/node, 200 Gbit/s between nodes", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "simulate_scale.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    if a.scale:
        return scale_bench(a)
    if a.repredict:
        return repredict(a.repredict)
    if a.vcluster:
        return on_vcluster(a)
    return time_bench(a)


def on_vcluster(a):
    """``time_bench`` on 2 nodes x 1 rank of the virtual cluster (brought up if down)."""
    state = "/run/mpidl-vcluster"
    made = False
    if not os.path.exists(os.path.join(state, "nodes")):
        subprocess.run(["bash", VCLUSTER, "up", "2", a.vcluster], check=True)
        made = True
    else:
        with open(os.path.join(state, "nodes")) as f:
            nodes = len(f.read().split())
        with open(os.path.join(state, "rate")) as f:
            rate = f.read().strip()
        if (nodes, rate) != (2, a.vcluster):
            raise SystemExit(f"a virtual cluster of {nodes} nodes, links {rate!r} is up: "
                             f"take it down (bash {VCLUSTER} down) or ask for that one")
    _ON_VCLUSTER.append(a.vcluster)
    a.ranks = [2 * a.ppn]
    try:
        time_bench(a)
    finally:
        if made:
            subprocess.run(["bash", VCLUSTER, "down"], check=True)


if __name__ == "__main__":
    main()

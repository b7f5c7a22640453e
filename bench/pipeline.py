"""Pipeline bubbles: measured with compute emulated by sleeps, against their formulas.

    python bench/pipeline.py            # -> bench/results/pipeline.json + pipeline.png
    python bench/pipeline.py --stages 2,4 --micro-batches 4,16 --steps 5 --out ... --plot ...
    python bench/pipeline.py --quick    # tiny grid (the test's)

For each number of stages P (one ``mpiexec -n P`` launch each) the ranks run a stack of
16 float64 Linear layers under ``--pipeline-stages P --emulate-compute``: every action sleeps its
time (forward ``t_f`` per stage, backward ``2 t_f``; zero-bubble: input gradient ``t_f``
and weight gradient ``t_f``; interleaved:v: ``t_f / v`` and ``2 t_f / v`` per chunk, so a
rank's work per micro-batch is the same in every schedule) while the real activations
and gradients travel between the stages. The grid: gpipe, 1f1b and zb at every P and M,
interleaved:2 where P divides M and 2 P virtual stages fit (P <= 4 by default), async
(PipeDream-2BW, no flush: its steady steps, after the warm-up rounds) where M >= P - 1,
and one more 1f1b configuration whose timelines are drawn (``--timeline``: P = 4,
M = 8). The steps of all the configurations of a launch run in turn (round-robin, a
barrier before each), so a change in the machine's load falls on all of them alike; after ``--warmup`` rounds, ``--steps``
are timed. A step's bubble is 1 - (mean over ranks of busy seconds) / (step seconds),
where the step runs from the earliest rank's start to the last rank's end (one host: the
ranks read the same monotonic clock); the figure is the median over the timed steps.

The anchor, measured in the same launch, a few rounds before each round of steps so that
it sees the same load (``calibrate``): what a message
costs between neighbouring ranks under the same load, with the same arrays and the same
point-to-point calls as the pipeline: ``L``, from a sender's end of action (after its
``isend``) to the receiver's return from ``recv`` when the receiver was already waiting;
``o``, the time a ``recv`` takes when the message arrived while the receiver slept
(what every receiving action pays even when it never waits); and ``d``, how much a
sleep of the emulation overruns its time. The prediction is the schedule's own
simulation (``Plan.simulate``) with these: each action that receives a message starts
``o`` after its rank is free or ``L`` after the message left, whichever is later, and
works its time + ``d``. Reported per configuration: the closed-form bubble
(``bubble_formula``: no message cost), the simulation with the latency ``L`` alone, the
prediction, the measurement, and the gap in points.

The criteria (issue point 3): gpipe and 1f1b within 1 point of the prediction;
interleaved within 1 point of its prediction (its own formula plus the message terms);
zero-bubble's measured bubble below 1f1b's at the same P and M; async within 1 point of
its prediction and below 1f1b's.

The machine is a 2-core box shared with other work: P = 4 and 8 oversubscribe it (which
is why compute is emulated by sleeps: sleeping stages overlap without cores), and the
load averages around each launch are kept in the JSON.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402

MICRO = 4               # samples per micro-batch: the messages stay small (4 x 32 float64)
WIDTH, LAYERS = 32, 16  # Linear layers only (compute is emulated: their kind does not matter)
COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
MARKERS = {"gpipe": "o", "1f1b": "s", "interleaved:2": "^", "zb": "D", "async": "v"}
LINES = {"gpipe": "tab:blue", "1f1b": "tab:orange", "interleaved:2": "tab:green",
         "zb": "tab:red", "async": "tab:purple"}


# -- the ranks' part -------------------------------------------------------------------
def emulated_times(schedule, S, tf):
    """{op: [seconds per virtual stage]} for the emulation: a rank's work per
    micro-batch is 3 t_f whatever the schedule."""
    from mpidl.runtime import pipeline_schedule  # noqa: PLC0415

    kind, v = pipeline_schedule.parse(schedule)
    if kind == "zb":
        return {"F": [tf] * S, "B": [tf] * S, "W": [tf] * S}
    return {"F": [tf / v] * S, "B": [2 * tf / v] * S, "W": [0.0] * S}


def make_runtime(comm, schedule, M, tf):
    import numpy as np  # noqa: PLC0415

    from mpidl.engine import SGD  # noqa: PLC0415
    from mpidl.engine.linear import Linear  # noqa: PLC0415
    from mpidl.engine.losses import SoftmaxCrossEntropy  # noqa: PLC0415
    from mpidl.engine.module import Sequential  # noqa: PLC0415
    from mpidl.runtime import build, pipeline_schedule  # noqa: PLC0415

    P = comm.size
    _, v = pipeline_schedule.parse(schedule)
    em = emulated_times(schedule, P * v, tf)
    gen = np.random.default_rng(0)
    widths = [64] + [WIDTH] * (LAYERS - 1) + [10]
    model = Sequential(*[Linear(i, o, rng=gen, dtype="float64")
                         for i, o in itertools.pairwise(widths)])
    model.needs_input_grad = False
    opt = SGD(model.named_parameters(), lr=0.01)
    rt = build("allreduce", comm, pipeline_stages=P, pipeline_schedule=schedule,
               micro_batches=M, emulate_compute=em)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M * MICRO, 64))
    y = rng.integers(0, 10, M * MICRO)
    rt.sample_batch = (x[:MICRO], y[:MICRO])
    rt.setup(model, opt, SoftmaxCrossEntropy())
    return rt, x, y, em


def _sleep(pp, seconds, sends=()):
    """The emulation's own sleep (1 ms slices that test the sends in flight)."""
    pp._sleep(seconds, list(sends))


def calibrate(comm, pp, d, rounds):
    """Per-message costs between neighbouring ranks, measured with the pipeline's own
    calls on an activation-sized array while the other ranks do the same (module doc):
    lists of ``L`` (receiver waiting), ``o`` (message already there) and the overrun of
    a sleep of ``d`` seconds. Pairs (a, a + 1) with even a, then with odd a; in each
    round the lower rank sends first (an activation), then the upper one (a gradient)."""
    import numpy as np  # noqa: PLC0415

    clock = time.perf_counter
    mpi = comm.mpi
    P, r = comm.size, comm.rank
    x = np.ones((MICRO, WIDTH))
    buf = np.empty_like(x)
    sent, waited, arrived, overrun = [], [], [], []
    tag = 0
    for parity in (0, 1):
        for arrive_first in (False, True):
            for _ in range(rounds):
                tag += 1
                mpi.Barrier()
                if r % 2 == parity and r + 1 < P:
                    peer, first = r + 1, True
                elif r % 2 != parity and r >= 1:
                    peer, first = r - 1, False
                else:
                    _sleep(pp, 2 * d)
                    continue
                for turn in (True, False):
                    if turn == first:  # send: sleep d, then isend (as an action ends)
                        t = clock()
                        _sleep(pp, d)
                        overrun.append(clock() - t - d)
                        req = comm.isend(x, peer, tag)
                        sent.append(((tag, turn, min(r, peer)), clock()))
                        if arrive_first:
                            _sleep(pp, d, [req])
                        req.wait()
                    else:  # receive: right away (waiting) or after the message is there
                        if arrive_first:
                            _sleep(pp, 2 * d)
                        t = clock()
                        comm.recv(buf, peer, tag)
                        t1 = clock()
                        (arrived if arrive_first else waited).append(
                            ((tag, turn, min(r, peer)), t1, t1 - t))
                        if arrive_first:
                            _sleep(pp, d)
    everything = mpi.gather((sent, waited, arrived, overrun), root=0)
    if r != 0:
        return None
    ends = dict(m for s, _, _, _ in everything for m in s)
    L = [t1 - ends[key] for _, w, _, _ in everything for key, t1, _ in w]
    o = [dt for _, _, a, _ in everything for _, _, dt in a]
    d_over = [v for _, _, _, ov in everything for v in ov]
    return {"latency_s": L, "recv_s": o, "sleep_overrun_s": d_over}


def run_rank(a):
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl import backend  # noqa: PLC0415
    from mpidl.comm import Communicator  # noqa: PLC0415

    backend.use("cpu")
    comm = Communicator(MPI.COMM_WORLD)
    P, mpi = comm.size, comm.mpi
    configs = []
    for item in a.configs.split(","):
        schedule, M = item.rsplit("@", 1)
        configs.append((schedule, int(M)))
    runs = [(s, M) + make_runtime(comm, s, M, a.tf) for s, M in configs]
    pp = runs[0][2].pp
    records = {i: [] for i in range(len(runs))}
    cal = {"latency_s": [], "recv_s": [], "sleep_overrun_s": []}
    clock = time.perf_counter
    for step in range(a.warmup + a.steps):
        got_cal = calibrate(comm, pp, a.tf, a.calibrate_rounds)  # under this round's load
        if comm.rank == 0 and step >= a.warmup:
            for key, values in got_cal.items():
                cal[key] += values
        for i, (schedule, M, rt, x, y, _) in enumerate(runs):
            mpi.Barrier()
            t0 = clock()
            rt.train_step(x, y)
            got = mpi.gather((t0, rt.pp.step_s, rt.pp.busy_s, rt.pp.spans), root=0)
            if comm.rank == 0 and step >= a.warmup:
                records[i].append(got)
        if comm.rank == 0:
            print(f"P={P}: round {step + 1}/{a.warmup + a.steps} done", flush=True)
    if comm.rank == 0:
        out = {"P": P, "calibration": cal, "configs": []}
        for i, (schedule, M, rt, _, _, em) in enumerate(runs):
            steps = []
            for got in records[i]:
                start = min(t0 for t0, _, _, _ in got)
                end = max(t0 + s for t0, s, _, _ in got)
                spans = [[r, op, mb, c, t0 + s - start, t0 + e - start]
                         for r, (t0, _, _, sp) in enumerate(got) for op, mb, c, s, e in sp]
                steps.append({"step_s": end - start, "busy_s": [b for _, _, b, _ in got],
                              "bubble": 1 - sum(b for _, _, b, _ in got) / (P * (end - start)),
                              "spans": spans})
            out["configs"].append({"schedule": schedule, "P": P, "M": M,
                                   "v": rt.pp.plan.v, "emulated": em, "steps": steps})
        with open(a.out, "w") as f:
            json.dump(out, f)
    comm.close()


# -- prediction -------------------------------------------------------------------------
def receives(plan, op, vs):
    """Whether action ``op`` of virtual stage ``vs`` takes a message from another rank."""
    S = plan.virtual_stages
    return (op == "F" and vs > 0) or (op == "B" and vs < S - 1)


def predict(schedule, P, M, em, L, o, d):
    """(closed form, simulation with L alone, prediction, predicted timeline spans).

    The prediction charges ``o`` at the front of every receiving action (the
    simulation's per-stage times take it; it is not counted as work), the rest of the
    latency ``L - o`` on each message, and the sleep overrun ``d`` to every action's
    work."""
    from mpidl.runtime import pipeline_schedule  # noqa: PLC0415

    kind, v = pipeline_schedule.parse(schedule)
    plan = pipeline_schedule.build(kind, P, M, v)
    S = plan.virtual_stages
    formula = pipeline_schedule.bubble_formula(kind, P, M, v) if kind != "zb" else None
    f0, b0, w0 = (em[op] for op in "FBW")
    plain = plan.simulate(f0, b0, w0)
    with_latency = plan.simulate(f0, b0, w0, latency=L)
    work = {op: [t + d if t > 0 else 0.0 for t in em[op]] for op in "FBW"}
    durations = {op: [work[op][vs] + (o if receives(plan, op, vs) else 0.0)
                      for vs in range(S)] for op in "FBW"}
    tl = plan.simulate(durations["F"], durations["B"], durations["W"], latency=L - o)
    spans = []
    for r, op, mb, c, s, e in tl.spans:
        vs = plan.vstage(r, c)
        front = o if receives(plan, op, vs) else 0.0
        spans.append([r, op, mb, c, s + front, e])
    busy = sum(e - s for _, _, _, _, s, e in spans)
    predicted = 1.0 - busy / (P * tl.step_time)
    return {"formula": formula, "simulated": plain.bubble,
            "simulated_latency_only": with_latency.bubble, "predicted": predicted,
            "predicted_step_s": tl.step_time}, spans


def summarize(launches, a):
    """Per configuration: the medians, the prediction and the gaps; the criteria."""
    rows, timeline = [], None
    cal_all = {}
    for launch in launches:
        cal = launch["calibration"]
        P = launch["P"]
        L = statistics.median(cal["latency_s"]) if cal["latency_s"] else 0.0
        o = statistics.median(cal["recv_s"]) if cal["recv_s"] else 0.0
        d = statistics.median(cal["sleep_overrun_s"])
        cal_all[P] = {"latency_s": L, "recv_s": o, "sleep_overrun_s": d,
                      "latency_mean_s": _mean(cal["latency_s"]),
                      "recv_mean_s": _mean(cal["recv_s"]),
                      "sleep_overrun_mean_s": _mean(cal["sleep_overrun_s"]),
                      "messages": len(cal["latency_s"]) + len(cal["recv_s"])}
        for cfg in launch["configs"]:
            pred, spans = predict(cfg["schedule"], P, cfg["M"], cfg["emulated"], L, o, d)
            bubbles = [s["bubble"] for s in cfg["steps"]]
            med = statistics.median(bubbles)
            row = {"schedule": cfg["schedule"], "P": P, "M": cfg["M"], "v": cfg["v"],
                   "measured": med, "measured_steps": bubbles,
                   "measured_min": min(bubbles), "measured_max": max(bubbles),
                   "step_s": statistics.median(s["step_s"] for s in cfg["steps"]),
                   **pred}
            row["gap_points"] = 100 * (med - pred["predicted"])
            if pred["formula"] is not None:
                row["gap_formula_points"] = 100 * (med - pred["formula"])
            row["timeline_only"] = (cfg["schedule"], P, cfg["M"]) == a.timeline_config and \
                cfg["M"] not in a.micro_batch_list
            rows.append(row)
            if (cfg["schedule"], P, cfg["M"]) == a.timeline_config:
                steps = sorted(cfg["steps"], key=lambda s: s["bubble"])
                median_step = steps[(len(steps) - 1) // 2]
                timeline = {"schedule": cfg["schedule"], "P": P, "M": cfg["M"],
                            "predicted_spans": spans, "predicted_bubble": pred["predicted"],
                            "predicted_step_s": pred["predicted_step_s"],
                            "measured_spans": median_step["spans"],
                            "measured_bubble": median_step["bubble"],
                            "measured_step_s": median_step["step_s"]}
    criteria = []
    by = {(r["schedule"], r["P"], r["M"]): r for r in rows}
    for r in rows:
        if r["timeline_only"]:
            continue
        if r["schedule"] != "zb":
            ok = abs(r["gap_points"]) <= 1.0
            criteria.append({"check": f"{r['schedule']} P={r['P']} M={r['M']}: |measured - "
                             "predicted| <= 1 point", "holds": ok,
                             "value_points": r["gap_points"]})
        ref = by.get(("1f1b", r["P"], r["M"]))
        if r["schedule"] in ("zb", "async") and ref is not None:
            ok = r["measured"] < ref["measured"]
            criteria.append({"check": f"{r['schedule']} P={r['P']} M={r['M']}: measured "
                             "below 1f1b's", "holds": ok,
                             "value_points": 100 * (r["measured"] - ref["measured"])})
    return rows, cal_all, timeline, criteria


def _mean(values):
    return statistics.fmean(values) if values else None


# -- the plot ---------------------------------------------------------------------------
def plot(res, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    from matplotlib.patches import Patch  # noqa: PLC0415

    rows = [r for r in res["rows"] if not r["timeline_only"]]
    stages = sorted({r["P"] for r in rows})
    fig = plt.figure(figsize=(4.2 * max(len(stages), 2), 8.6))
    grid = fig.add_gridspec(2, max(len(stages), 2) * 2)
    half = max(len(stages), 2)
    for i, P in enumerate(stages):
        ax = fig.add_subplot(grid[0, 2 * i * half // len(stages):
                                 2 * (i + 1) * half // len(stages)])
        for schedule in sorted({r["schedule"] for r in rows if r["P"] == P},
                               key=list(MARKERS).index):
            mine = sorted((r for r in rows if r["P"] == P and r["schedule"] == schedule),
                          key=lambda r: r["M"])
            Ms = [r["M"] for r in mine]
            color = LINES.get(schedule, "black")
            hollow = schedule == "gpipe"  # its points fall on 1f1b's: drawn around them
            ax.plot(Ms, [100 * r["measured"] for r in mine], MARKERS.get(schedule, "x"),
                    ms=10 if hollow else 6, mfc="none" if hollow else color, color=color,
                    label=f"{schedule} measured")
            ax.vlines(Ms, [100 * r["measured_min"] for r in mine],
                      [100 * r["measured_max"] for r in mine], color=color, lw=1)
            ax.plot(Ms, [100 * r["predicted"] for r in mine], "--", color=color, lw=1,
                    label=f"{schedule} predicted")
            if mine[0]["formula"] is not None and schedule != "gpipe":
                ax.plot(Ms, [100 * r["formula"] for r in mine], ":",
                        color="gray" if schedule == "1f1b" else color, lw=1.5,
                        label={"1f1b": "(P-1)/(M+P-1)", "async": "(P-1)/(3M+P-1)"}.get(
                            schedule, "(P-1)/(vM+P-1)"))
        ax.set_xscale("log", base=2)
        ticks = sorted({r["M"] for r in rows if r["P"] == P})
        ax.set_xticks(ticks, [str(m) for m in ticks])
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("bubble (% of the step)")
        ax.set_title(f"P = {P} stages")
        ax.legend(fontsize=6)
    tl = res.get("timeline")
    if tl is not None:
        end = max(tl["predicted_step_s"], tl["measured_step_s"])
        for j, (key, title) in enumerate((("predicted", "predicted (simulation)"),
                                          ("measured", "measured (median step)"))):
            ax = fig.add_subplot(grid[1, j * half:(j + 1) * half])
            for r, op, mb, c, s, e in tl[f"{key}_spans"]:
                ax.barh(r, 1e3 * (e - s), left=1e3 * s, height=0.7, color=COLORS[op],
                        edgecolor="black", lw=0.4, alpha=1.0 if c == 0 else 0.6)
                if e - s > 0.012 * end:
                    ax.text(1e3 * (s + e) / 2, r, str(mb), ha="center", va="center",
                            fontsize=6)
            ax.set_xlim(0, 1e3 * end * 1.02)
            ax.set_ylim(tl["P"] + 0.3, -0.5)  # a free strip at the bottom for the legend
            ax.set_yticks(range(tl["P"]))
            ax.set_ylabel("pipeline rank")
            ax.set_xlabel("ms from the step's start")
            ax.set_title(f"{tl['schedule']} P={tl['P']} M={tl['M']}, {title}: bubble "
                         f"{100 * tl[key + '_bubble']:.1f} %, step "
                         f"{1e3 * tl[key + '_step_s']:.0f} ms", fontsize=9)
            ops = sorted({sp[1] for sp in tl[f"{key}_spans"]}, key="FBW".index)
            names = {"F": "forward", "B": "input gradient" if "W" in ops else "backward",
                     "W": "weight gradient"}
            ax.legend(handles=[Patch(color=COLORS[op], label=names[op]) for op in ops],
                      fontsize=7, loc="lower right", ncol=len(ops))
    s = res["settings"]
    fig.suptitle(f"Pipeline bubble, compute emulated by sleeps (t_f = {1e3 * s['tf']:.0f} ms,"
                 f" backward 2 t_f), {res['machine']['cores']} cores shared by P ranks\n"
                 "points: median over steps, bars: min-max; dashed: predicted (simulation "
                 "with the calibrated message costs); dotted: closed form", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the launcher ----------------------------------------------------------------------
def grid(P, micro_batches, interleave_max, timeline):
    configs = []
    for schedule in ("gpipe", "1f1b", "interleaved:2", "zb", "async"):
        for M in micro_batches:
            if schedule.startswith("interleaved") and (P > interleave_max or M % P):
                continue
            if schedule == "async" and M < P - 1:
                continue
            configs.append((schedule, M))
    schedule, stages, M = timeline
    if stages == P and (schedule, M) not in configs:
        configs.append((schedule, M))
    return configs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("_run", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--stages", default="2,4,8", help="numbers of stages P (one launch each)")
    p.add_argument("--micro-batches", default="4,16,32", help="micro-batches M per step")
    p.add_argument("--interleave-max", type=int, default=4,
                   help="run interleaved:2 up to this P (where P divides M)")
    p.add_argument("--tf", type=float, default=0.02,
                   help="emulated forward seconds per stage (backward: twice that)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibrate-rounds", type=int, default=2,
                   help="calibration rounds before each round of steps (each: every "
                        "neighbour pair, both directions, waiting and arrived)")
    p.add_argument("--timeline", default="1f1b:4:8", metavar="SCHEDULE:P:M",
                   help="the configuration whose predicted and measured timelines are drawn")
    p.add_argument("--quick", action="store_true", help="tiny grid (the test's)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--configs", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "pipeline.json"))
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    if a._run == "_run":
        return run_rank(a)
    if a.quick:
        a.stages, a.micro_batches, a.tf, a.steps, a.warmup = "2", "2,4", 0.005, 2, 1
        a.calibrate_rounds, a.timeline = 1, "1f1b:2:4"
    schedule, P, M = a.timeline.rsplit(":", 2)
    a.timeline_config = (schedule, int(P), int(M))
    a.plot = a.plot or os.path.splitext(a.out)[0] + ".png"
    a.micro_batch_list = [int(m) for m in a.micro_batches.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    settings = {k: v for k, v in vars(a).items()
                if k not in ("_run", "out", "plot", "configs", "micro_batch_list",
                             "timeline_config")}
    settings.update(micro_batch_samples=MICRO,
                    model=f"{LAYERS} Linear layers 64 -> {WIDTH} ... -> 10, float64")
    launches = []
    t_all = time.time()
    for P in (int(s) for s in a.stages.split(",")):
        work = f"{a.out}.p{P}.rank.json"
        configs = grid(P, a.micro_batch_list, a.interleave_max, a.timeline_config)
        cmd = [mpiexec(), "-n", str(P), sys.executable, "-m", "mpi4py",
               os.path.abspath(__file__), "_run", "--tf", str(a.tf), "--steps", str(a.steps),
               "--warmup", str(a.warmup), "--calibrate-rounds", str(a.calibrate_rounds),
               "--configs", ",".join(f"{s}@{M}" for s, M in configs), "--out", work]
        load = os.getloadavg()
        t = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=launch_env(ROOT), timeout=a.timeout)
        if proc.returncode != 0:
            print(proc.stdout)
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode})")
        with open(work) as f:
            launch = json.load(f)
        os.remove(work)
        launch.update(load_average_before=load, load_average_after=os.getloadavg(),
                      wall_s=time.time() - t)
        launches.append(launch)
        print(f"P={P}: {len(configs)} configurations in {time.time() - t:.0f} s "
              f"(load {load[0]:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    rows, cal, timeline, criteria = summarize(launches, a)
    res = {"benchmark": "pipeline bubble with emulated compute against the schedules' "
                        "formulas and simulation",
           "command": "python bench/pipeline.py " + " ".join(sys.argv[1:]),
           "machine": describe_machine(),
           "machine_note": ("one host with few cores shared with other work: P ranks "
                            "oversubscribe the cores for P > cores; compute is emulated by "
                            "sleeps (1 ms slices), so stages overlap without cores, while "
                            "the activations and gradients really travel over MPI"),
           "settings": settings, "wall_s": time.time() - t_all,
           "calibration": {str(P): c for P, c in cal.items()},
           "rows": rows, "criteria": criteria,
           "all_hold": all(c["holds"] for c in criteria),
           "timeline": timeline,
           "launches": [{"P": x["P"], "load_average_before": x["load_average_before"],
                         "load_average_after": x["load_average_after"], "wall_s": x["wall_s"],
                         "calibration_raw": x["calibration"]} for x in launches]}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    plot(res, a.plot)
    report(res)
    print(f"wrote {a.out} and {a.plot}")
    return 0


def report(res):
    print()
    for P, c in sorted(res["calibration"].items(), key=lambda kv: int(kv[0])):
        print(f"P={P}: message latency L {1e3 * c['latency_s']:.3f} ms, receive of an "
              f"arrived message o {1e3 * c['recv_s']:.3f} ms, sleep overrun d "
              f"{1e3 * c['sleep_overrun_s']:.3f} ms (medians)")
    print()
    head = (f"{'schedule':<14}{'P':>3}{'M':>4}  {'formula':>8}{'sim+L':>8}{'predict':>9}"
            f"{'measured':>10}{'(min-max)':>16}{'gap':>7}")
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        f = "-" if r["formula"] is None else f"{100 * r['formula']:.2f}"
        spread = f"({100 * r['measured_min']:.1f}-{100 * r['measured_max']:.1f})"
        print(f"{r['schedule']:<14}{r['P']:>3}{r['M']:>4}  {f:>8}"
              f"{100 * r['simulated_latency_only']:>8.2f}{100 * r['predicted']:>9.2f}"
              f"{100 * r['measured']:>10.2f}"
              f"{spread:>16}"
              f"{r['gap_points']:>+7.2f}" + ("  (timeline)" if r["timeline_only"] else ""))
    print("bubbles in % of the step; gap = measured - predicted, in points")
    print()
    for c in res["criteria"]:
        print(f"{'holds ' if c['holds'] else 'FAILS '} {c['check']} ({c['value_points']:+.2f})")
    n = sum(c["holds"] for c in res["criteria"])
    print(f"{n}/{len(res['criteria'])} criteria hold")
    cores = res["machine"]["cores"]
    for x in res["launches"]:
        load = max(x["load_average_before"][0], x["load_average_after"][0])
        if load > cores:
            print(f"note: P={x['P']} ran at a 1-minute load average up to {load:.1f} on {cores} "
                  "cores (other work on the machine delays the sleeping ranks' wake-ups)")


if __name__ == "__main__":
    sys.exit(main())

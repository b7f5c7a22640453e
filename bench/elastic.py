"""Elastic training under random deaths: does every run finish, how fast do the others go
on, and what does losing a rank cost in accuracy?

    .venv-openmpi/bin/python bench/elastic.py       # -> bench/results/elastic.json + .png
    .venv-openmpi/bin/python bench/elastic.py --strategy ps --ranks 4,5 --epochs 3 \
        --out bench/results/elastic_ps.json --plot bench/results/elastic_ps.png
    .venv-openmpi/bin/python bench/elastic.py --kills 4 --ranks 3 --limit-train 3000

Needs an MPI whose survivors go on (Open MPI 5; the launch adds ``--with-ft ulfm``): run
it with the Open MPI venv's Python. For each rank count in ``--ranks`` one run without a
failure gives the reference accuracy and training time; then ``--kills`` runs (the rank
counts in turn) each get one SIGKILL of a random rank at a random moment of training
(uniform over the first 80 % of the reference's training time, after the run's first
line; for the
parameter server, over its epochs after the first, since its commits are taken at epoch
ends), from outside, as a node failure would. Each run has a watchdog (``--timeout``): a run that does not end
is a hang. Reported per run: exit status, the dead rank, the step gone back to, the time
from the kill to the next completed step (the failure's detection by ULFM, revoke,
shrink, agreeing on the commit, rebuilding the generation; data re-dealing is part of it
and is a few milliseconds), and the final test accuracy against the reference's, and
whether it lies between the references on p and p - 1 ranks (within half a point): a run
that lost a rank trains on p - 1 for the rest of it, with a smaller global batch. First,
in this process: the time of a commit against the time of a step (what
``--elastic-commit-every`` trades against the steps a death repeats).

With more ranks than cores (2 here), times are those of oversubscribed ranks: the kill
to next-step time includes waiting for a core. A kill that lands after the last step has
nothing to recover (reported as such).
"""

import argparse
import json
import os
import random
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.chaos import kill_during  # noqa: E402
from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402
from mpidl.benchmarks.plotting import pyplot  # noqa: E402


def command(args, ranks, out):
    return [mpiexec(), "--with-ft", "ulfm", "--oversubscribe", "-n", str(ranks),
            sys.executable, "-m", "mpidl.cli.main", "train", "--elastic", "--no-progress",
            "--model", args.model, "--limit-train", str(args.limit_train), "--epochs",
            str(args.epochs), "--batch-size", str(args.batch), "--seed", str(args.seed),
            "--strategy", args.strategy, "--out-dir", out]


def started(args):
    """The line after which a run is killed: data parallelism's first line; the
    parameter server's first epoch line (its root worker's start line is not printed,
    and its commits are taken at epoch ends: a death before the first one starts over)."""
    return '"epoch": 1,' if args.strategy == "ps" else "] training "


def fresh(path):
    """An empty output folder (metrics files are appended to)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def records(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def commit_cost(args, steps=30):
    """Seconds per training step and per commit, in this process, for the model with
    SGD (momentum) and Adam (two more state arrays per parameter): what
    ``--elastic-commit-every K`` buys back (the commit is 1/K of it per step)."""
    from mpidl.cli.main import build_parser  # noqa: PLC0415
    from mpidl.cli.train import build_model_and_optimizer, given_flags  # noqa: PLC0415
    from mpidl.config import resolve  # noqa: PLC0415
    from mpidl.data import load_dataset  # noqa: PLC0415
    from mpidl.runtime import build  # noqa: PLC0415
    from mpidl.training.elastic import Commits  # noqa: PLC0415
    from mpidl.training.trainer import Trainer  # noqa: PLC0415

    out = {}
    for opt in ("sgd", "adam"):
        flags = ["train", "--model", args.model, "--optimizer", opt, "--batch-size",
                 str(args.batch), "--fused-optimizer", "on"]
        cfg = resolve(given_flags(build_parser().parse_args(flags)))
        data = load_dataset("fashion-mnist").limit(4 * args.batch, 100)
        model, optimizer = build_model_and_optimizer(cfg, data, None, 10 ** 9)
        trainer = Trainer(model, optimizer, data, runtime=build("local"), config=cfg,
                          quiet=True)
        trainer.t_start = time.perf_counter()
        trainer.runtime.setup(model, optimizer, trainer.task.loss)
        _, x, y = next(trainer.loader.from_position(0, 0))
        commits, step_s, commit_s = Commits(1), [], []
        for i in range(steps + 3):
            t = time.perf_counter()
            trainer.runtime.train_step(x, y)
            t1 = time.perf_counter()
            trainer.step += 1
            commits.before_step(trainer)
            if i >= 3:  # after the first commits have allocated their copies
                step_s.append(t1 - t)
                commit_s.append(time.perf_counter() - t1)
        step, commit = sorted(step_s)[len(step_s) // 2], sorted(commit_s)[len(commit_s) // 2]
        out[opt] = {"step_ms": round(step * 1e3, 3), "commit_ms": round(commit * 1e3, 3),
                    "commit_per_step": round(commit / step, 4),
                    "state_bytes": sum(int(v.nbytes) for v in model.state_dict().values())
                    * (2 if opt == "sgd" else 3)}
        print(f"commit cost, {args.model} with {opt} (batch {args.batch}, one process, "
              f"medians of {steps}): step {step * 1e3:.2f} ms, commit {commit * 1e3:.2f} ms "
              f"= {commit / step:.1%} of a step", flush=True)
    return out


def run(args):
    env = launch_env(ROOT)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    counts = [int(r) for r in args.ranks.split(",")]
    result = {"machine": describe_machine(), "settings": vars(args), "reference": {},
              "runs": [], "commit_cost": commit_cost(args)}
    # the runs without a failure on p ranks, and on p - 1 (what a run that lost a rank
    # trains on for the rest of it: fewer ranks, a smaller global batch, more steps)
    smallest = 2 if args.strategy == "ps" else 1
    for n in sorted(set(counts) | {c - 1 for c in counts if c - 1 > smallest}):
        out = fresh(os.path.join(args.work, f"reference-{n}"))
        t = time.time()
        launch = kill_during(command(args, n, out), victim=-1, delay=0, env=env,
                             timeout=args.timeout, started=started(args))
        last = (records(out) or [{}])[-1]
        if launch["status"] != 0:
            sys.exit(f"the reference run on {n} ranks failed:\n{launch['output'][-3000:]}")
        first = (records(out) or [{}])[0]
        span = last.get("elapsed", 0) - (first.get("elapsed", 0) if args.strategy == "ps"
                                         else 0)
        result["reference"][n] = {"test_acc": last.get("test_acc"),
                                  "train_s": last.get("elapsed"), "kill_span_s": span,
                                  "wall_s": time.time() - t}
        print(f"reference, {n} ranks: test accuracy {last.get('test_acc')}, "
              f"{last.get('elapsed'):.1f} s of training", flush=True)
    rng = random.Random(args.seed)
    for i in range(args.kills):
        n = counts[i % len(counts)]
        ref = result["reference"][n]
        victim = rng.randrange(n)
        # (the first 80 % of the reference's span: a run may go faster than its reference)
        delay = rng.uniform(0.0, 0.8 * ref["kill_span_s"])
        out = fresh(os.path.join(args.work, f"kill-{i}"))
        launch = kill_during(command(args, n, out), victim=victim, delay=delay, env=env,
                             timeout=args.timeout, started=started(args))
        recs = records(out)
        last = recs[-1] if recs else {}
        events = last.get("elastic_failures") or []
        row = {"run": i, "ranks": n, "victim": victim, "delay_s": round(delay, 3),
               "status": launch["status"], "hang": launch["status"] is None,
               "killed": launch["killed"], "epochs": [r["epoch"] for r in recs],
               "test_acc": last.get("test_acc"),
               "acc_vs_reference": (None if last.get("test_acc") is None else
                                    round(100 * (last["test_acc"] - ref["test_acc"]), 3))}
        fewer = result["reference"].get(n - 1)
        if fewer is not None and last.get("test_acc") is not None:
            lo, hi = sorted((ref["test_acc"], fewer["test_acc"]))
            row["within_half_a_point_of_p_and_p_minus_1"] = \
                lo - 0.005 <= last["test_acc"] <= hi + 0.005
        if events:
            e = events[0]
            row.update(back_to_step=e["step"], recovered_s=e["recovered_s"],
                       steps_repeated=e.get("steps_repeated"),
                       kill_to_next_step_s=round(e["detected_at"] + e["went_on_s"]
                                                 - launch["killed_at"], 4))
        else:
            row["note"] = "killed after the last step: nothing to recover"
        if launch["status"] != 0:
            row["output_tail"] = launch["output"][-4000:]
        result["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "output_tail"}), flush=True)
    summarize(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")


def summarize(result):
    runs = result["runs"]
    recovered = [r for r in runs if "kill_to_next_step_s" in r]
    times = sorted(r["kill_to_next_step_s"] for r in recovered)
    gaps = [abs(r["acc_vs_reference"]) for r in runs if r["acc_vs_reference"] is not None]
    s = {"runs": len(runs), "finished": sum(r["status"] == 0 for r in runs),
         "hangs": sum(r["hang"] for r in runs), "recovered": len(recovered),
         "kill_to_next_step_median_s": times[len(times) // 2] if times else None,
         "kill_to_next_step_max_s": times[-1] if times else None,
         "under_1s": sum(t < 1.0 for t in times),
         "max_acc_gap_points": max(gaps) if gaps else None,
         "lowest_acc_vs_reference_points": min((r["acc_vs_reference"] for r in runs
                                                if r["acc_vs_reference"] is not None),
                                               default=None),
         "within_half_a_point": sum(g <= 0.5 for g in gaps),
         "within_half_a_point_of_p_and_p_minus_1": sum(
             bool(r.get("within_half_a_point_of_p_and_p_minus_1")) for r in runs)}
    result["summary"] = s
    print(json.dumps(s))


def plot(result, path):
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in result["runs"] if "kill_to_next_step_s" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for n in sorted({r["ranks"] for r in runs}):
        mine = [r for r in runs if r["ranks"] == n]
        a.scatter([r["delay_s"] for r in mine], [r["kill_to_next_step_s"] for r in mine],
                  label=f"{n} ranks")
        b.scatter([r["delay_s"] for r in mine], [r["acc_vs_reference"] for r in mine],
                  label=f"{n} ranks")
    a.axhline(1.0, color="grey", ls="--", lw=1)
    a.set_xlabel("kill after the first line (s)")
    a.set_ylabel("kill to the next completed step (s)")
    a.set_title("going on after a SIGKILL")
    b.axhspan(-0.5, 0.5, color="grey", alpha=0.2)
    b.set_xlabel("kill after the first line (s)")
    b.set_ylabel("test accuracy minus no-failure run (points)")
    b.set_title("what the lost rank costs")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--ranks", default="3,4,5")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--strategy", default="allreduce", choices=("allreduce", "ps"),
                    help="ps: 1 server, the other ranks workers")
    ap.add_argument("--limit-train", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench-elastic"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "elastic.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "results", "elastic.png"))
    run(ap.parse_args())


if __name__ == "__main__":
    main()

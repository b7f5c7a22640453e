"""Reinforcement learning on CartPole: learning curves and actor/learner throughput.

    python bench/rl.py learn                    # dqn on 1 process, apex on 4 ranks
    python bench/rl.py learn --runs apex --frames 100000 --seeds 0,1
    python bench/rl.py learn --env MinAtar/Breakout-v1 --seeds 0,1,2 --frames 60000 \
        --apex-ranks 5 --name rl_minatar_breakout --extra "--network conv --batch-size 32
        --learn-start 5000 --eps-frames 20000 --eval-every 10000"
    python bench/rl.py throughput               # actor frames/s (1 vs 2 actors, beside
                                                # 1 vs 2 solo actors: the machine's anchor)
                                                # and the learner's updates/s as actors grow

``learn`` runs ``mpidl rl`` (the command users run) for each algorithm and seed, keeps its
JSON lines, and writes bench/results/rl_cartpole.json (every evaluation: frames, wall time,
greedy return over 10 episodes; the final 100-episode greedy evaluation of the final and
of the best-evaluated parameters; the commands; the machine and its load average) and
bench/results/rl_cartpole.png (evaluation return against frames and against wall time).

``throughput`` writes bench/results/rl_throughput.json/.png. Actor scaling: Ape-X with a
negligible replay ratio (the learner hardly works), 1 and 2 actors, ``--repeats`` runs of
each interleaved (median kept). Its anchor, in the same run: the actor's own work alone
(``solo``: no MPI, no learner, no shard), one process and two at once, which says how much
two processes gain on this machine at all. Learner scaling: the
learner's compute replaced by a sleep (``--sleep-update``) and a tiny network, because 1 to
6 actors + shards + learner oversubscribe the 2 cores: the question is whether serving
more actors slows the learner's loop, not how fast its arithmetic is. There the replay
ratio is 1 update per frame and actors wait (back-pressure) only while the learner owes more
than 200 updates, so the learner always has work while every actor keeps pulling and
inserting: its updates/s is its loop's rate (sleep + sampling over the shards + serving
the actors' pulls).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe, launch_env, mpiexec  # noqa: E402
from mpidl.benchmarks.plotting import pyplot  # noqa: E402

RANKS = {"dqn": 1, "apex": 4, "gorila": 4}


def mpidl_rl(n, args, timeout):
    cmd = ([mpiexec(), "-n", str(n)] if n > 1 else []) + \
        [sys.executable, "-m", "mpidl.cli.main", "rl"] + [str(a) for a in args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(ROOT),
                          timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    prefix = f"mpiexec -n {n} mpidl rl " if n > 1 else "mpidl rl "
    return {"command": prefix + " ".join(str(a) for a in args), "evals": [x for x in lines if not x.get("final")],
            "final": lines[-1], "launch_wall_s": wall}


def _write(out, args):
    path = os.path.join(args.out_dir, args.name + ".json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return path


def learn(args):
    out = {"machine": describe(), "load_average_before": os.getloadavg(), "runs": []}
    for algo in args.runs.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            flags = ["--algo", algo, "--env", args.env, "--frames", args.frames, "--seed", seed,
                     "--no-progress"] + args.extra.split()
            print(f"[bench rl] {algo} seed {seed} ...", file=sys.stderr, flush=True)
            ranks = args.apex_ranks if algo == "apex" else RANKS[algo]
            run = mpidl_rl(ranks, flags, args.timeout)
            run.update(algo=algo, seed=seed, ranks=ranks)
            out["runs"].append(run)
            f = run["final"]
            print(f"[bench rl] {algo} seed {seed}: final {f['final_eval_100']:.1f}, best "
                  f"{f.get('best_eval_100')} at {f.get('best_at_frames')} frames, "
                  f"{f['wall_s']:.0f} s", file=sys.stderr, flush=True)
            _write(out, args)  # after every run: a long benchmark stopped keeps its runs
    out["load_average_after"] = os.getloadavg()
    path = _write(out, args)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for run in out["runs"]:
            label = f"{run['algo']} ({run['ranks']} rank{'s' * (run['ranks'] > 1)}) seed {run['seed']}"
            xs = [e["frames"] for e in run["evals"]]
            ts = [e["wall_s"] for e in run["evals"]]
            ys = [e["eval_return"] for e in run["evals"]]
            axes[0].plot(xs, ys, label=label)
            axes[1].plot(ts, ys, label=label)
        for ax, xl in zip(axes, ("environment frames", "wall time (s, shared 2-core machine)")):
            if args.env.startswith("CartPole"):
                ax.axhline(475, color="grey", ls=":", lw=1)
            ax.set_xlabel(xl)
            ax.set_ylabel("greedy return (--eval-episodes)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{args.env}: evaluation return")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, args.name + ".png"), dpi=110)
    print(path)


def solo(args):
    """One Ape-X actor's own work and nothing else (no MPI, no learner, no shard): rounds
    of ``actor_steps`` CartPole frames with the Q-network, the batch's initial priorities
    and its pickling (what an insert message costs the actor); prints frames/s."""
    import pickle  # noqa: PLC0415

    from mpidl.rl.actor import Actor  # noqa: PLC0415
    from mpidl.rl.apex import initial_priorities  # noqa: PLC0415
    from mpidl.rl.config import RLConfig  # noqa: PLC0415
    from mpidl.rl.dqn import DQN  # noqa: PLC0415
    from mpidl.rl.envs import describe as env_shape  # noqa: PLC0415

    cfg = RLConfig(env=args.env, hidden=(16,), seed=args.seed)
    obs_shape, n_actions = env_shape(cfg.env)
    actor = Actor(cfg.env, args.seed, cfg.apex_eps, n_step=cfg.n_step, gamma=cfg.gamma)
    dqn = DQN(obs_shape, n_actions, network=cfg.network, hidden=cfg.hidden, huber=cfg.huber,
              double=cfg.double, seed=cfg.seed, optimizer=False)
    t0 = time.perf_counter()
    while actor.frames < args.frames:
        batch = actor.run(dqn.online, min(cfg.actor_steps, args.frames - actor.frames))
        pickle.dumps({"batch": batch, "priorities": initial_priorities(cfg, dqn, batch)})
    print(json.dumps({"frames_per_s": actor.frames / (time.perf_counter() - t0)}))


def solo_rates(k, args):
    """frames/s of ``k`` solo actors run at once (separate processes, started together)."""
    cmd = [sys.executable, os.path.abspath(__file__), "solo", "--env", args.env,
           "--frames", str(args.actor_frames // 2)]
    procs = [subprocess.Popen(cmd + ["--seed", str(i)], stdout=subprocess.PIPE, text=True,
                              env=launch_env(ROOT)) for i in range(k)]
    rates = []
    for p in procs:
        stdout, _ = p.communicate(timeout=args.timeout)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode})")
        rates.append(json.loads(stdout.strip().splitlines()[-1])["frames_per_s"])
    return rates


def throughput(args):
    out = {"machine": describe(), "load_average_before": os.getloadavg(),
           "actor_scaling": [], "solo_scaling": [], "learner_scaling": []}
    base = ["--env", args.env, "--no-progress", "--eval-every", "0", "--final-episodes", "1",
            "--hidden", "16"]
    runs = {1: [], 2: []}
    solos = {1: [], 2: []}
    for rep in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        for k in (1, 2):  # the anchor: the actor's own work alone, 1 and 2 at once
            solos[k].append(sum(solo_rates(k, args)))
            print(f"[bench rl] {k} solo actor(s), run {rep + 1}: {solos[k][-1]:.0f} frames/s",
                  file=sys.stderr, flush=True)
        for actors in (1, 2):
            r = mpidl_rl(2 + actors, ["--algo", "apex", "--frames", args.actor_frames,
                                      "--replay-ratio", "0.0001", "--learn-start", "100",
                                      "--max-owed", "1000000"] + base, args.timeout)
            runs[actors].append(r)
            print(f"[bench rl] {actors} actor(s), run {rep + 1}: "
                  f"{r['final']['actor_frames_per_s']:.0f} frames/s", file=sys.stderr, flush=True)
    for k, rates in solos.items():
        out["solo_scaling"].append({"processes": k, "frames_per_s": statistics.median(rates),
                                    "runs_frames_per_s": rates})
    for actors, rs in runs.items():
        rates = [r["final"]["actor_frames_per_s"] for r in rs]
        out["actor_scaling"].append({"actors": actors, "ranks": 2 + actors,
                                     "actor_frames_per_s": statistics.median(rates),
                                     "runs_frames_per_s": rates, "command": rs[0]["command"]})
    for actors in (1, 2, 4, 6):
        shards = max(1, actors // 2)
        r = mpidl_rl(1 + shards + actors,
                     ["--algo", "apex", "--replay-shards", shards, "--frames",
                      args.learner_frames * actors, "--replay-ratio", "1",
                      "--learn-start", "100", "--batch-size", "32", "--sleep-update",
                      args.sleep, "--max-owed", args.max_owed] + base, args.timeout)
        f = r["final"]
        out["learner_scaling"].append({"actors": actors, "shards": shards,
                                       "ranks": 1 + shards + actors,
                                       "updates": f["updates"], "updates_per_s": f["updates_per_s"],
                                       "learner_busy_s": f["learner_busy_s"],
                                       "wall_s": f["wall_s"], "command": r["command"]})
        print(f"[bench rl] {actors} actors, {shards} shards: {f['updates_per_s']:.1f} updates/s",
              file=sys.stderr, flush=True)
    out["load_average_after"] = os.getloadavg()
    a = out["actor_scaling"]
    out["actor_speedup_2_vs_1"] = a[1]["actor_frames_per_s"] / a[0]["actor_frames_per_s"]
    so = out["solo_scaling"]
    out["solo_speedup_2_vs_1"] = so[1]["frames_per_s"] / so[0]["frames_per_s"]
    print(f"[bench rl] 2 actors vs 1: {out['actor_speedup_2_vs_1']:.2f}x; the machine's "
          f"anchor, 2 solo actors vs 1 (no MPI, no learner): {out['solo_speedup_2_vs_1']:.2f}x",
          file=sys.stderr, flush=True)
    path = os.path.join(args.out_dir, "rl_throughput.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        xs = np.arange(len(a))
        axes[0].bar(xs - 0.2, [x["actor_frames_per_s"] for x in a], 0.4,
                    label="Ape-X actors (+ learner + shard)")
        axes[0].bar(xs + 0.2, [x["frames_per_s"] for x in so], 0.4,
                    label="solo actors (no MPI, no learner)")
        axes[0].set_xticks(xs, [str(x["actors"]) for x in a])
        axes[0].set_xlabel("actors")
        axes[0].set_ylabel("actor frames/s (all actors)")
        axes[0].legend(fontsize=8)
        ls = out["learner_scaling"]
        axes[1].plot([x["actors"] for x in ls], [x["updates_per_s"] for x in ls], "o-")
        axes[1].set_xlabel("actors (shards = max(1, actors/2))")
        axes[1].set_ylabel(f"learner updates/s (compute = sleep {args.sleep}s)")
        axes[1].set_ylim(bottom=0)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "rl_throughput.png"), dpi=110)
    print(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("learn")
    lp.add_argument("--runs", default="dqn,apex")
    lp.add_argument("--seeds", default="0")
    lp.add_argument("--env", default="CartPole-v1")
    lp.add_argument("--frames", type=int, default=100_000)
    lp.add_argument("--extra", default="", help="more mpidl rl flags, quoted")
    lp.add_argument("--name", default="rl_cartpole")
    lp.add_argument("--apex-ranks", type=int, default=4,
                    help="ranks of the apex runs: 1 learner, 1 shard, the rest actors")
    tp = sub.add_parser("throughput")
    tp.add_argument("--env", default="CartPole-v1")
    tp.add_argument("--actor-frames", type=int, default=120_000)
    tp.add_argument("--repeats", type=int, default=3,
                    help="runs of each actor count, interleaved (the median is kept)")
    tp.add_argument("--max-owed", type=int, default=200,
                    help="learner scaling: actors wait while the learner owes more updates")
    tp.add_argument("--learner-frames", type=int, default=500,
                    help="frames per actor in the learner-scaling runs")
    tp.add_argument("--sleep", type=float, default=0.01)
    for q in (lp, tp):
        q.add_argument("--out-dir", default=os.path.join(HERE, "results"))
        q.add_argument("--timeout", type=int, default=3600)
    sp = sub.add_parser("solo", help="one actor's own work alone (throughput's anchor)")
    sp.add_argument("--env", default="CartPole-v1")
    sp.add_argument("--frames", type=int, default=60_000)
    sp.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.what == "solo":
        return solo(args)
    os.makedirs(args.out_dir, exist_ok=True)
    return learn(args) if args.what == "learn" else throughput(args)


if __name__ == "__main__":
    main()

"""``mpidl rl``: DQN on one process, Ape-X or Gorila on many.

Like ``mpidl train``: values come from built-in defaults, then ``--config FILE.toml``,
then flags; everything that can be wrong with the input (unknown environment, a network
that cannot take its observations, more replay shards than ranks) is found before any
rank sends a message, and ends every rank with one line and status 2. Rank roles come from
the rank count and the flags (``mpidl.rl.roles``). The learner prints one JSON line per
evaluation and a final one; a progress bar of frames goes to stderr.
"""

import argparse
import dataclasses
import json
import sys

from mpidl.errors import ConfigError

HELP = {
    "algo": "dqn (one process), apex (learner + replay shards + actors) or gorila "
            "(parameter servers + learners + actors)",
    "env": "gymnasium environment, e.g. CartPole-v1 (MinAtar/Breakout-v1 with minatar)",
    "network": "Q-network: mlp, or conv for (H, W, C) frames",
    "hidden": "hidden widths of the MLP, comma-separated",
    "seed": "seed of the network, the learner's sampling and every actor (actor i: "
            "seed*1000+1+i)",
    "frames": "environment frames over all actors",
    "lr": "Adam learning rate (the learner's, or the parameter servers')",
    "gamma": "discount",
    "n_step": "n of the n-step returns",
    "batch_size": "learner batch size",
    "replay_capacity": "transitions kept over all shards (FIFO eviction)",
    "learn_start": "frames before the first update",
    "replay_ratio": "learner updates per environment frame",
    "target_every": "updates between copies of the online network into the target",
    "huber": "Huber loss threshold",
    "clip_norm": "clip gradients to this global L2 norm (0: off)",
    "double": "double DQN targets",
    "prioritized": "prioritised replay (default: on for dqn/apex, off for gorila)",
    "alpha": "priority exponent",
    "beta": "importance-weight exponent, annealed linearly to 1 over the run",
    "eps_start": "dqn: epsilon at the start",
    "eps_end": "dqn: epsilon after --eps-frames",
    "eps_frames": "dqn: frames over which epsilon falls",
    "apex_eps": "apex/gorila: actor i of N explores with apex_eps^(1 + apex_eps_alpha "
                "i/(N-1))",
    "apex_eps_alpha": "see --apex-eps",
    "actor_steps": "actors send their transitions and pull parameters every K steps",
    "max_owed": "async back-pressure: an actor's pull waits while the learner owes more "
                "updates than this to the replay ratio",
    "actors": "actors (0: every rank left over)",
    "replay_shards": "apex: replay shard ranks (default 1)",
    "learners": "gorila: learner ranks",
    "servers": "gorila: parameter-server ranks",
    "eval_every": "frames between greedy evaluations (0: only the final one)",
    "eval_episodes": "episodes per evaluation",
    "final_episodes": "episodes of the final greedy evaluation",
    "deterministic": "lockstep schedule, every event logged (see --log-dir): the run can "
                     "be replayed bitwise in one process (mpidl.rl.replay_check)",
    "log_dir": "write every rank's event log and the final parameters and replay here",
    "progress": "progress bar on stderr",
    "sleep_update": "benchmarks: seconds the learner sleeps per update (emulated compute)",
}
SKIP = ("extra",)


def _hidden(text):
    try:
        widths = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected widths like 128,128, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive widths like 128,128, got {text!r}")
    return widths


def _fields():
    from mpidl.rl.config import RLConfig  # noqa: PLC0415

    return [f for f in dataclasses.fields(RLConfig) if f.name not in SKIP]


def register(subparsers):
    from mpidl.rl.config import ALGOS  # noqa: PLC0415

    p = subparsers.add_parser(
        "rl", help="reinforcement learning: DQN, Ape-X, Gorila",
        description="Deep Q-learning on one process (--algo dqn) or distributed (--algo "
        "apex: 1 learner, --replay-shards shards, the other ranks actors; --algo gorila: "
        "--servers parameter servers, --learners learners, the other ranks actors). "
        "Values come from defaults, then --config FILE.toml, then these flags.",
        epilog="examples:\n  mpidl rl --algo dqn --env CartPole-v1 --frames 60000\n"
        "  mpiexec -n 4 mpidl rl --algo apex --env CartPole-v1\n"
        "  mpiexec -n 4 mpidl rl --algo gorila --deterministic --log-dir runs/g1\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE.toml", default=None,
                   help="TOML file of settings (keys are these flags' names)")
    for f in _fields():
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        kw = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction,
                           help=HELP[f.name] + f" (default: {default})", **kw)
            continue
        if f.name == "hidden":
            typ = _hidden
        elif f.name == "algo":
            p.add_argument(flag, choices=ALGOS, help=HELP[f.name] + f" (default: {default})",
                           **kw)
            continue
        else:
            typ = type(default) if default is not None else str
        p.add_argument(flag, type=typ, metavar=f.name.split("_")[-1].upper(),
                       help=HELP[f.name] + f" (default: {default})", **kw)
    p.set_defaults(prepare=prepare)
    return p


def load_config_file(path):
    from mpidl.config import read_toml  # noqa: PLC0415

    table = read_toml(path)
    names = {f.name: f for f in _fields()}
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in names:
            raise ConfigError(f"unknown key {key!r} in config file {path}; valid keys: "
                              f"{', '.join(names)}")
        if name == "hidden":
            value = tuple(value) if isinstance(value, list) else _hidden(value)
        out[name] = value
    return out


def resolve(args):
    from mpidl.rl.config import RLConfig  # noqa: PLC0415

    given = {}
    if args.config:
        given.update(load_config_file(args.config))
    given.update({f.name: getattr(args, f.name) for f in _fields() if hasattr(args, f.name)})
    if "prioritized" not in given and given.get("algo") == "gorila":
        given["prioritized"] = False  # Gorila's replay is uniform
    try:
        return RLConfig(**given)
    except TypeError as e:
        raise ConfigError(f"bad settings: {e}") from None


def prepare(args, world):
    """Phase 1 (local, no messages): settings, environment, network, roles."""
    from mpidl.rl.run import check  # noqa: PLC0415
    from mpidl.training.log import setup_logging  # noqa: PLC0415

    cfg = resolve(args)
    log = setup_logging(world.rank)
    roles, obs_shape, n_actions = check(cfg, world.size)

    def job():
        from mpidl.rl.run import run  # noqa: PLC0415

        comm = None
        if world.size > 1:
            from mpidl.comm import Communicator  # noqa: PLC0415

            comm = Communicator(world.mpi)
        if world.rank == 0:
            parts = [f"{cfg.algo} on {cfg.env} (obs {obs_shape}, {n_actions} actions), "
                     f"{cfg.frames} frames"]
            for name in ("servers", "learners", "shards", "actors"):
                ranks = getattr(roles, name)
                if ranks and cfg.algo != "dqn":
                    parts.append(f"{name} {list(ranks)}")
            if cfg.deterministic:
                parts.append("deterministic (lockstep)")
            log.info(" | ".join(parts))
        run(cfg, comm, roles, obs_shape, n_actions)
        if comm is not None:
            comm.barrier()
            comm.close()
        return 0

    return job


def dump(cfg):
    return json.dumps(cfg.as_dict())


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: mpidl rl ...")

"""Run one rank's role of an RL job (``mpidl rl`` and the tests call this)."""

from mpidl.rl import apex, gorila
from mpidl.rl.envs import describe
from mpidl.rl.roles import assign
from mpidl.rl.single import run_dqn


def check(cfg, size):
    """Everything that can be wrong with the input, before any message: returns
    ``(roles, obs_shape, n_actions)``; raises ``UserError``s."""
    from mpidl.errors import ConfigError  # noqa: PLC0415
    from mpidl.rl.dqn import build_q_network  # noqa: PLC0415

    roles = assign(cfg, size)
    obs_shape, n_actions = describe(cfg.env)
    build_q_network(cfg.network, obs_shape, n_actions, cfg.hidden, cfg.seed)
    for name in ("frames", "batch_size", "replay_capacity", "actor_steps", "n_step"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                              f"{getattr(cfg, name)}")
    if cfg.frames < len(roles.actors) * cfg.actor_steps and cfg.algo != "dqn":
        raise ConfigError(f"--frames {cfg.frames} is less than one stretch of "
                          f"--actor-steps {cfg.actor_steps} for each of the "
                          f"{len(roles.actors)} actors")
    return roles, obs_shape, n_actions


def run(cfg, comm, roles, obs_shape, n_actions, out=None):
    """This rank's part; returns the final metrics on the reporting rank, else None."""
    if cfg.algo == "dqn":
        return run_dqn(cfg, out=out)
    role = roles.role(comm.rank)
    mod = apex if cfg.algo == "apex" else gorila
    if role == "actor":
        mod.actor_main(cfg, roles, comm, obs_shape, n_actions)
    elif role == "shard":
        apex.shard_main(cfg, roles, comm, obs_shape)
    elif role == "server":
        gorila.server_main(cfg, roles, comm, obs_shape, n_actions)
    else:
        cls = apex.ApexLearner if cfg.algo == "apex" else gorila.GorilaLearner
        return cls(cfg, roles, comm, obs_shape, n_actions, out=out).run()
    return None

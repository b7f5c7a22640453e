"""Environments by name (gymnasium, MinAtar through gymnasium), checked for DQN.

DQN needs a discrete action space and an array observation; anything else is a user error
named here, before any rank starts talking to another.
"""

import numpy as np

from mpidl.errors import ConfigError, UserError


def gymnasium_or_error():
    try:
        import gymnasium  # noqa: PLC0415
    except ImportError:
        raise UserError("mpidl rl needs gymnasium: pip install 'mpidl[rl]' (or pip install "
                        "gymnasium)") from None
    return gymnasium


def make_env(name, seed=None):
    """A gymnasium environment ``name``, reset with ``seed``; returns ``(env, obs)``."""
    gym = gymnasium_or_error()
    if name.startswith("MinAtar/"):
        try:
            import minatar.gym  # noqa: PLC0415
        except ImportError:
            raise UserError(f"--env {name}: MinAtar is not installed (pip install minatar)") \
                from None
        if name not in gym.registry:
            minatar.gym.register_envs()  # MinAtar registers its games only when asked
    try:
        env = gym.make(name)
    except Exception as e:  # noqa: BLE001 - gymnasium raises several kinds for a bad name
        known = ", ".join(sorted(k for k in gym.registry if k.startswith(("CartPole",
                                                                            "Acrobot",
                                                                            "MountainCar"))))
        raise UserError(f"--env {name}: unknown environment ({type(e).__name__}: "
                        f"{str(e).splitlines()[0]}); try one of {known}, or "
                        f"MinAtar/Breakout-v1 with minatar installed") from None
    obs, _ = env.reset(seed=seed)
    return env, np.asarray(obs, dtype=np.float64)


def describe(name):
    """``(obs_shape, n_actions)`` of environment ``name``, or a ConfigError saying why DQN
    cannot drive it."""
    gym = gymnasium_or_error()
    env, obs = make_env(name, seed=0)
    try:
        if not isinstance(env.action_space, gym.spaces.Discrete):
            raise ConfigError(f"--env {name}: DQN needs a discrete action space, the "
                              f"environment has {env.action_space}")
        if not isinstance(env.observation_space, gym.spaces.Box):
            raise ConfigError(f"--env {name}: the Q-network takes array observations "
                              f"(a Box space), the environment gives {env.observation_space}")
        return tuple(obs.shape), int(env.action_space.n)
    finally:
        env.close()

"""The environment side: an actor steps its environment epsilon-greedily and turns the
steps into n-step transitions.

An actor's whole trajectory is a function of its seed, its epsilon and the parameters it
was given before each stretch of steps, nothing else (its own ``numpy`` generator draws the
exploration, the environment is seeded once and reset without a seed after that). That is
what lets a distributed run be replayed in one process: same seed, same parameters at the
same steps, same transitions.

n-step returns: the transition leaving ``s_t`` is ``(s_t, a_t, sum_{k<n} gamma^k r_{t+k},
s_{t+n}, gamma^n)``; an episode that *terminates* within the n steps gives discount 0 (no
bootstrap), one cut by a time limit (*truncated*) keeps ``gamma^k`` and bootstraps from
the last observation, as the true return goes on.
"""

from collections import deque

import numpy as np

from mpidl.rl.dqn import greedy
from mpidl.rl.envs import make_env
from mpidl.rl.replay import FIELDS


class NStep:
    """Turns (s, a, r, s', terminated, truncated) steps into n-step transitions."""

    def __init__(self, n, gamma):
        self.n, self.gamma = int(n), float(gamma)
        self.window = deque()
        self.out = {k: [] for k in FIELDS}

    def _emit(self, next_obs, terminated):
        ret, g = 0.0, 1.0
        for _, _, r in self.window:
            ret += g * r
            g *= self.gamma
        s, a, _ = self.window.popleft()
        o = self.out
        o["obs"].append(s)
        o["action"].append(a)
        o["reward"].append(ret)
        o["next_obs"].append(next_obs)
        o["discount"].append(0.0 if terminated else g)

    def step(self, obs, action, reward, next_obs, terminated, truncated):
        self.window.append((obs, int(action), float(reward)))
        if terminated or truncated:
            while self.window:
                self._emit(next_obs, terminated)
        elif len(self.window) == self.n:
            self._emit(next_obs, False)

    def take(self, obs_shape):
        """The transitions completed so far, as a batch; the buffer empties."""
        o, self.out = self.out, {k: [] for k in FIELDS}
        shape = (len(o["action"]),) + tuple(obs_shape)
        return {"obs": np.array(o["obs"], dtype=np.float64).reshape(shape),
                "action": np.array(o["action"], dtype=np.int64),
                "reward": np.array(o["reward"], dtype=np.float64),
                "next_obs": np.array(o["next_obs"], dtype=np.float64).reshape(shape),
                "discount": np.array(o["discount"], dtype=np.float64)}


class Actor:
    """One environment, an epsilon (a number, or a function of the frames done), a local
    copy of the Q-network, and the n-step buffer."""

    def __init__(self, env_name, seed, epsilon, n_step=3, gamma=0.99):
        self.env, self.obs = make_env(env_name, seed=int(seed))
        self.obs_shape = self.obs.shape
        self.rng = np.random.default_rng([int(seed), 1])
        self.epsilon = epsilon
        self.nstep = NStep(n_step, gamma)
        self.frames = 0
        self.episode_return = 0.0
        self.returns = []  # returns of finished episodes, in order

    def eps(self):
        return self.epsilon(self.frames) if callable(self.epsilon) else float(self.epsilon)

    def run(self, net, steps):
        """Take ``steps`` environment steps with ``net``; returns the n-step transitions
        completed (episodes go on across calls)."""
        n_actions = self.env.action_space.n
        for _ in range(int(steps)):
            # one uniform draw per step whatever its outcome: the stream stays aligned
            explore = self.rng.random() < self.eps()
            r_action = int(self.rng.integers(n_actions))
            action = r_action if explore else int(greedy(net, self.obs[None])[0])
            nxt, reward, terminated, truncated, _ = self.env.step(action)
            nxt = np.asarray(nxt, dtype=np.float64)
            self.nstep.step(self.obs, action, reward, nxt, terminated, truncated)
            self.frames += 1
            self.episode_return += float(reward)
            if terminated or truncated:
                self.returns.append(self.episode_return)
                self.episode_return = 0.0
                nxt, _ = self.env.reset()
                nxt = np.asarray(nxt, dtype=np.float64)
            self.obs = nxt
        return self.nstep.take(self.obs_shape)


def evaluate(net, env_name, episodes=100, seed=10**6, max_steps=None):
    """Mean and all returns of ``episodes`` greedy episodes (seeded ``seed + k``),
    stepped together so the network sees one batch per step."""
    envs, obs = [], []
    for k in range(episodes):
        env, o = make_env(env_name, seed=seed + k)
        envs.append(env)
        obs.append(o)
    returns = np.zeros(episodes)
    live = list(range(episodes))
    steps = 0
    while live and (max_steps is None or steps < max_steps):
        acts = greedy(net, np.stack([obs[k] for k in live]))
        still = []
        for k, a in zip(live, acts):
            o, r, term, trunc, _ = envs[k].step(int(a))
            returns[k] += r
            obs[k] = np.asarray(o, dtype=np.float64)
            if not (term or trunc):
                still.append(k)
        live = still
        steps += 1
    for env in envs:
        env.close()
    return float(returns.mean()), returns

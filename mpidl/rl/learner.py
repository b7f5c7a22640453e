"""What every learner does with a sampled batch: DQN's update with importance weights
and beta annealed from ``beta`` to 1 over the run (Schaul et al.), then new priorities.

Shared by the single-process DQN, Ape-X's learner rank and the replay check, so that the
three run literally the same arithmetic.
"""

import numpy as np

from mpidl.rl.dqn import DQN
from mpidl.rl.replay import linear


class Learner:
    def __init__(self, cfg, obs_shape, n_actions, optimizer=True):
        self.cfg = cfg
        self.dqn = DQN(obs_shape, n_actions, network=cfg.network, hidden=cfg.hidden,
                       lr=cfg.lr, huber=cfg.huber, clip_norm=cfg.clip_norm,
                       double=cfg.double, target_every=cfg.target_every, seed=cfg.seed,
                       optimizer=optimizer)
        # the sampling stream: which transitions, drawn by the learner only
        self.rng = np.random.default_rng([int(cfg.seed), 2])
        self.last_loss = float("nan")

    @property
    def net(self):
        return self.dqn.online

    def beta(self, frames):
        if not self.cfg.prioritized:
            return 0.0
        return linear(self.cfg.beta, 1.0, frames / max(1, self.cfg.frames))

    def learn(self, data, weights):
        """One update; returns the new |TD errors| (the sampled items' priorities)."""
        td, self.last_loss = self.dqn.learn(data, weights if self.cfg.prioritized else None)
        return td

    def gradients(self, data, weights):
        """Gorila: gradients only (the parameter server steps)."""
        td, self.last_loss, _ = self.dqn.compute_gradients(
            data, weights if self.cfg.prioritized else None)
        return td


def updates_due(cfg, frames, stored, done):
    """Updates owed after ``frames`` environment frames when ``done`` were made: none until
    ``learn_start`` transitions are stored, then ``replay_ratio`` per frame after that."""
    if stored < cfg.learn_start or frames < cfg.learn_start:
        return 0
    return max(0, int(cfg.replay_ratio * (frames - cfg.learn_start)) - done)

"""DQN on mpidl layers: Q-network, target network, double DQN targets over n-step
transitions, Huber loss weighted by importance weights, gradient clipping.

Everything is float64 and deterministic, so a distributed run and its single-process
replay compute the same bits. ``compute_gradients`` is separate from the optimizer step
because Gorila's learners push gradients to a parameter server instead of stepping.
"""

import math

import numpy as np

from mpidl.engine.activations import ReLU
from mpidl.engine.clip import clip_grad_norm
from mpidl.engine.conv import Conv2d
from mpidl.engine.init import as_generator
from mpidl.engine.linear import Linear
from mpidl.engine.losses import HuberLoss
from mpidl.engine.models import build_model
from mpidl.engine.module import Layer, Sequential
from mpidl.engine.optim import Adam
from mpidl.engine.reshape import Flatten
from mpidl.errors import ConfigError

NETWORKS = ("mlp", "conv")


class ToChannelsFirst(Layer):
    """MinAtar frames are (H, W, C); mpidl's convolutions take (N, C, H, W)."""

    def forward(self, x):
        return np.ascontiguousarray(np.asarray(x, dtype=np.float64).transpose(0, 3, 1, 2))

    def backward(self, dy):
        return None


def build_q_network(network, obs_shape, n_actions, hidden=(64, 64), seed=0):
    """The Q-network: ``mlp`` (any observation, flattened) or ``conv`` (MinAtar's
    (10, 10, C) frames: one 3x3 conv with 16 channels, then a 128-unit layer)."""
    obs_shape = tuple(obs_shape)
    if network == "mlp":
        return build_model("mlp", input_shape=obs_shape, num_classes=n_actions, seed=seed,
                           dtype="float64", hidden=tuple(hidden))
    if network == "conv":
        if len(obs_shape) != 3:
            raise ConfigError(f"--network conv takes (height, width, channels) frames, the "
                              f"environment gives observations of shape {obs_shape}; use "
                              "--network mlp")
        h, w, c = obs_shape
        rng = as_generator(seed)
        net = Sequential(ToChannelsFirst(),
                         Conv2d(c, 16, 3, rng=rng, dtype="float64"), ReLU(), Flatten(),
                         Linear(16 * (h - 2) * (w - 2), 128, rng=rng, dtype="float64"),
                         ReLU(),
                         Linear(128, n_actions, init="glorot_uniform", rng=rng,
                                dtype="float64"))
        net.needs_input_grad = False
        return net
    raise ConfigError(f"--network {network!r}: expected one of {', '.join(NETWORKS)}")


def copy_params(src, dst):
    """``dst``'s parameters become a copy of ``src``'s (same names, same order)."""
    for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
        q.data[...] = p.data


def param_arrays(net):
    return [p.data.copy() for _, p in net.named_parameters()]


def load_arrays(net, arrays):
    for (_, p), a in zip(net.named_parameters(), arrays):
        p.data[...] = a


def greedy(net, obs):
    """Greedy actions for a batch of observations (argmax, lowest index on ties)."""
    q = net.forward(np.asarray(obs, dtype=np.float64))
    net.discard_saved()
    return np.argmax(q, axis=1)


def apex_epsilon(i, n, base=0.4, alpha=7.0):
    """Ape-X's per-actor exploration: ``eps_i = base^(1 + alpha i / (n - 1))``."""
    if n <= 1:
        return base
    return base ** (1.0 + alpha * i / (n - 1))


class DQN:
    """The learner's side of DQN: online and target networks and the update."""

    def __init__(self, obs_shape, n_actions, network="mlp", hidden=(64, 64), lr=1e-3,
                 huber=1.0, clip_norm=10.0, double=True, target_every=500, seed=0,
                 optimizer=True):
        self.online = build_q_network(network, obs_shape, n_actions, hidden, seed)
        self.target = build_q_network(network, obs_shape, n_actions, hidden, seed)
        copy_params(self.online, self.target)
        self.n_actions = n_actions
        self.loss = HuberLoss(huber)
        self.clip_norm = clip_norm
        self.double = double
        self.target_every = int(target_every)
        self.updates = 0
        self.opt = Adam(self.online.named_parameters(), lr=lr) if optimizer else None

    def targets(self, batch, net=None):
        """``r + gamma^n Q_target(s', argmax_a Q_online(s', a))`` (double DQN) or
        ``r + gamma^n max_a Q_target(s', a)``."""
        online = self.online if net is None else net
        target = self.target if net is None else net
        nxt = batch["next_obs"]
        q_t = target.forward(nxt)
        target.discard_saved()
        if self.double:
            q_o = online.forward(nxt)
            online.discard_saved()
            best = np.argmax(q_o, axis=1)
        else:
            best = np.argmax(q_t, axis=1)
        rows = np.arange(len(best))
        return batch["reward"] + batch["discount"] * q_t[rows, best]

    def td_errors(self, batch, net=None):
        """|TD error| of each transition (actors' initial priorities use their own copy of
        the online network for both roles)."""
        net = self.online if net is None else net
        y = self.targets(batch, net=net if net is not self.online else None)
        q = net.forward(batch["obs"])
        net.discard_saved()
        return np.abs(q[np.arange(len(y)), batch["action"]] - y)

    def compute_gradients(self, batch, weights=None):
        """Gradients of the weighted Huber loss into the online network's ``grad``s,
        clipped by global norm; returns ``(|TD errors|, loss, norm)``."""
        y = self.targets(batch)
        net = self.online
        net.zero_grad()
        q = net.forward(batch["obs"])
        rows = np.arange(len(y))
        q_sa = q[rows, batch["action"]]
        loss = self.loss.forward(q_sa, y, weights)
        dq = np.zeros_like(q)
        dq[rows, batch["action"]] = self.loss.backward()
        net.backward(dq)
        norm = clip_grad_norm(net.named_parameters(), self.clip_norm)
        return np.abs(q_sa - y), loss, norm

    def after_update(self):
        """Count an update; copy the online network into the target every
        ``target_every`` updates."""
        self.updates += 1
        if self.target_every and self.updates % self.target_every == 0:
            copy_params(self.online, self.target)

    def learn(self, batch, weights=None):
        """One local update (DQN, Ape-X's learner); returns ``(|TD errors|, loss)``."""
        td, loss, _ = self.compute_gradients(batch, weights)
        self.opt.step()
        self.opt.zero_grad()
        self.after_update()
        return td, loss

    def finite(self):
        return all(math.isfinite(float(np.abs(p.data).max()))
                   for _, p in self.online.named_parameters())

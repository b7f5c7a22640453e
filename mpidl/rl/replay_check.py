"""Replay a distributed run in one process from its logged event order.

A distributed Ape-X or Gorila run with ``--log-dir`` writes, per role, the order in which
things happened there: each replay shard (Ape-X) or learner (Gorila) the order of its
inserts (actor, batch number), samples, priority updates and updates; each actor the
parameter version it pulled before each batch; the Ape-X learner the beta of each update.
Nothing else is needed: an actor's batch is a function of its seed and the parameters it
pulled, a shard's answer a function of its contents and the request, the learner's update
a function of the answers. ``replay_apex``/``replay_gorila`` redo every event in that order
in this process, with the same classes, and return the final learner parameters and
replay contents, which the tests hold bitwise against the distributed run's.
"""

import json
import os

import numpy as np

from mpidl.rl.actor import Actor
from mpidl.rl.apex import actor_seed, initial_priorities
from mpidl.rl.dqn import DQN, apex_epsilon, load_arrays, param_arrays
from mpidl.rl.envs import describe
from mpidl.rl.learner import Learner
from mpidl.rl.replay import ReplayShard, ShardedReplay, importance_weights, plan, take


def _load(log_dir, name):
    with open(os.path.join(log_dir, name)) as f:
        return json.load(f)


def _count(log_dir, prefix):
    n = 0
    while os.path.exists(os.path.join(log_dir, f"{prefix}{n}.json")):
        n += 1
    return n


class ReplayedActors:
    """The actors, stepped on demand: batch ``j`` of actor ``i`` with the parameters of
    the version it pulled (which must already exist: a logged order that needs a later
    version breaks causality and is refused)."""

    def __init__(self, cfg, log_dir, obs_shape, n_actions, versions):
        self.cfg = cfg
        self.n = _count(log_dir, "actor")
        self.pulls = [_load(log_dir, f"actor{i}.json")["pulls"] for i in range(self.n)]
        self.each = cfg.frames // self.n
        self.versions = versions
        self.actors, self.nets, self.batches = [], [], []
        for i in range(self.n):
            eps = apex_epsilon(i, self.n, cfg.apex_eps, cfg.apex_eps_alpha)
            self.actors.append(Actor(cfg.env, actor_seed(cfg, i), eps, n_step=cfg.n_step,
                                     gamma=cfg.gamma))
            self.nets.append(DQN(obs_shape, n_actions, network=cfg.network,
                                 hidden=cfg.hidden, huber=cfg.huber, double=cfg.double,
                                 seed=cfg.seed, optimizer=False))
            self.batches.append([])

    def batch(self, i, j):
        while len(self.batches[i]) <= j:
            k = len(self.batches[i])
            v = self.pulls[i][k]
            if v not in self.versions:
                raise AssertionError(f"actor {i} batch {k} pulled version {v}, which the "
                                     f"replay has not reached (it has {max(self.versions)})")
            dqn, actor = self.nets[i], self.actors[i]
            load_arrays(dqn.online, self.versions[v])
            b = actor.run(dqn.online, min(self.cfg.actor_steps, self.each - actor.frames))
            self.batches[i].append((b, initial_priorities(self.cfg, dqn, b)))
        return self.batches[i][j]


def _shard_state(shard):
    return {"tree": shard.tree.tree, "next": shard.next, "size": shard.size, **shard.data}


def _params(net):
    return {n: p.data.copy() for n, p in net.named_parameters()}


def replay_apex(cfg, log_dir):
    obs_shape, n_actions = describe(cfg.env)
    learner = Learner(cfg, obs_shape, n_actions)
    versions = {0: param_arrays(learner.net)}
    actors = ReplayedActors(cfg, log_dir, obs_shape, n_actions, versions)
    S = _count(log_dir, "shard")
    logs = [_load(log_dir, f"shard{s}.json")["events"] for s in range(S)]
    betas = _load(log_dir, "learner.json")["betas"]
    shards = [ReplayShard(max(1, cfg.replay_capacity // S), obs_shape,
                          alpha=cfg.alpha if cfg.prioritized else 0.0) for _ in range(S)]
    cursor = [0] * S

    def advance(s, until=None):
        """Redo shard ``s``'s inserts up to the event ``until`` (consumed), or to the end."""
        log = logs[s]
        while cursor[s] < len(log):
            ev = log[cursor[s]]
            cursor[s] += 1
            if ev[0] == "insert":
                shards[s].insert(*actors.batch(ev[1], ev[2]))
            elif until is not None and ev == list(until):
                return
            else:
                raise AssertionError(f"shard {s}: event {ev} where {until} was expected")
        if until is not None:
            raise AssertionError(f"shard {s}: the log ends before {until}")

    B = cfg.batch_size
    for u, beta in enumerate(betas):
        for s in range(S):
            advance(s, ("totals", u))
        T = [sh.total for sh in shards]
        stored = sum(sh.size for sh in shards)
        which, prefix = plan(T, B, learner.rng)
        slots, values, data = np.zeros(B, np.int64), np.zeros(B), None
        for s in range(S):
            advance(s, ("sample", u))
            mine = np.flatnonzero(which == s)
            if mine.size:
                sl, va, part = shards[s].sample(prefix[mine])
            else:
                sl, va, part = np.zeros(0, np.int64), np.zeros(0), take(shards[s].data, mine)
            if data is None:
                data = {f: np.zeros((B,) + v.shape[1:], v.dtype) for f, v in part.items()}
            slots[mine], values[mine] = sl, va
            for f, v in part.items():
                data[f][mine] = v
        w = importance_weights(values, sum(T), stored, beta)
        td = learner.learn(data, w)
        versions[u + 1] = param_arrays(learner.net)
        for s in range(S):
            advance(s, ("prio", u))
            mine = np.flatnonzero(which == s)
            shards[s].update_priorities(slots[mine], td[mine])
    for s in range(S):
        advance(s)
    return _params(learner.net), [_shard_state(sh) for sh in shards]


def replay_gorila(cfg, log_dir):
    """One learner; its Adam is the servers' (the same class and hyper-parameters)."""
    obs_shape, n_actions = describe(cfg.env)
    learner = Learner(cfg, obs_shape, n_actions)
    versions = {0: param_arrays(learner.net)}
    actors = ReplayedActors(cfg, log_dir, obs_shape, n_actions, versions)
    shard = ReplayShard(cfg.replay_capacity, obs_shape,
                        alpha=cfg.alpha if cfg.prioritized else 0.0)
    replay = ShardedReplay([shard])
    for ev in _load(log_dir, "learner.json")["events"]:
        if ev[0] == "insert":
            shard.insert(*actors.batch(ev[1], ev[2]))
        else:
            _, u, beta = ev
            s, slots, w, data = replay.sample(cfg.batch_size, learner.rng, beta)
            td = learner.learn(data, w)
            replay.update_priorities(s, slots, td)
            versions[u + 1] = param_arrays(learner.net)
    return _params(learner.net), [_shard_state(shard)]


def load_run(log_dir):
    """The distributed run's final learner parameters and replay shard contents."""
    with np.load(os.path.join(log_dir, "learner.npz")) as z:
        params = {k: z[k] for k in z.files}
    shards = []
    s = 0
    while os.path.exists(os.path.join(log_dir, f"shard{s}.npz")):
        with np.load(os.path.join(log_dir, f"shard{s}.npz")) as z:
            shards.append({k: z[k] for k in z.files})
        s += 1
    return params, shards

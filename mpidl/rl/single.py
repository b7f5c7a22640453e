"""Single-process DQN (with n-step, double DQN and prioritised replay): ``--algo dqn``.

Each step: one environment step with epsilon annealed linearly, the transition into the
replay (priority: the largest seen, as in PER), then as many updates as the replay ratio
owes. The reference the distributed algorithms are measured against.
"""

from mpidl.rl.actor import Actor
from mpidl.rl.envs import describe
from mpidl.rl.learner import Learner, updates_due
from mpidl.rl.metrics import Tracker
from mpidl.rl.replay import ReplayShard, ShardedReplay, linear


def run_dqn(cfg, out=None):
    obs_shape, n_actions = describe(cfg.env)
    learner = Learner(cfg, obs_shape, n_actions)
    shard = ReplayShard(cfg.replay_capacity, obs_shape,
                        alpha=cfg.alpha if cfg.prioritized else 0.0)
    replay = ShardedReplay([shard])
    actor = Actor(cfg.env, seed=cfg.seed * 1000 + 1,
                  epsilon=lambda f: linear(cfg.eps_start, cfg.eps_end, f / cfg.eps_frames),
                  n_step=cfg.n_step, gamma=cfg.gamma)
    tracker = Tracker(cfg, learner.net, out=out)
    frames = updates = 0
    while frames < cfg.frames:
        batch = actor.run(learner.net, 1)
        frames += 1
        shard.insert(batch)
        tracker.episodes(actor.returns)
        actor.returns.clear()
        for _ in range(updates_due(cfg, frames, shard.size, updates)):
            s, slots, w, data = replay.sample(cfg.batch_size, learner.rng,
                                              learner.beta(frames))
            td = learner.learn(data, w)
            replay.update_priorities(s, slots, td)
            updates += 1
        tracker.maybe_eval(frames, updates, replay_size=shard.size)
    return tracker.final(frames, updates, replay_size=shard.size)

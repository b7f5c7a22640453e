"""Gorila (Nair et al. 2015) on mpidl's parameter server: learners compute DQN gradients
from their own replay memory and push them to ``mpidl.ps`` servers (async mode: Downpour,
each push applied on arrival with the servers' Adam); actors pull the parameters from the
servers every ``actor_steps`` steps and send their transitions to their learner.

The servers are ``mpidl.ps.ParameterServer`` unchanged (every learner and actor is one of
its "workers": learners push, actors only pull); learners and actors talk to them through
``mpidl.ps.PSWorker``. Lockstep (``--deterministic``): in round r each learner tells its
actors to pull ("go"), takes their inserts in actor order, then makes the updates its
replay ratio owes; with one learner the servers then see one push at a time and every
pull lands between two rounds.
"""

import time


from mpidl.comm import ANY_SOURCE
from mpidl.engine.optim import Adam
from mpidl.ps import ModeConfig, ParameterServer, PSWorker, shard_parameters
from mpidl.rl.apex import (check_fail, fail_steps, initial_priorities, make_actor,
                           write_json, write_npz)
from mpidl.rl.dqn import build_q_network
from mpidl.rl.learner import Learner, updates_due
from mpidl.rl.metrics import Tracker
from mpidl.rl.protocol import TAG_GO, TAG_REQ, Mailbox
from mpidl.rl.replay import ReplayShard, ShardedReplay


def schedule(cfg, roles, learner):
    """(frames per actor, rounds) for the actors of ``learner``: the run's frames are
    split evenly over all actors."""
    each = cfg.frames // len(roles.actors)
    return each, -(-each // cfg.actor_steps)


def workers(roles):
    return sorted(roles.learners + roles.actors)


def layout(cfg, roles, obs_shape, n_actions):
    net = build_q_network(cfg.network, obs_shape, n_actions, cfg.hidden, cfg.seed)
    return net, shard_parameters(net.named_parameters(), len(roles.servers))


def server_main(cfg, roles, comm, obs_shape, n_actions):
    net, lay = layout(cfg, roles, obs_shape, n_actions)
    index = roles.servers.index(comm.rank)
    params = {n: p for n, p in net.named_parameters() if n in lay.names[index]}
    opt = Adam(list(params.items()), lr=cfg.lr)
    server = ParameterServer(comm, index, params, opt, ModeConfig("async").check(
        len(workers(roles))), workers(roles), list(roles.servers), trace=cfg.deterministic)
    stats = server.serve()
    write_json(cfg, f"server{index}.json", {"trace": stats.trace, "updates": stats.updates,
                                            "pulls": stats.pulls})


def actor_main(cfg, roles, comm, obs_shape, n_actions):
    rank = comm.rank
    i, actor, dqn = make_actor(cfg, roles, rank, obs_shape, n_actions)
    _, lay = layout(cfg, roles, obs_shape, n_actions)
    ps = PSWorker(comm, dqn.online.named_parameters(), lay, roles.servers)
    box = Mailbox(comm, f"gorila actor {i}, rank {rank}")
    learner = roles.learner_of(rank)
    each, rounds = schedule(cfg, roles, learner)
    fails = fail_steps(rank)
    pulls = []
    for j in range(rounds):
        check_fail(rank, fails, j)
        box.recv(learner, TAG_GO, "the learner's go")
        ps.pull()
        pulls.append(ps.versions[roles.servers[0]])
        batch = actor.run(dqn.online, min(cfg.actor_steps, each - actor.frames))
        box.send(learner, TAG_REQ, kind="insert", actor=i, seq=j, batch=batch,
                 priorities=initial_priorities(cfg, dqn, batch), returns=actor.returns,
                 frames=actor.frames)
        actor.returns = []
    box.send(learner, TAG_REQ, kind="done", returns=actor.returns, frames=actor.frames)
    box.flush()
    ps.finish()
    write_json(cfg, f"actor{i}.json", {"pulls": pulls, "frames": actor.frames})


class GorilaLearner:
    def __init__(self, cfg, roles, comm, obs_shape, n_actions, out=None):
        self.cfg, self.roles, self.comm = cfg, roles, comm
        self.rank = comm.rank
        self.actors = roles.actors_of(self.rank)
        self.learner = Learner(cfg, obs_shape, n_actions, optimizer=False)
        _, lay = layout(cfg, roles, obs_shape, n_actions)
        self.ps = PSWorker(comm, self.learner.net.named_parameters(), lay, roles.servers)
        L = len(roles.learners)
        self.shard = ReplayShard(max(1, cfg.replay_capacity // L), obs_shape,
                                 alpha=cfg.alpha if cfg.prioritized else 0.0)
        self.replay = ShardedReplay([self.shard])
        self.box = Mailbox(comm, f"gorila learner, rank {self.rank}")
        self.tracker = Tracker(cfg, self.learner.net, out=out)
        self.frames = {a: 0 for a in self.actors}
        self.done = set()
        self.log = []
        self.updates = 0
        self.t_update = 0.0

    def take(self, msg, src):
        self.tracker.episodes(msg["returns"])
        self.frames[src] = msg["frames"]
        if msg["kind"] == "done":
            self.done.add(src)
        elif msg["kind"] == "insert":
            self.shard.insert(msg["batch"], msg["priorities"])
            self.log.append(["insert", msg["actor"], msg["seq"]])
        else:
            raise RuntimeError(f"gorila learner: unexpected {msg['kind']!r} from rank {src}")

    def update(self, frames):
        t0 = time.perf_counter()
        beta = self.learner.beta(frames)
        s, slots, w, data = self.replay.sample(self.cfg.batch_size, self.learner.rng, beta)
        td = self.learner.gradients(data, w)
        self.ps.push()                      # the servers step; their parameters come back
        self.replay.update_priorities(s, slots, td)
        self.learner.dqn.after_update()
        self.log.append(["update", self.updates, beta])
        self.updates += 1
        if self.cfg.sleep_update:
            time.sleep(self.cfg.sleep_update)
        self.t_update += time.perf_counter() - t0

    def run(self):
        cfg = self.cfg
        # the learner's own frames: its actors' (the replay ratio is per learner)
        self.ps.pull()
        if cfg.deterministic:
            each, rounds = schedule(cfg, self.roles, self.rank)
            for r in range(rounds):
                for a in self.actors:
                    self.box.send(a, TAG_GO, kind="go", round=r)
                for a in self.actors:
                    self.take(*self.box.recv(a, TAG_REQ, f"round {r}'s insert from actor rank {a}"))
                frames = sum(self.frames.values())
                for _ in range(updates_due(cfg, frames, self.shard.size, self.updates)):
                    self.update(frames)
                self.tracker.maybe_eval(frames, self.updates, replay_size=self.shard.size)
            for a in self.actors:
                self.take(*self.box.recv(a, TAG_REQ, f"done from actor rank {a}"))
        else:
            # back-pressure: the "go" that lets an actor pull again is sent only while the
            # learner owes at most max_owed updates
            _, rounds = schedule(cfg, self.roles, self.rank)
            for a in self.actors:
                self.box.send(a, TAG_GO, kind="go")
            waiting = []
            while True:
                got = self.box.poll(ANY_SOURCE, TAG_REQ)
                while got is not None:
                    self.take(*got)
                    if got[0]["kind"] == "insert" and got[0]["seq"] + 1 < rounds:
                        waiting.append(got[1])
                    got = self.box.poll(ANY_SOURCE, TAG_REQ)
                frames = sum(self.frames.values())
                owed = updates_due(cfg, frames, self.shard.size, self.updates)
                if owed <= cfg.max_owed:
                    for a in waiting:
                        self.box.send(a, TAG_GO, kind="go")
                    waiting = []
                if owed > 0:
                    self.update(frames)
                    self.tracker.maybe_eval(frames, self.updates, replay_size=self.shard.size)
                elif len(self.done) == len(self.actors):
                    break
                else:
                    msg, src = self.box.recv(ANY_SOURCE, TAG_REQ, "inserts from the actors")
                    self.take(msg, src)
                    if msg["kind"] == "insert" and msg["seq"] + 1 < rounds:
                        waiting.append(src)
        self.box.flush()
        frames = sum(self.frames.values())
        self.ps.finish()
        write_json(cfg, "learner.json", {"events": self.log, "updates": self.updates})
        write_npz(cfg, "learner.npz", **{n: p.data for n, p in self.learner.net.named_parameters()})
        write_npz(cfg, "shard0.npz", tree=self.shard.tree.tree, next=self.shard.next,
                  size=self.shard.size, **self.shard.data)
        wall = self.tracker.wall()
        return self.tracker.final(frames, self.updates, actor_frames_per_s=frames / wall,
                                  updates_per_s=self.updates / wall,
                                  replay_size=self.shard.size,
                                  learner_busy_s=round(self.t_update, 3))

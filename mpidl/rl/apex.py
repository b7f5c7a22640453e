"""Ape-X (Horgan et al. 2018): actors with their own epsilon compute initial priorities
and send n-step transitions in batches to prioritised replay shards; one learner samples
over all shards by priority, updates, sends the new priorities back to the owning shard;
actors pull the learner's parameters every ``actor_steps`` steps.

Two schedules, one code path: *async* (the real thing: every rank as fast as it can,
the learner answering pulls between updates, actors asking a round ahead and acting on
with the parameters they have until the answer comes) and *lockstep* (``--deterministic``: in
round r every actor pulls, steps ``actor_steps`` frames and inserts, the shards take the
round's inserts in actor order before any learner request, then the learner makes the
updates the replay ratio owes). Both log every event where it happens (shards: inserts,
totals, samples, priority updates; actors: the version each batch acted with; learner: beta of
each update), and ``replay_check`` replays those logs in one process.
"""

import json
import math
import os
import time

import numpy as np

from mpidl.comm import ANY_SOURCE
from mpidl.ps.protocol import Poller
from mpidl.rl.actor import Actor
from mpidl.rl.dqn import DQN, apex_epsilon, load_arrays, param_arrays
from mpidl.rl.learner import Learner, updates_due
from mpidl.rl.metrics import Tracker
from mpidl.rl.protocol import TAG_REP, TAG_REQ, Mailbox
from mpidl.rl.replay import ReplayShard, importance_weights, plan, take

IDLE_NAP_S = 1e-3  # nap between probes of an idle async learner or shard
LEARNER_BUSY_S = 0.02  # a shard's learner is updating if it asked this recently


def schedule(cfg, n_actors):
    """(frames per actor, rounds): every actor steps ``frames // n_actors`` frames in
    stretches of ``actor_steps``."""
    each = cfg.frames // n_actors
    return each, math.ceil(each / cfg.actor_steps)


def round_frames(cfg, n_actors, r):
    """Frames stepped by all actors after round ``r`` (lockstep)."""
    each, _ = schedule(cfg, n_actors)
    return n_actors * min((r + 1) * cfg.actor_steps, each)


def actor_seed(cfg, i):
    return cfg.seed * 1000 + 1 + i


def write_json(cfg, name, obj):
    if cfg.log_dir:
        os.makedirs(cfg.log_dir, exist_ok=True)
        with open(os.path.join(cfg.log_dir, name), "w") as f:
            json.dump(obj, f)


def write_npz(cfg, name, **arrays):
    if cfg.log_dir:
        os.makedirs(cfg.log_dir, exist_ok=True)
        np.savez(os.path.join(cfg.log_dir, name), **arrays)


def fail_steps(rank):
    from mpidl import env  # noqa: PLC0415

    return env.rank_steps("MPIDL_FAIL_AT").get(rank, set())


def check_fail(rank, steps, j):
    if j in steps:
        from mpidl.training.trainer import InjectedFailure  # noqa: PLC0415

        raise InjectedFailure(f"actor rank {rank}: failure injected before round {j} "
                              "(MPIDL_FAIL_AT)")


# --------------------------------------------------------------------------- actor
def make_actor(cfg, roles, rank, obs_shape, n_actions):
    i = roles.actors.index(rank)
    eps = apex_epsilon(i, len(roles.actors), cfg.apex_eps, cfg.apex_eps_alpha)
    actor = Actor(cfg.env, actor_seed(cfg, i), eps, n_step=cfg.n_step, gamma=cfg.gamma)
    # a copy of the Q-network: acting, and the initial priorities (it plays online and
    # target network at once, as the actor has no target copy)
    dqn = DQN(obs_shape, n_actions, network=cfg.network, hidden=cfg.hidden, huber=cfg.huber,
              double=cfg.double, seed=cfg.seed, optimizer=False)
    return i, actor, dqn


def initial_priorities(cfg, dqn, batch):
    if not cfg.prioritized or len(batch["action"]) == 0:
        return None if not cfg.prioritized else np.zeros(0)
    return dqn.td_errors(batch, net=dqn.online)


def actor_main(cfg, roles, comm, obs_shape, n_actions):
    rank = comm.rank
    i, actor, dqn = make_actor(cfg, roles, rank, obs_shape, n_actions)
    box = Mailbox(comm, f"apex actor {i}, rank {rank}")
    learner = roles.learners[0]
    each, rounds = schedule(cfg, len(roles.actors))
    fails = fail_steps(rank)
    # Asynchronously, as in Ape-X, the actor does not stop for the learner: it asks for
    # parameters a round ahead and takes the answer when it has come, acting meanwhile
    # with those it has; it waits only while two asks are unanswered (the learner holds
    # pulls back while it owes updates: back-pressure). The lockstep mode asks and waits
    # at the start of each round: its schedule answers all of a round's pulls before that
    # round's updates.
    ahead = not cfg.deterministic
    pulls = []
    asked = 0  # pulls the learner has not answered yet
    version = None

    def pull():
        nonlocal asked
        box.send(learner, TAG_REQ, kind="pull", returns=actor.returns, frames=actor.frames)
        actor.returns = []
        asked += 1

    def take(wait):
        """Load the learner's next answer (waiting for it, or only if it has come)."""
        nonlocal asked, version
        got = (box.recv(learner, TAG_REP, "parameters from the learner") if wait
               else box.poll(learner, TAG_REP))
        if got is None:
            return False
        load_arrays(dqn.online, got[0]["arrays"])
        version = got[0]["version"]
        asked -= 1
        return True

    for j in range(rounds):
        check_fail(rank, fails, j)
        if j == 0 or not ahead:
            pull()
        while asked and take(wait=not ahead or j == 0 or asked > 1):
            pass
        pulls.append(version)
        if ahead and j + 1 < rounds:
            pull()
        batch = actor.run(dqn.online, min(cfg.actor_steps, each - actor.frames))
        box.send(roles.shard_for(rank, j), TAG_REQ, kind="insert", actor=i, seq=j,
                 batch=batch, priorities=initial_priorities(cfg, dqn, batch))
    while asked:  # every answer received: none left in flight when the learner finishes
        take(wait=True)
    for s in roles.shards:
        box.send(s, TAG_REQ, kind="done")
    box.send(learner, TAG_REQ, kind="done", returns=actor.returns, frames=actor.frames)
    box.flush()
    write_json(cfg, f"actor{i}.json", {"pulls": pulls, "frames": actor.frames})


# --------------------------------------------------------------------------- shard
def shard_main(cfg, roles, comm, obs_shape):
    rank = comm.rank
    index = roles.shards.index(rank)
    S = len(roles.shards)
    shard = ReplayShard(max(1, cfg.replay_capacity // S), obs_shape,
                        alpha=cfg.alpha if cfg.prioritized else 0.0)
    box = Mailbox(comm, f"replay shard {index}, rank {rank}")
    learner = roles.learners[0]
    log, done = [], set()

    def handle(msg, src):
        kind = msg["kind"]
        if kind == "insert":
            shard.insert(msg["batch"], msg["priorities"])
            log.append(["insert", msg["actor"], msg["seq"]])
        elif kind == "totals":
            box.send(src, TAG_REP, kind="totals", total=shard.total, size=shard.size,
                     inserted=shard.inserted)
            log.append(["totals", msg["update"]])
        elif kind == "sample":
            prefixes = msg["prefixes"]
            if len(prefixes):
                slots, values, data = shard.sample(prefixes)
            else:
                slots, values = np.zeros(0, np.int64), np.zeros(0)
                data = take(shard.data, slots)
            box.send(src, TAG_REP, kind="sample", slots=slots, values=values, batch=data)
            log.append(["sample", msg["update"]])
        elif kind == "prio":
            shard.update_priorities(msg["slots"], msg["priorities"])
            log.append(["prio", msg["update"]])
        elif kind == "done":
            done.add(src)
        elif kind not in ("round_end", "stop"):
            raise RuntimeError(f"replay shard rank {rank}: unknown message {kind!r} from "
                               f"rank {src}")
        return kind

    if cfg.deterministic:
        _, rounds = schedule(cfg, len(roles.actors))
        for r in range(rounds):
            for a in roles.actors:
                if roles.shard_for(a, r) == rank:
                    handle(*box.recv(a, TAG_REQ, f"round {r}'s insert from actor rank {a}"))
            while handle(*box.recv(learner, TAG_REQ, "the learner's requests")) != "round_end":
                pass
        while handle(*box.recv(learner, TAG_REQ, "the learner's stop")) != "stop":
            pass
    else:
        # Asynchronously: while the learner is updating (a request from it in the last
        # LEARNER_BUSY_S), it waits for each answer, so the shard probes from 20 us;
        # otherwise only inserts come, which no one waits for, and the shard naps longer
        # between probes: each wake-up of an idle rank takes a core from an actor.
        idle = Poller(comm, first=IDLE_NAP_S, who=f"replay shard {index}, rank {rank}")
        kind, heard = None, -math.inf
        while kind != "stop":
            busy = time.perf_counter() - heard < LEARNER_BUSY_S
            msg, src = box.recv(ANY_SOURCE, TAG_REQ, "inserts and learner requests",
                                poller=None if busy else idle)
            if src == learner:
                heard = time.perf_counter()
            kind = handle(msg, src)
    while len(done) < len(roles.actors):  # every actor's last message is in
        handle(*box.recv(ANY_SOURCE, TAG_REQ, "the actors' done"))
    stats = {"shard": index, "rank": rank, "size": shard.size, "inserted": shard.inserted,
             "sampled": shard.sampled}
    box.send(learner, TAG_REP, kind="stats", **stats)
    box.flush()
    write_json(cfg, f"shard{index}.json", {"events": log, **stats})
    write_npz(cfg, f"shard{index}.npz", tree=shard.tree.tree, next=shard.next,
              size=shard.size, **shard.data)


# --------------------------------------------------------------------------- learner
class ApexLearner:
    def __init__(self, cfg, roles, comm, obs_shape, n_actions, out=None):
        self.cfg, self.roles, self.comm = cfg, roles, comm
        self.learner = Learner(cfg, obs_shape, n_actions)
        self.box = Mailbox(comm, f"apex learner, rank {comm.rank}")
        # Idle, the asynchronous learner waits for the actors' pulls, which ask for the
        # parameters a round ahead: an answer a little later costs them nothing, and
        # longer naps leave the cores to them (the mailbox's own poller, which starts at
        # 20 us, serves the replay shards' answers, on which an update waits).
        self.pull_poller = Poller(comm, first=IDLE_NAP_S, who=f"apex learner, rank {comm.rank}")
        self.tracker = Tracker(cfg, self.learner.net, out=out)
        self.version = 0
        self.frames = {a: 0 for a in roles.actors}
        self.done = set()
        self.betas = []
        self.stored = 0
        self.pull_lag = []  # updates since the previous pull, per pull: staleness
        self.last_pull = {a: 0 for a in roles.actors}
        self.t_update = 0.0

    @property
    def total_frames(self):
        return sum(self.frames.values())

    def answer(self, msg, src):
        kind = msg["kind"]
        if kind not in ("pull", "done"):
            raise RuntimeError(f"apex learner: unexpected {kind!r} from rank {src}")
        self.tracker.episodes(msg["returns"])
        self.frames[src] = msg["frames"]
        if kind == "done":
            self.done.add(src)
            return
        self.pull_lag.append(self.version - self.last_pull[src])
        self.last_pull[src] = self.version
        self.box.send(src, TAG_REP, kind="params", version=self.version,
                      arrays=param_arrays(self.learner.net))

    def ask_shards(self, what, **msg):
        for s in self.roles.shards:
            self.box.send(s, TAG_REQ, kind=what, update=self.version, **msg)
        return [self.box.recv(s, TAG_REP, f"'{what}' from replay shard rank {s}")[0]
                for s in self.roles.shards]

    def update(self, frames):
        t0 = time.perf_counter()
        cfg, shards = self.cfg, self.roles.shards
        beta = self.learner.beta(frames)
        totals = self.ask_shards("totals")
        T = [t["total"] for t in totals]
        self.stored = sum(t["size"] for t in totals)
        which, prefix = plan(T, cfg.batch_size, self.learner.rng)
        for k, s in enumerate(shards):
            self.box.send(s, TAG_REQ, kind="sample", update=self.version,
                          prefixes=prefix[which == k])
        B = cfg.batch_size
        slots, values = np.zeros(B, np.int64), np.zeros(B)
        data = None
        for k, s in enumerate(shards):
            msg, _ = self.box.recv(s, TAG_REP, f"samples from replay shard rank {s}")
            mine = np.flatnonzero(which == k)
            if data is None:
                data = {f: np.zeros((B,) + v.shape[1:], v.dtype) for f, v in msg["batch"].items()}
            slots[mine], values[mine] = msg["slots"], msg["values"]
            for f, v in msg["batch"].items():
                data[f][mine] = v
        w = importance_weights(values, sum(T), self.stored, beta)
        td = self.learner.learn(data, w)
        for k, s in enumerate(shards):
            mine = np.flatnonzero(which == k)
            self.box.send(s, TAG_REQ, kind="prio", update=self.version, slots=slots[mine],
                          priorities=td[mine])
        self.betas.append(beta)
        self.version += 1
        if cfg.sleep_update:
            time.sleep(cfg.sleep_update)
        self.t_update += time.perf_counter() - t0

    def metrics(self):
        return {"replay_size": self.stored, "staleness_mean":
                float(np.mean(self.pull_lag)) if self.pull_lag else 0.0,
                "learner_busy_s": round(self.t_update, 3)}

    def run(self):
        cfg, roles = self.cfg, self.roles
        A = len(roles.actors)
        if cfg.deterministic:
            _, rounds = schedule(cfg, A)
            for r in range(rounds):
                for a in roles.actors:
                    self.answer(*self.box.recv(a, TAG_REQ, f"round {r}'s pull from actor rank {a}"))
                frames = round_frames(cfg, A, r)
                for _ in range(updates_due(cfg, frames, frames, self.version)):
                    self.update(frames)
                for s in roles.shards:
                    self.box.send(s, TAG_REQ, kind="round_end", round=r)
                self.tracker.maybe_eval(frames, self.version, **self.metrics())
            for a in roles.actors:
                self.answer(*self.box.recv(a, TAG_REQ, f"done from actor rank {a}"))
        else:
            # back-pressure: a pull is answered only while the learner owes at most
            # max_owed updates, so actors cannot run ahead of the replay ratio
            held = []
            while True:
                got = self.box.poll(ANY_SOURCE, TAG_REQ)
                while got is not None:
                    held.append(got)
                    got = self.box.poll(ANY_SOURCE, TAG_REQ)
                frames = self.total_frames
                owed = updates_due(cfg, frames, frames, self.version)
                if owed <= cfg.max_owed:
                    for msg, src in held:
                        self.answer(msg, src)
                    held = []
                if owed > 0:
                    self.update(frames)
                    self.tracker.maybe_eval(frames, self.version, **self.metrics())
                elif len(self.done) == A:
                    break
                else:
                    held.append(self.box.recv(ANY_SOURCE, TAG_REQ, "pulls from the actors",
                                              poller=self.pull_poller))
        frames = self.total_frames
        stats = []
        for s in roles.shards:
            self.box.send(s, TAG_REQ, kind="stop")
        for s in roles.shards:
            stats.append(self.box.recv(s, TAG_REP, f"stats from replay shard rank {s}")[0])
        self.box.flush()
        write_json(cfg, "learner.json", {"betas": self.betas, "updates": self.version})
        write_npz(cfg, "learner.npz", **{n: p.data for n, p in self.learner.net.named_parameters()})
        wall = self.tracker.wall()
        return self.tracker.final(
            frames, self.version, actor_frames_per_s=frames / wall,
            updates_per_s=self.version / wall,
            inserted=sum(s["inserted"] for s in stats), sampled=sum(s["sampled"] for s in stats),
            insert_per_s=sum(s["inserted"] for s in stats) / wall,
            sample_per_s=sum(s["sampled"] for s in stats) / wall, **self.metrics())

"""Which rank does what, from the rank count and the flags; user errors name the fix.

apex:   rank 0 the learner, ranks 1..S replay shards, the rest actors.
gorila: ranks 0..P-1 parameter servers, then L learners (each with its own replay, as in
        Gorila's "bundled" mode), the rest actors; actor i feeds learner i mod L.
dqn:    one process, no MPI traffic.
"""

from dataclasses import dataclass

from mpidl.errors import ConfigError


@dataclass(frozen=True)
class Roles:
    algo: str
    size: int
    learners: tuple
    shards: tuple
    servers: tuple
    actors: tuple

    def role(self, rank):
        for name in ("learners", "shards", "servers", "actors"):
            if rank in getattr(self, name):
                return name[:-1]
        return None

    def learner_of(self, actor_rank):
        """Gorila: the learner an actor feeds."""
        return self.learners[self.actors.index(actor_rank) % len(self.learners)]

    def actors_of(self, learner_rank):
        return tuple(a for a in self.actors if self.learner_of(a) == learner_rank)

    def shard_for(self, actor_rank, seq):
        """Ape-X: actor ``i``'s ``seq``-th batch goes to shard ``(i + seq) mod S``."""
        i = self.actors.index(actor_rank)
        return self.shards[(i + seq) % len(self.shards)]


def assign(cfg, size):
    algo = cfg.algo
    if algo == "dqn":
        if size != 1:
            raise ConfigError(f"--algo dqn is single-process, but {size} ranks were started; "
                              "run it without mpiexec, or use --algo apex or gorila")
        return Roles("dqn", 1, (0,), (), (), (0,))
    if algo == "apex":
        S = 1 if cfg.replay_shards < 0 else cfg.replay_shards
        if S < 1:
            raise ConfigError(f"--replay-shards {S}: Ape-X needs at least one replay shard")
        if cfg.learners != 1:
            raise ConfigError(f"--learners {cfg.learners}: Ape-X here has one learner")
        A = cfg.actors or size - 1 - S
        need = 1 + S + max(A, 1)
        if A < 1 or need != size:
            raise ConfigError(
                f"--replay-shards {S} and {'--actors ' + str(cfg.actors) if cfg.actors else 'at least 1 actor'} "
                f"with {size} ranks: Ape-X needs 1 learner + {S} replay shard(s) + "
                f"{max(A, 1)} actor(s) = {need} ranks; start mpiexec -n {need} or change "
                "--replay-shards/--actors")
        return Roles("apex", size, (0,), tuple(range(1, 1 + S)), (),
                     tuple(range(1 + S, size)))
    if algo == "gorila":
        if cfg.replay_shards > 0:
            raise ConfigError(f"--replay-shards {cfg.replay_shards}: Gorila keeps each "
                              "learner's replay memory inside the learner (bundled); "
                              "replay shards are for --algo apex")
        P, L = cfg.servers, cfg.learners
        if P < 1 or L < 1:
            raise ConfigError(f"Gorila needs --servers >= 1 and --learners >= 1, got "
                              f"{P} and {L}")
        A = cfg.actors or size - P - L
        need = P + L + max(A, 1)
        if A < 1 or need != size:
            raise ConfigError(
                f"--servers {P} --learners {L} with {size} ranks: Gorila needs {P} "
                f"server(s) + {L} learner(s) + {max(A, 1)} actor(s) = {need} ranks; start "
                f"mpiexec -n {need} or change --servers/--learners/--actors")
        return Roles("gorila", size, tuple(range(P, P + L)), (), tuple(range(P)),
                     tuple(range(P + L, size)))
    raise ConfigError(f"--algo {algo!r}: expected dqn, apex or gorila")

"""The settings of an RL run, one dataclass shared by every role and the replay check."""

from dataclasses import asdict, dataclass, field, fields

ALGOS = ("dqn", "apex", "gorila")


@dataclass
class RLConfig:
    algo: str = "dqn"
    env: str = "CartPole-v1"
    network: str = "mlp"
    hidden: tuple = (128, 128)
    seed: int = 0
    frames: int = 100_000          # environment frames over all actors
    lr: float = 5e-4
    gamma: float = 0.99
    n_step: int = 3
    batch_size: int = 64
    replay_capacity: int = 50_000  # over all shards
    learn_start: int = 1_000       # stored transitions before the first update
    replay_ratio: float = 0.25     # learner updates per environment frame
    target_every: int = 500        # updates between target-network copies
    huber: float = 1.0
    clip_norm: float = 10.0
    double: bool = True
    prioritized: bool = True
    alpha: float = 0.6
    beta: float = 0.4              # annealed linearly to 1 over the run's frames
    eps_start: float = 1.0         # dqn: epsilon from eps_start to eps_end over eps_frames
    eps_end: float = 0.01
    eps_frames: int = 10_000
    apex_eps: float = 0.4          # apex/gorila: actor i of N explores with
    apex_eps_alpha: float = 7.0    # apex_eps^(1 + apex_eps_alpha i / (N - 1))
    actor_steps: int = 50          # actors send transitions and pull parameters every K steps
    max_owed: int = 100            # async: actors wait while the learner owes more updates
    actors: int = 0                # 0: from the rank count
    replay_shards: int = -1        # -1: apex 1, gorila 0 (replay inside the learner)
    learners: int = 1
    servers: int = 1
    eval_every: int = 5_000        # frames between evaluations (eval_episodes greedy ones)
    eval_episodes: int = 10
    final_episodes: int = 100
    deterministic: bool = False
    log_dir: str = None
    progress: bool = True
    sleep_update: float = 0.0      # benchmarks: seconds slept per learner update
    extra: dict = field(default_factory=dict)

    def as_dict(self):
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def keys(cls):
        return [f.name for f in fields(cls)]

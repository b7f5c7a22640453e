"""Learning-rate schedules: ``schedule = make_schedule(...)``; ``opt.lr = schedule(step)``.

A schedule is ``lr(step) = warmup(step) * main(step)`` over the absolute step count
(0-based): the linear warm-up factor ``min(1, (step + 1) / warmup_steps)`` multiplies any
main schedule, so warm-up composes with all of them. Large-batch data parallelism uses
it: scale ``base_lr`` by the number of ranks and warm up over a few epochs (Goyal et al.,
"Accurate, Large Minibatch SGD", 2017). Schedules count steps; pass
``epochs * steps_per_epoch`` for epoch-based settings.

Main schedules:
- ``constant``: ``base_lr``.
- ``step``: ``base_lr * gamma ** (step // step_size)``; or with ``milestones``,
  ``gamma ** (number of milestones <= step)``.
- ``cosine``: ``min_lr + (base_lr - min_lr) * (1 + cos(pi * step / total_steps)) / 2``.
- ``linear``: from ``base_lr`` down to ``min_lr`` at ``total_steps``.
Past ``total_steps`` the decaying schedules stay at ``min_lr``.
"""

import bisect
import math

SCHEDULES = ("constant", "step", "cosine", "linear")


class Schedule:
    """A callable ``step -> lr``; build it with ``make_schedule``."""

    def __init__(self, kind, base_lr, total_steps, warmup_steps, step_size, gamma, milestones,
                 min_lr):
        self.kind, self.base_lr, self.total_steps = kind, base_lr, total_steps
        self.warmup_steps, self.step_size, self.gamma = warmup_steps, step_size, gamma
        self.milestones, self.min_lr = milestones, min_lr

    def main(self, step):
        if self.kind == "constant":
            return self.base_lr
        if self.kind == "step":
            k = (bisect.bisect_right(self.milestones, step) if self.milestones
                 else step // self.step_size)
            return self.base_lr * self.gamma ** k
        progress = min(step / self.total_steps, 1.0)
        if self.kind == "cosine":
            return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.base_lr - self.min_lr) * (1.0 - progress)  # linear

    def warmup(self, step):
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)

    def __call__(self, step):
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.warmup(step) * self.main(step)

    def __repr__(self):
        return (f"Schedule({self.kind!r}, base_lr={self.base_lr}, total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps})")


def make_schedule(kind, base_lr, total_steps=None, warmup_steps=0, step_size=None, gamma=0.1,
                  milestones=None, min_lr=0.0):
    """Build a schedule (see the module docstring for the formulas)."""
    kind = str(kind).lower()
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
    base_lr = float(base_lr)
    if not base_lr > 0:
        raise ValueError(f"base_lr must be > 0, got {base_lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if kind in ("cosine", "linear"):
        if total_steps is None or total_steps < 1:
            raise ValueError(f"a {kind} schedule needs total_steps >= 1, got {total_steps}")
        if not 0.0 <= min_lr <= base_lr:
            raise ValueError(f"min_lr must be in [0, base_lr={base_lr}], got {min_lr}")
    if kind == "step":
        if milestones is not None:
            milestones = sorted(int(m) for m in milestones)
        elif step_size is None or step_size < 1:
            raise ValueError(f"a step schedule needs step_size >= 1 (or milestones), got "
                             f"{step_size}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    return Schedule(kind, base_lr, total_steps, int(warmup_steps), step_size, float(gamma),
                    milestones, float(min_lr))

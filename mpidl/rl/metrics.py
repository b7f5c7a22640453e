"""Progress of an RL run: frames, episodes, returns, evaluations, rates; JSON lines.

One ``Tracker`` lives on the rank that reports (the learner): it gets episode returns from
the actors, times the run, evaluates the greedy policy every ``eval_every`` frames and
keeps the parameters of the best evaluation, whose 100-episode score is the run's result.
"""

import json
import sys
import time

import numpy as np

from mpidl.rl.actor import evaluate
from mpidl.rl.dqn import load_arrays, param_arrays

#: the final evaluation's episodes are seeded FINAL_SEED + k: none of them is one of the
#: periodic evaluations' (seeded 10^6 + 1000 e + k) that chose the best parameters
FINAL_SEED = 2 * 10**6


class Tracker:
    def __init__(self, cfg, net, out=None):
        self.cfg, self.net = cfg, net
        self.t0 = time.perf_counter()
        self.returns = []
        self.history = []  # one dict per evaluation
        self.next_eval = cfg.eval_every
        self.best = None   # (eval mean, frames, arrays)
        self.bar = None
        self.out = out if out is not None else sys.stdout

    def wall(self):
        return time.perf_counter() - self.t0

    def episodes(self, returns):
        self.returns.extend(float(r) for r in returns)

    def line(self, **extra):
        last = self.returns[-100:]
        return {"frames": 0, "episodes": len(self.returns),
                "mean_return_100": float(np.mean(last)) if last else None,
                "wall_s": round(self.wall(), 3), **extra}

    def maybe_eval(self, frames, updates, **extra):
        """Evaluate when ``frames`` passed the next evaluation point; prints a JSON line."""
        self.tick(frames, updates)
        if self.cfg.eval_every <= 0 or frames < self.next_eval:
            return None
        while self.next_eval <= frames:
            self.next_eval += self.cfg.eval_every
        return self.eval_now(frames, updates, **extra)

    def tick(self, frames, updates):
        """Move the progress bar (stderr, tqdm) to ``frames``."""
        if not self.cfg.progress:
            return
        if self.bar is None:
            from tqdm import tqdm  # noqa: PLC0415

            tty = sys.stderr.isatty()
            self.bar = tqdm(total=self.cfg.frames, desc=self.cfg.algo, unit="frame",
                            file=sys.stderr, leave=tty, dynamic_ncols=True,
                            mininterval=0.2 if tty else 5.0)
        if frames > self.bar.n:
            last = self.returns[-100:]
            self.bar.set_postfix({"return100": f"{np.mean(last):.1f}" if last else "-",
                                  "updates": updates}, refresh=False)
            self.bar.update(frames - self.bar.n)

    def eval_now(self, frames, updates, **extra):
        mean, _ = evaluate(self.net, self.cfg.env, self.cfg.eval_episodes,
                           seed=10**6 + 1000 * len(self.history))
        wall = self.wall()
        rec = self.line(frames=frames, updates=updates, eval_return=mean,
                        frames_per_s=frames / wall if wall else None,
                        updates_per_s=updates / wall if wall else None, **extra)
        rec["wall_s"] = round(wall, 3)
        self.history.append(rec)
        if self.best is None or mean >= self.best[0]:
            self.best = (mean, frames, param_arrays(self.net))
        self.emit(rec)
        return rec

    def emit(self, rec):
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()

    def final(self, frames, updates, **extra):
        """The 100-episode greedy evaluation of the final and of the best parameters."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        final_mean, _ = evaluate(self.net, self.cfg.env, self.cfg.final_episodes,
                                 seed=FINAL_SEED)
        rec = {"final": True, "frames": frames, "updates": updates,
               "wall_s": round(self.wall(), 3), "final_eval_100": final_mean, **extra}
        if self.best is not None:
            keep = param_arrays(self.net)
            load_arrays(self.net, self.best[2])
            rec["best_eval_100"], _ = evaluate(self.net, self.cfg.env,
                                               self.cfg.final_episodes, seed=FINAL_SEED)
            rec["best_at_frames"] = self.best[1]
            load_arrays(self.net, keep)
        rec["episodes"] = len(self.returns)
        rec["mean_return_100"] = float(np.mean(self.returns[-100:])) if self.returns else None
        self.emit(rec)
        return rec

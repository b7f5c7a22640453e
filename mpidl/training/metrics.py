"""Per-epoch metrics: one JSON object per line, on stdout and appended to a file."""

import json
import math
import os
import sys


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsWriter:
    """Writes each record as one JSON line to stdout and appends it to ``path``."""

    def __init__(self, path=None, stdout=True):
        self.path = path
        self.stdout = stdout
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record):
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        if self.stdout:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return line


def truncate_metrics(path, keep_epochs):
    """Drop the records of epochs after ``keep_epochs`` (a resumed run replays them)."""
    if not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            epoch = json.loads(line).get("epoch", 0)
        except ValueError:
            continue  # a line cut short by the crash
        if isinstance(epoch, int) and epoch <= keep_epochs:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)


def read_metrics(path):
    """The records of a metrics file, as a list of dicts."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class EpochStats:
    """Running sums for the epoch in progress; saved in checkpoints so a resumed epoch
    reports the same figures as an uninterrupted one."""

    def __init__(self, loss_sum=0.0, steps=0, images=0, seconds=0.0):
        self.loss_sum, self.steps, self.images, self.seconds = loss_sum, steps, images, seconds

    def add(self, loss, images, seconds):
        self.loss_sum += float(loss)
        self.steps += 1
        self.images += int(images)
        self.seconds += seconds

    def state_dict(self):
        return {"loss_sum": self.loss_sum, "steps": self.steps, "images": self.images,
                "seconds": self.seconds}

    @classmethod
    def from_state(cls, state):
        return cls(**state) if state else cls()

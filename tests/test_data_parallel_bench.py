"""bench/scaling.py runs end to end (tiny settings) and its timeline arithmetic is right."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpirun import mpi_env
from mpidl.benchmarks.scaling import random_dataset, timeline_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def X(name, ts, dur, tid=0, cat="compute"):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_timeline_summary_counts_overlap_with_backward(tmp_path):
    # two steps: backward 10..20 us; bucket all-reduces on the progress thread, one half
    # under backward, one after it; the caller waits 5 us per step
    events = []
    for base in (0, 100):
        events += [X("compute forward", base, 10), X("compute backward", base + 10, 10),
                   X("allreduce bucket0", base + 15, 10, tid=1, cat="allreduce"),
                   X("wait allreduce bucket0", base + 20, 5, cat="wait")]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = timeline_summary(path, pid=0)
    assert abs(s["timeline_comm_ms"] - 0.010) < 1e-12
    assert abs(s["overlap_backward"] - 0.5) < 1e-12
    assert abs(s["hidden"] - 0.5) < 1e-12


@pytest.mark.slow  # (a benchmark script's run, like tests/test_bench_scripts.py's)
def test_scaling_bench_runs_and_writes_json_png_and_timeline(tmp_path):
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--ranks", "1", "2",
           "--quick", "--no-torch", "--repeats", "1", "--steps", "4", "--warmup", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=mpi_env(), timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert {s["ranks"] for s in summary.values()} == {1, 2}
    two = summary["mpidl n=2 b=128 overlap"]
    assert two["images_per_sec"] > 0 and two["compute_ms"] > 0
    assert "timeline_comm_ms" in two and 0 <= two["overlap_backward"] <= 1
    assert summary["mpidl n=2 b=128 no-overlap"]["overlap_backward"] == 0
    assert (tmp_path / "scaling.png").exists()
    trace = json.loads((tmp_path / "timeline_overlap_rank0.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert "compute backward" in names and any(n.startswith("allreduce bucket") for n in names)


@pytest.mark.parametrize("warmup", [0, 2])
def test_step_timer_times_the_steps_after_warmup_and_keeps_their_split(warmup):
    """mpidl.benchmarks.scaling's measurement: the trainer runs warm-up + timed steps on
    random data in one epoch; the timer keeps one time per timed step and the runtime's
    split of those steps only (the trainer's end of epoch resets the runtime's)."""
    from mpidl.benchmarks.callbacks import StepTimer
    from mpidl.engine import SGD, Flatten, Linear, Sequential
    from mpidl.runtime import build
    from mpidl.training.trainer import Trainer

    rng = np.random.default_rng(0)
    model = Sequential(Flatten(), Linear(784, 10, rng=rng))
    steps = 3
    data = random_dataset(16, 1, warmup + steps)
    assert len(data.train_y) == (warmup + steps) * 16 and len(data.test_y) == 8
    timer = StepTimer(warmup, steps)
    runtime = build("local")
    trainer = Trainer(model, SGD(model.named_parameters(), lr=0.01), data, runtime=runtime,
                      callbacks=[timer], epochs=1, batch_size=16, progress=False)
    trainer.fit()
    assert trainer.step == warmup + steps  # one epoch is exactly the steps asked for
    assert len(timer.times) == steps and all(t > 0 for t in timer.times)
    assert timer.stats["steps"] == steps and timer.stats["forward"] > 0
    assert runtime.stats["steps"] == 0  # reset by the trainer's end of epoch
    assert timer.t_last - timer.t_first >= sum(timer.times) * 0.999

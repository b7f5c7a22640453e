"""The benchmark scripts under bench/ run end to end on tiny settings and write what they
promise (the figures themselves are measured by running them in full; see the README)."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from mpirun import fashion_available, mpi_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(script, *args, timeout=240):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script)]
                          + [str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=mpi_env(), timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def load_bench_module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                  os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 35 s; the PS itself is tested in test_parameter_server_mpi.py
@pytest.mark.skipif(not fashion_available(), reason="needs Fashion-MNIST "
                    "(apt-get install dataset-fashion-mnist)")
def test_ps_speed_bench_writes_curves_counts_and_plot(tmp_path):
    out = tmp_path / "ps.json"
    bench("ps.py", "speed", "--workers", "2", "--epochs", "1", "--limit-train", "3072",
          "--only", "ps-sync,async,allreduce", "--repeats", "1", "--no-anchor", "--every",
          "0.2", "--test-limit", "500", "--target", "0.5", "--work", tmp_path / "work",
          "--out", out, "--plot", tmp_path / "ps.png")
    report = json.loads(out.read_text())
    assert sorted(report["runs"]) == ["allreduce", "allreduce+straggler", "async",
                                      "async+straggler", "ps-sync", "ps-sync+straggler"]
    for name, run in report["runs"].items():
        assert run["curve"] and all(0 <= acc <= 1 for _, acc in run["curve"]), name
        assert run["images"] == 3072, name  # one epoch of the limited set, over 2 workers
        if name.startswith("allreduce"):
            continue
        assert run["ps_pushed"] == run["ps_applied"] + run["ps_dropped"], name
        assert run["ps_pushed"] == 2 * (3072 // (128 * 2)), name  # workers x steps
    straggler = report["runs"]["ps-sync+straggler"]["ranks"][-1]["worker"]
    assert straggler["straggle_s"] > 0.5 * straggler["compute_s"]  # it did sleep
    slow, fast = report["runs"]["allreduce+straggler"]["ranks"]
    assert slow["straggle_s"] == 0 and fast["straggle_s"] > 0.5 * fast["compute_s"]
    assert "sync/async+straggler" in report["speedup_vs_sync"]
    assert report["goal"]["goal"] == 1.4
    assert (tmp_path / "ps.png").stat().st_size > 0


@pytest.mark.slow  # (tests/test_dealing.py covers dealing itself in CI)
@pytest.mark.skipif(not fashion_available(), reason="needs Fashion-MNIST "
                    "(apt-get install dataset-fashion-mnist)")
def test_stragglers_bench_deals_fewer_portions_to_the_straggler(tmp_path):
    out = tmp_path / "stragglers.json"
    bench("stragglers.py", "--only", "ps-sync+4x,ps-dealt+4x", "--epochs", "1",
          "--limit-train", "3072", "--test-limit", "500", "--target", "0.5", "--pace",
          "2e-4", "--every", "0.2", "--work", tmp_path / "work", "--out", out, "--plot",
          tmp_path / "stragglers.png")
    report = json.loads(out.read_text())
    assert sorted(report["runs"]) == ["ps-dealt+4x", "ps-sync+4x"]
    dealt, sync = report["runs"]["ps-dealt+4x"], report["runs"]["ps-sync+4x"]
    steps = 3072 // (128 * 3)
    assert sync["ps_applied"] == 3 * steps and dealt["ps_applied"] == 12 * steps
    by_worker = {int(w): n for w, n in dealt["ps_pushed_by_worker"].items()}
    assert by_worker[3] < min(by_worker[1], by_worker[2]), by_worker  # 4x slower: fewer
    assert "ps-sync+4x / ps-dealt+4x, all epochs" in report["ratios"]
    assert (tmp_path / "stragglers.png").stat().st_size > 0
    for key, r in report["runs"].items():  # every step (portion) checked against the pace
        assert r["pace"]["paced"] == r["ps_pushed"], key
        assert r["pace"]["kept"] == (r["pace"]["over_pace"] == 0), key
    overran = [k for k, r in report["runs"].items() if not r["pace"]["kept"]]
    assert len(report["notes"]) == len(overran), report["notes"]


def test_a_schedule_counts_the_computations_that_overran_their_pace():
    """bench/stragglers.py marks a run whose real compute did not keep the emulated pace:
    the schedule counts a compute longer than pace x samples x its straggler factor."""
    from mpidl.runtime.schedule import MicroBatches  # noqa: PLC0415

    sched = MicroBatches(pace=1e-2)
    assert sched.slow_down(0.01, 10, 1.0) > 0.08  # 0.1 s paced: kept, slept the rest
    assert sched.slow_down(0.015, 1, 2.0) > 0.004  # over the pace, within a 2x straggler's
    assert sched.slow_down(0.05, 1, 2.0) == 0.0  # over even a 2x straggler's 0.02 s
    assert (sched.paced, sched.over_pace) == (3, 1)
    assert sched.worst_pace_ratio == pytest.approx(5.0)  # 0.05 s against 0.01 s
    unpaced = MicroBatches(straggler=2.0)
    unpaced.slow_down(0.001, 10, 2.0)
    assert (unpaced.paced, unpaced.over_pace) == (0, 0)


def test_stragglers_bounds_and_pace_notes():
    stragglers = load_bench_module("stragglers")
    b = stragglers.bounds(3)  # the README's ceiling at 3 workers: 2 / (3 / 2.5)
    assert b["dealt vs sync, 2x straggler"] == pytest.approx(2 / (3 / 2.5))
    w = 7
    b = stragglers.bounds(w)
    assert b["dealt vs sync, 2x straggler"] == pytest.approx(2 / (w / (w - 0.5)))
    assert b["dealt vs sync, 4x straggler"] == pytest.approx(4 / (w / (w - 0.75)))
    draws = np.random.default_rng(0).random((200_000, w)) < 0.1  # 4x slower, p = 0.1
    sync_step = np.where(draws.any(axis=1), 4.0, 1.0).mean()  # the slowest of W
    assert b["sync's mean step, transient (units of one step)"] == pytest.approx(
        sync_step, rel=0.01)
    assert b["ssp vs sync, transient, unbounded slack"] == pytest.approx(
        sync_step / np.where(draws, 4.0, 1.0).mean(), rel=0.01)
    kept = {"pace": {"kept": True, "over_pace": 0, "paced": 10, "worst_ratio": 0.5}}
    assert stragglers.pace_note("a", kept) is None and stragglers.pace_note("a", {}) is None
    over = {"pace": {"kept": False, "over_pace": 3, "paced": 10, "worst_ratio": 1.4}}
    assert "3 of 10" in stragglers.pace_note("b", over)
    a = SimpleNamespace(ssp_lr=None, workers=3)
    assert stragglers.ssp_lr(a) == 0.15  # the 3-worker setting, unchanged
    a.workers = 7
    assert stragglers.ssp_lr(a) == pytest.approx(0.15 * 3 / 7, abs=1e-4)


def test_compute_pace_makes_a_step_take_its_pace_times_the_factor():
    import time  # noqa: PLC0415

    from mpidl.runtime.schedule import slow_down  # noqa: PLC0415

    t = time.perf_counter()
    slept = slow_down(0.0, 100, 2.0, pace=1e-4)  # 100 samples x 0.1 ms x 2 = 20 ms
    assert 0.019 <= slept <= time.perf_counter() - t
    assert slow_down(0.05, 100, 1.0, pace=1e-4) == 0.0  # computed longer than the pace
    assert slow_down(0.01, 1, 1.0) == 0.0  # no straggler, no pace: nothing


def test_batches_as_one_epoch_hands_the_trainers_loader_the_chosen_batches():
    """bench/ps.py and bench/staleness.py run several epochs (or part of one) as one
    trainer epoch: every shard must get exactly the batches its own loader would give."""
    from mpidl.benchmarks.callbacks import batches_as_one_epoch
    from mpidl.data import BatchLoader

    x = np.arange(50, dtype=np.float32).reshape(25, 2)
    y = np.arange(25)
    count, batch, seed = 2, 3, 7
    old = [BatchLoader(x, y, batch, shard=(i, count), seed=seed, device=False)
           for i in range(count)]
    steps = len(old[0])  # 5 steps, the last one wraps around
    want = [old[0].global_indices(e, s) for e in range(2) for s in range(steps)][:-1]
    vx, vy = batches_as_one_epoch(x, y, want, seed)
    assert len(vx) == len(vy) == len(want) * batch * count
    for i in range(count):
        new = BatchLoader(vx, vy, batch, shard=(i, count), seed=seed, device=False)
        got = [(bx, by) for _, bx, by in new.epoch(0)]
        ref = [(bx, by) for e in range(2) for _, bx, by in old[i].epoch(e)][:-1]
        assert len(got) == len(ref) == 9
        for (gx, gy), (rx, ry) in zip(got, ref):
            np.testing.assert_array_equal(gx, rx)
            np.testing.assert_array_equal(gy, ry)


def test_delayed_gradients_train_as_the_hand_written_loop_did():
    """bench/staleness.py's runtime (Trainer + DelayedGradients) takes the very steps of
    the loop it replaced: the gradient at the parameters tau updates old, applied to the
    newest, with momentum."""
    from types import SimpleNamespace

    from mpidl.benchmarks.callbacks import batches_as_one_epoch
    from mpidl.data import BatchLoader
    from mpidl.engine import SGD, Flatten, Linear, ReLU, Sequential, SoftmaxCrossEntropy
    from mpidl.training.trainer import Trainer

    staleness = load_bench_module("staleness")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    batch, seed, steps, lr = 8, 3, 9, 0.1

    def model():
        r = np.random.default_rng(1)
        return Sequential(Flatten(), Linear(6, 5, rng=r), ReLU(), Linear(5, 3, rng=r))

    for tau in (0, 2):
        # the loop bench/staleness.py had
        ref = model()
        named = ref.named_parameters()
        opt = SGD(named, lr=lr, momentum=0.9)
        loss = SoftmaxCrossEntropy()
        versions = [{n: p.data.copy() for n, p in named}]
        loader = BatchLoader(x, y, batch, seed=seed)
        done = 0
        for epoch in range(3):
            for _, bx, by in loader.epoch(epoch):
                if done == steps:
                    break
                newest = versions[-1]
                for n, p in named:
                    p.data[...] = versions[0][n]
                ref.zero_grad()
                loss.forward(ref.forward(bx), by)
                ref.backward(loss.backward())
                for n, p in named:
                    p.data[...] = newest[n]
                opt.step()
                versions = (versions + [{n: p.data.copy() for n, p in named}])[-(tau + 1):]
                done += 1
        # the trainer with the delayed-gradient runtime, on the same batches
        new = model()
        per_epoch = len(loader)
        batches = [loader.global_indices(i // per_epoch, i % per_epoch) for i in range(steps)]
        vx, vy = batches_as_one_epoch(x, y, batches, seed)
        data = SimpleNamespace(train_x=vx, train_y=vy, test_x=x[:0], test_y=y[:0])
        Trainer(new, SGD(new.named_parameters(), lr=lr, momentum=0.9), data,
                runtime=staleness.delayed_runtime(tau), epochs=1, batch_size=batch, lr=lr,
                seed=seed, progress=False).fit()
        for (n, p), (_, q) in zip(named, new.named_parameters()):
            np.testing.assert_array_equal(p.data, q.data, err_msg=f"tau {tau}: {n}")


def test_recalibrated_batchnorm_statistics_are_those_of_the_calibration_images():
    from mpidl.engine.models import build_model
    from mpidl.engine.normalization import recalibrate_batchnorm

    model = build_model("cnn", seed=0)
    x = np.random.default_rng(0).standard_normal((1000, 1, 28, 28)).astype(np.float32) + 3
    recalibrate_batchnorm(model, x, batch=250)
    bn = model.layers[1] if hasattr(model, "layers") else None
    assert bn is not None and "running_mean" in bn._buffers
    model.eval()
    conv_out = model.layers[0].forward(x)  # what the first BatchNorm normalizes
    want = conv_out.mean(axis=(0, 2, 3))
    np.testing.assert_allclose(bn._buffers["running_mean"], want, rtol=1e-4, atol=1e-4)
    assert bn.momentum == 0.1  # the layer's own momentum is back
    assert not model.training


@pytest.mark.slow  # 33 s; the kernels themselves are tested in test_kernels.py
def test_kernels_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "kernels.json"
    bench("kernels.py", "--n", 4096, "--rounds", 1, "--no-plot", "--out", out)
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"]


def test_kernels_bench_gpu_without_a_gpu_says_so_in_one_line(tmp_path):
    from mpidl.backend import gpu_count

    if gpu_count():
        pytest.skip("a GPU is here: --device gpu runs (test_kernels_bench_gpu_runs)")
    out = tmp_path / "kernels_gpu.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernels.py"),
                           "--device", "gpu", "--n", "4096", "--out", str(out)],
                          capture_output=True, text=True, env=mpi_env(), timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs CuPy and a CUDA device" in lines[0], proc.stderr
    assert not out.exists()


@pytest.mark.gpu
def test_kernels_bench_gpu_runs(tmp_path):
    from mpidl.backend import gpu_count

    if not gpu_count():
        pytest.skip("CuPy with a CUDA device is not available")
    out = tmp_path / "kernels_gpu.json"
    bench("kernels.py", "--device", "gpu", "--n", 1 << 20, "--rounds", 2, "--warmup", 1,
          "--out", out)
    report = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in report["rows"]}
    assert rows["device-to-device copy (cupy.copyto)"]["share_of_copy_roofline"] == 1.0
    assert {"top-k sampled, DGC (0.1 %)", "cupy.argpartition top-k (0.1 %)", "to fp16",
            "1-bit pack + error feedback", "scatter_add (0.1 % entries)"} <= set(rows)
    assert all(r["median_s"] > 0 and r["bytes"] > 0 for r in rows.values())
    assert report["goals"]["topk_sampled_speedup_vs_argpartition"] > 0
    from mpidl.benchmarks.plotting import pyplot

    if pyplot() is not None:
        assert (tmp_path / "kernels_gpu.png").stat().st_size > 0


def test_engine_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "engine.json"
    bench("engine.py", "--steps", 2, "--rounds", 1, "--warmup", 1, "--no-torch",
          "--out", out)
    report = json.loads(out.read_text())
    assert report["machine"]["cpu"]


@pytest.mark.slow  # 9 s; delayed gradients are tested in test_parameter_server*.py
@pytest.mark.skipif(not fashion_available(), reason="needs Fashion-MNIST "
                    "(apt-get install dataset-fashion-mnist)")
def test_staleness_bench_trains_with_delayed_gradients(tmp_path):
    out = tmp_path / "staleness.json"
    bench("staleness.py", "--images", 1536, "--eval-every", 512, "--taus", "0,3",
          "--lr", 0.05, "--momentum", 0.9, "--warmup", 0, "--test-limit", 500, "--target", 0.3,
          "--out", out, "--plot", tmp_path / "staleness.png")
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert sorted(runs) == ["0", "3"]
    fresh, stale = runs["0"]["curve"], runs["3"]["curve"]
    assert [n for n, _ in fresh] == [0, 512, 1024, 1536] == [n for n, _ in stale]
    assert fresh[0] == stale[0]  # the same initial parameters
    assert fresh[1:] != stale[1:]  # then the stale gradients change the path
    assert runs["0"]["images_to_target"] and runs["0"]["vs_tau0"] == 1.0
    assert (tmp_path / "staleness.png").stat().st_size > 0


def test_images_to_target_is_the_first_crossing():
    staleness = load_bench_module("staleness")
    curve = [(0, 0.1), (100, 0.6), (200, 0.5), (300, 0.7)]
    assert staleness.images_to(curve, 0.55) == 100
    assert staleness.images_to(curve, 0.65) == 300
    assert staleness.images_to(curve, 0.9) is None


@pytest.mark.slow  # 20 s; the identities and byte counts are test_local_sgd.py's
def test_local_sgd_bench_quick_writes_exact_byte_fractions_and_plot(tmp_path):
    """bench/local_sgd.py --quick (synthetic data, 2 ranks, 32 steps): local SGD and DiLoCo
    send exactly 1/H of all-reduce's bytes (the communicator's counters), H = 1 trains
    like all-reduce, and the JSON and PNG are written."""
    out, png = tmp_path / "local_sgd.json", tmp_path / "local_sgd.png"
    bench("local_sgd.py", "--quick", "--work", tmp_path / "work", "--out", out, "--plot", png)
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert sorted(runs) == ["allreduce", "diloco H=1", "diloco H=4", "local-sgd H=1",
                            "local-sgd H=4"]
    ref = runs["allreduce"]
    assert ref["steps"] == 32 and report["allreduce_bytes_per_step"] > 0
    for name, r in runs.items():
        if name == "allreduce":
            continue
        assert r["exact"] and r["fraction_is_1_over_H"], (name, r)
        assert r["bytes_rank0"] * r["period"] == ref["bytes_rank0"], name
        assert r["averagings"] == 32 // r["period"], name
    # local SGD with H = 1 is all-reduce (within rounding): the same accuracy here
    assert abs(runs["local-sgd H=1"]["test_acc"] - ref["test_acc"]) <= 1 / 64
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0


def test_gpt_bench_quick_writes_losses_baseline_and_sample(tmp_path):
    """bench/gpt.py --quick on a small text, one rank: calibration, the run, the bigram on
    the same validation characters, a sample from mpidl sample, the JSON."""
    text = tmp_path / "t.txt"
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far"]
    rng = np.random.default_rng(0)
    text.write_text(" ".join(words[i] for i in rng.integers(0, 9, 1500)) + "\n")
    out = tmp_path / "gpt.json"
    bench("gpt.py", "--quick", "--ranks", "1", "--minutes", "0.1", "--data-dir", text,
          "--prompt", "the ", "--tokens", "20", "--work", tmp_path / "work", "--out", out)
    r = json.loads(out.read_text())
    assert r["steps"] >= 1 and r["ranks"] == 1
    assert r["bigram_nats_per_char"] > 0 and r["valid_nats_per_char"] > 0
    assert r["improvement_over_bigram"] == pytest.approx(
        1 - r["valid_nats_per_char"] / r["bigram_nats_per_char"])
    assert r["sample"].startswith("the ") and len(r["sample"].rstrip("\n")) == 24
    assert r["command"].startswith("mpidl train --model gpt-tiny --dataset text")


@pytest.mark.slow  # (tests/test_parallax.py covers Parallax itself in CI)
def test_parallax_bench_quick_writes_losses_and_traffic(tmp_path):
    """bench/parallax.py --quick: all-reduce and Parallax (sync, async) at equal samples,
    then the bytes per trainer and step at 2 trainers, the JSON."""
    text = tmp_path / "t.txt"
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far"]
    rng = np.random.default_rng(0)
    text.write_text(" ".join(words[i] for i in rng.integers(0, 9, 1500)) + "\n")
    out = tmp_path / "parallax.json"
    bench("parallax.py", "--quick", "--data-dir", text, "--epochs", "2", "--limit-train", "32",
          "--traffic-trainers", "2", "--traffic-steps", "2", "--work", tmp_path / "work",
          "--out", out)
    r = json.loads(out.read_text())
    runs = r["runs"]
    assert sorted(runs) == ["allreduce", "parallax-async", "parallax-sync"]
    assert runs["parallax-sync"]["same_bits_as_allreduce"]  # sync is all-reduce, bitwise
    assert runs["parallax-sync"]["gap_to_allreduce_percent"] == 0.0
    assert runs["parallax-sync"]["steps"] == runs["allreduce"]["steps"] > 0
    (row,) = r["traffic"]
    assert row["trainers"] == 2 and row["pushed_rows"] > 0 and row["allgather_rows"] > 0
    assert row["pulled_table"] > 0 and row["dense_allreduce"] > 0


def test_startup_memory_bench_quick_measures_each_layout_eager_and_lazy(tmp_path):
    """bench/startup_memory.py --quick (a small MLP, 2 ranks): every layout built eagerly
    and lazily, each rank's peak and what it keeps, the JSON and the plot."""
    out = tmp_path / "startup.json"
    bench("startup_memory.py", "--quick", "--out", out)
    r = json.loads(out.read_text())
    runs = {(run["layout"], run["lazy"]): run for run in r["runs"]}
    assert sorted({layout for layout, _ in runs}) == ["pipeline", "tensor parallel", "zero 3"]
    for (layout, lazy), run in runs.items():
        assert run["ranks"] == 2 and len(run["per_rank"]) == 2
        kept = [p["mem_params"] for p in run["per_rank"]]
        assert all(0 < k for k in kept) and run["whole_bytes"] > 0
        if lazy and layout != "pipeline":  # (its stages keep different layers)
            assert sum(kept) == pytest.approx(run["whole_bytes"], rel=0.02), (layout, kept)
    assert (tmp_path / "startup.png").exists()

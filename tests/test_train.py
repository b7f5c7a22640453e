"""`mpidl train` end to end: learning, metrics lines, the saved model, mpiexec -n 1,
failure injection, and checkpoint/resume that ends bitwise equal to an uninterrupted run.

The full accuracy targets (mlp >= 88.5 %, cnn >= 91.5 % in 10 epochs on all of
Fashion-MNIST) are the `slow` tests at the end: `pytest -m slow tests/test_train.py`.
"""

import json
import os
import re
import sys

import numpy as np
import pytest

from mpirun import assert_bitwise_equal, model_arrays, mpiexec_cmd, run_command

MPIDL = [sys.executable, "-m", "mpidl.cli.main", "train", "--no-progress"]
FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION),
                                   reason="apt-get install dataset-fashion-mnist")


def train(args, n=None, timeout=180, env=None):
    cmd = ([*mpiexec_cmd(), "-n", str(n)] if n else []) + MPIDL + [str(a) for a in args]
    return run_command(cmd, timeout=timeout, env=env)


def json_lines(text):
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out






def test_fused_optimizer_auto_picks_numpy_for_a_short_run_with_bitwise_the_same_model(tmp_path):
    """--fused-optimizer auto skips loading Numba on CPU for a run too short to repay it,
    and says so in the start line; on/off/auto end with bitwise the same model."""
    run = ["--model", "mlp", "--dataset", "synthetic", "--limit-train", "256",
           "--limit-test", "64", "--batch-size", "32", "--epochs", "2", "--dtype", "float64"]
    starts = {}
    for choice in ("auto", "on", "off"):
        launch = train([*run, "--fused-optimizer", choice, "--out-dir", tmp_path / choice])
        starts[choice] = launch.check().output.splitlines()[0]
    assert "NumPy updates" in starts["auto"] and "NumPy updates" in starts["off"], starts
    assert "NumPy updates" not in starts["on"], starts
    for choice in ("on", "off"):
        assert_bitwise_equal(model_arrays(tmp_path / "auto" / "model.npz"),
                             model_arrays(tmp_path / choice / "model.npz"))


@pytest.mark.parametrize("choice, parameters, steps, device, want", [
    ("auto", 2_000_000, 100, "cpu", False),        # a short run: NumPy
    ("auto", 2_000_000, 2000, "cpu", None),        # a long one: the fused kernels
    ("auto", 2_000_000, None, "cpu", None),        # steps unknown: as the library's default
    ("auto", 2_000_000, 100, "gpu", None),         # CuPy's kernels cost nothing to load
    ("on", 10, 1, "cpu", None),
    ("off", 10**9, 10**6, "cpu", False),
])
def test_fused_optimizer_choice(monkeypatch, choice, parameters, steps, device, want):
    from types import SimpleNamespace

    from mpidl import backend
    from mpidl.cli.train import fused_updates

    monkeypatch.setattr(backend, "device", lambda: device)
    cfg = SimpleNamespace(fused_optimizer=choice)
    assert fused_updates(cfg, parameters, steps) is want


@needs_fashion
def test_mlp_learns_fashion_mnist_subset(tmp_path):
    out = tmp_path / "run"
    launch = train(["--model", "mlp", "--epochs", "2", "--limit-train", "8000",
                    "--limit-test", "2000", "--seed", "1", "--out-dir", out]).check()
    lines = json_lines(launch.output)
    assert [r["epoch"] for r in lines] == [1, 2]
    for key in ("epoch", "step", "lr", "train_loss", "test_loss", "test_acc",
                "images_per_sec", "elapsed", "ranks"):
        assert key in lines[-1], key
    assert lines[-1]["step"] == 2 * 63 and lines[-1]["ranks"] == 1
    assert 0.0 <= lines[-1]["test_acc"] <= 1.0 and lines[-1]["test_acc"] >= 0.8, lines
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]
    # the same lines are appended to the metrics file
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line) for line in f] == lines
    # the final model, with its metadata
    with np.load(out / "model.npz") as z:
        assert z["1.weight"].shape == (784, 1024) and z["5.bias"].shape == (10,)
        meta = json.loads(bytes(z["__meta__"]).decode())
    assert meta["model"] == "mlp" and meta["input_shape"] == [1, 28, 28]
    assert "[rank 0] saved the model" in launch.output


def test_metrics_and_save_paths(tmp_path):
    m, s = tmp_path / "a" / "m.jsonl", tmp_path / "b" / "w.npz"
    train(["--dataset", "synthetic", "--limit-train", "512", "--limit-test", "128",
           "--epochs", "1", "--metrics", m, "--save", s, "--out-dir", tmp_path / "o"]).check()
    assert len(open(m).read().splitlines()) == 1 and s.exists()
    train(["--dataset", "synthetic", "--limit-train", "512", "--limit-test", "128",
           "--epochs", "1", "--metrics", m, "--save", s, "--out-dir", tmp_path / "o"]).check()
    assert len(open(m).read().splitlines()) == 2  # appended


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "synthetic"\nlimit_train = 512\nlimit-test = 64\nepochs = 3\n'
                   "batch_size = 64\n")
    launch = train(["--config", cfg, "--epochs", "1", "--out-dir", tmp_path / "o"]).check()
    lines = json_lines(launch.output)
    assert len(lines) == 1 and lines[0]["step"] == 8 and lines[0]["global_batch"] == 64


def test_mpiexec_n1(tmp_path):
    """`mpiexec -n 1 mpidl train ...` with the installed console script."""
    script = os.path.join(os.path.dirname(sys.executable), "mpidl")
    if not os.path.exists(script):
        pytest.skip("the mpidl console script is not installed (pip install -e .)")
    launch = run_command([*mpiexec_cmd(), "-n", "1", script, "train", "--no-progress",
                          "--dataset", "synthetic", "--limit-train", "1024", "--limit-test",
                          "256", "--epochs", "2", "--out-dir", tmp_path / "o"],
                         timeout=180).check()
    lines = json_lines(launch.output)
    assert [r["epoch"] for r in lines] == [1, 2] and lines[-1]["test_acc"] > 0.3
    assert (tmp_path / "o" / "model.npz").exists()


def test_failure_injection_single_rank(tmp_path):
    launch = train(["--dataset", "synthetic", "--limit-train", "1024", "--limit-test", "64",
                    "--epochs", "1", "--out-dir", tmp_path / "o"],
                   env={"MPIDL_FAIL_AT": "0:3"})
    assert launch.returncode == 1 and not launch.timed_out, launch.output
    assert "[rank 0] Traceback (most recent call last):" in launch.output
    assert re.search(r"\[rank 0\] .*InjectedFailure: MPIDL_FAIL_AT: injected failure on "
                     r"rank 0 at step 3", launch.output), launch.output
    assert not (tmp_path / "o" / "model.npz").exists()


def test_failure_injection_under_mpiexec_n1(tmp_path):
    launch = train(["--dataset", "synthetic", "--limit-train", "1024", "--limit-test", "64",
                    "--epochs", "1", "--out-dir", tmp_path / "o"], n=1, timeout=60,
                   env={"MPIDL_FAIL_AT": "0:2"})
    assert launch.returncode != 0 and not launch.timed_out, launch.output
    assert "[rank 0] Traceback" in launch.output and "step 2" in launch.output


# -- checkpoint / resume

# cnn on 8x8 digits: BatchNorm buffers, Dropout's mask counter, momentum, a cosine schedule
# and a mid-epoch position all have to come back exactly. 512 samples, batch 32 per rank.
RESUME_ARGS = ["--model", "cnn", "--dropout", "0.25", "--dataset", "digits",
               "--limit-train", "512", "--limit-test", "128", "--epochs", "2",
               "--batch-size", "32", "--seed", "7", "--checkpoint-every", "3"]


def ranks_param():
    return [1, 2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{ranks: (model arrays, last metrics line)} of runs that were never stopped."""
    cache = {}

    def get(n):
        if n not in cache:
            pytest.importorskip("sklearn")
            d = tmp_path_factory.mktemp(f"full{n}")
            launch = train(RESUME_ARGS + ["--out-dir", d], n=n if n > 1 else None).check()
            cache[n] = (model_arrays(d / "model.npz"), json_lines(launch.output)[-1])
        return cache[n]

    return get


def steps_per_epoch(n):
    return 512 // (32 * n)


@pytest.mark.parametrize("ranks", ranks_param())
def test_resume_after_failure_is_bitwise_equal(tmp_path, uninterrupted, ranks):
    full_model, full_last = uninterrupted(ranks)
    run = tmp_path / "run"
    fail_step = steps_per_epoch(ranks) + 4  # mid-way through the second epoch,
    fail_step += fail_step % 3 == 0          # not at a checkpoint: steps are replayed
    failing_rank = ranks - 1
    failed = train(RESUME_ARGS + ["--out-dir", run], n=ranks if ranks > 1 else None,
                   env={"MPIDL_FAIL_AT": f"{failing_rank}:{fail_step}"}, timeout=120)
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    saved = sorted(int(re.search(r"(\d+)", p).group(1))
                   for p in os.listdir(run / "checkpoints") if p.startswith("ckpt-"))
    assert saved[-1] == fail_step // 3 * 3 and saved[-1] < fail_step, saved
    resumed = train(RESUME_ARGS + ["--out-dir", run, "--resume"],
                    n=ranks if ranks > 1 else None).check()
    assert f"step {saved[-1]}" in resumed.output, resumed.output
    assert_bitwise_equal(model_arrays(run / "model.npz"), full_model)
    last = json_lines(resumed.output)[-1]
    for key in ("epoch", "step", "train_loss", "test_loss", "test_acc"):
        assert last[key] == full_last[key], (key, last, full_last)
    # the metrics file has each epoch once... plus nothing from the failed epoch
    with open(run / "metrics.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [1, 2]


@pytest.mark.parametrize("ranks", ranks_param())
def test_crash_while_writing_checkpoint_then_resume(tmp_path, uninterrupted, ranks):
    """The process dies half-way through writing its 3rd checkpoint (test hook): the 2nd is
    still loadable, the half-written file is ignored, and the resumed run is bitwise equal."""
    full_model, _ = uninterrupted(ranks)
    run = tmp_path / "run"
    crashed = train(RESUME_ARGS + ["--out-dir", run], n=ranks if ranks > 1 else None,
                    env={"MPIDL_CRASH_IN_CHECKPOINT": "3:3000"}, timeout=120)
    assert crashed.returncode != 0 and not crashed.timed_out, crashed.output
    names = sorted(os.listdir(run / "checkpoints"))
    assert [n for n in names if n.startswith("ckpt-")] == ["ckpt-000000003.npz",
                                                           "ckpt-000000006.npz"], names
    assert any(n.startswith(".tmp-ckpt-") for n in names), names
    resumed = train(RESUME_ARGS + ["--out-dir", run, "--resume"],
                    n=ranks if ranks > 1 else None).check()
    assert "step 6" in resumed.output
    assert not any(n.startswith(".tmp-ckpt-") for n in os.listdir(run / "checkpoints"))
    assert_bitwise_equal(model_arrays(run / "model.npz"), full_model)


def test_resume_refuses_other_settings(tmp_path):
    pytest.importorskip("sklearn")
    run = tmp_path / "run"
    train(RESUME_ARGS + ["--out-dir", run, "--epochs", "1"]).check()
    launch = train(RESUME_ARGS + ["--out-dir", run, "--resume", "--batch-size", "16"])
    assert launch.returncode == 2, launch.output
    assert "cannot resume" in launch.output and "batch_size: checkpoint 32, now 16" in \
        launch.output


def test_resume_of_a_finished_run_extends_it(tmp_path):
    """--resume after the end picks up the final checkpoint; more epochs continue it."""
    args = ["--dataset", "synthetic", "--limit-train", "512", "--limit-test", "64",
            "--schedule", "constant", "--checkpoint-every", "0", "--out-dir", tmp_path]
    train(args + ["--epochs", "1", "--checkpoint-dir", tmp_path / "ck"]).check()
    again = train(args + ["--epochs", "2", "--resume", "--checkpoint-dir",
                          tmp_path / "ck"]).check()
    assert [r["epoch"] for r in json_lines(again.output)] == [2]


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    launch = train(["--dataset", "synthetic", "--limit-train", "256", "--limit-test", "64",
                    "--epochs", "1", "--out-dir", tmp_path, "--resume"]).check()
    assert "no checkpoint" in launch.output and len(json_lines(launch.output)) == 1


# -- the full accuracy targets (minutes; run with -m slow)

@pytest.mark.slow
@needs_fashion
@pytest.mark.parametrize("model, target, timeout", [("mlp", 0.885, 3600),
                                                    ("cnn", 0.915, 4 * 3600)])
def test_full_fashion_mnist_accuracy(tmp_path, model, target, timeout):
    launch = train(["--model", model, "--epochs", "10", "--seed", "1",
                    "--out-dir", tmp_path], timeout=timeout).check()
    best = json_lines(launch.output)[-1]["test_acc"]
    assert best >= target, launch.output


def test_two_ranks_log_with_their_rank(tmp_path):
    args = ["--dataset", "synthetic", "--limit-train", "512", "--limit-test", "64",
            "--epochs", "1", "--out-dir", tmp_path]
    quiet = train(args, n=2).check()
    assert len(json_lines(quiet.output)) == 1  # metrics: rank 0 only
    assert "[rank 0]" in quiet.output and "[rank 1]" not in quiet.output
    loud = train(args + ["--verbose"], n=2).check()
    assert "[rank 1]" in loud.output
    for line in loud.output.splitlines():
        if line.strip() and not line.startswith("{"):
            assert re.match(r"\[rank [01]\] ", line), line


def test_scale_lr_with_warmup(tmp_path):
    launch = train(["--dataset", "synthetic", "--limit-train", "512", "--limit-test", "64",
                    "--epochs", "2", "--batch-size", "32", "--lr", "0.01", "--scale-lr",
                    "--schedule", "constant", "--out-dir", tmp_path], n=2).check()
    assert "lr 0.02 (constant, warm-up 8 steps)" in launch.output, launch.output
    assert [r["lr"] for r in json_lines(launch.output)] == [0.02, 0.02]


def test_resume_does_not_repeat_metrics_lines(tmp_path):
    """Killed just after epoch 1's line, with the last checkpoint before epoch 1's end: the
    resumed run replays the end of epoch 1 and its line is in the file once."""
    args = ["--dataset", "synthetic", "--limit-train", "512", "--limit-test", "64",
            "--epochs", "2", "--batch-size", "32", "--checkpoint-every", "5",
            "--out-dir", tmp_path]
    failed = train(args, env={"MPIDL_FAIL_AT": "0:17"})
    assert failed.returncode == 1
    assert [r["epoch"] for r in json_lines(failed.output)] == [1]
    resumed = train(args + ["--resume"]).check()
    assert "step 15" in resumed.output
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [r["epoch"] for r in lines] == [1, 2]
    assert lines[0] == json_lines(resumed.output)[0] | {"elapsed": lines[0]["elapsed"],
                                                       "epoch_time": lines[0]["epoch_time"],
                                                       "epoch_wall": lines[0]["epoch_wall"],
                                                       "images_per_sec": lines[0]["images_per_sec"]}


def test_one_process_says_which_parallel_options_have_no_effect(tmp_path):
    """One command line runs on 1 and on N ranks: on one process the parallelism flags are
    accepted, and the log says they do nothing here."""
    args = ["--dataset", "synthetic", "--limit-train", "256", "--limit-test", "64",
            "--epochs", "1", "--no-progress", "--out-dir", tmp_path]
    launch = train(args + ["--mode", "async", "--epoch-quorum", "2"]).check()
    assert ("one process: --epoch-quorum, --mode apply to several ranks and have no effect "
            "here") in launch.output, launch.output
    assert "no effect" not in train(args).check().output

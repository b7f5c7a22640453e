"""Checkpoints that never shadow or poison a run (issue "Nothing lost, nothing silent",
its cases 1-3), through ``mpidl train`` on one process: each test fails on the code
before it (a new run pruned its own checkpoints and resumed an old run's; an unreadable
newest file crashed --resume; a diverged run checkpointed NaN and pruned the good ones).
"""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpirun import run_command

FAST = ["--no-progress", "--dataset", "synthetic", "--limit-train", "256", "--limit-test",
        "64", "--batch-size", "32", "--seed", "3"]


def train(args, timeout=120, env=None):
    return run_command([sys.executable, "-m", "mpidl.cli.main", "train"] + FAST +
                       [str(a) for a in args], timeout=timeout, env=env)


def steps(folder):
    return sorted(int(n[5:14]) for n in os.listdir(folder) if n.startswith("ckpt-"))


def one_line(launch):
    lines = [ln for ln in launch.output.splitlines() if ln.strip()]
    assert launch.returncode == 2 and len(lines) == 1, launch.output
    assert lines[0].startswith("mpidl: error: ") and "Traceback" not in launch.output
    return lines[0]


@contextlib.contextmanager
def small_tmpfs(folder, size):
    """A tmpfs of ``size`` mounted on ``folder`` for the block, unmounted after (root only;
    the test skips where it cannot mount one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_new_run_refuses_a_folder_with_an_earlier_runs_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    train(["--epochs", "1", "--checkpoint-every", "2", "--checkpoint-dir", ck,
           "--out-dir", tmp_path / "a"]).check()
    before = steps(ck)
    line = one_line(train(["--epochs", "1", "--lr", "0.3", "--checkpoint-every", "2",
                           "--checkpoint-dir", ck, "--out-dir", tmp_path / "b"]))
    assert "already holds" in line and "--resume" in line, line
    assert steps(ck) == before  # nothing of the earlier run was pruned
    resumed = train(["--epochs", "2", "--checkpoint-every", "2", "--checkpoint-dir", ck,
                     "--resume", "--out-dir", tmp_path / "a2"]).check()
    assert f"resumed from {ck}" in resumed.output


def _bogus_checkpoints(ck):
    """Higher-numbered files that are not usable training checkpoints of this model."""
    from mpidl.training import checkpoint

    np.save(ck / "ckpt-000000999.npy", np.zeros(3))
    os.replace(ck / "ckpt-000000999.npy", ck / "ckpt-000000999.npz")   # a .npy inside
    checkpoint.save(str(ck), 998, {"just": np.zeros(2)})                # no training state
    newest = checkpoint.load(checkpoint.list_checkpoints(str(ck))[-3][1])
    newest["model"] = {k: np.zeros(3) for k in newest["model"]}         # other shapes
    checkpoint.save(str(ck), 997, newest)


def test_resume_skips_unusable_newest_files_and_pruning_keeps_its_own(tmp_path):
    ck = tmp_path / "ck"
    common = ["--checkpoint-every", "2", "--keep-checkpoints", "2", "--checkpoint-dir", ck]
    # a 2-epoch run that fails before step 9: its checkpoints are steps 6 and 8
    failed = train(["--epochs", "2", "--out-dir", tmp_path / "a"] + common,
                   env={"MPIDL_FAIL_AT": "0:8"})
    assert failed.returncode != 0 and steps(ck) == [6, 8], failed.output
    _bogus_checkpoints(ck)
    resumed = train(["--epochs", "2", "--resume", "--out-dir", tmp_path / "a"] + common)
    resumed.check()
    assert "resumed from" in resumed.output and "ckpt-000000008.npz" in resumed.output
    assert resumed.output.count("skipping checkpoint") == 3, resumed.output
    # its own newest two are kept; the unusable higher-numbered files did not push them out
    assert steps(ck) == [14, 16, 997, 998, 999]
    # and the run continued exactly: the same as never stopping
    whole = tmp_path / "whole"
    train(["--epochs", "2", "--out-dir", whole]).check()
    with np.load(tmp_path / "a" / "model.npz") as a, np.load(whole / "model.npz") as b:
        for k in b.files:
            if k != "__meta__":
                np.testing.assert_array_equal(a[k], b[k])


def test_a_diverging_run_keeps_its_last_finite_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    common = ["--checkpoint-every", "1", "--keep-checkpoints", "2", "--checkpoint-dir", ck,
              "--out-dir", tmp_path / "a"]
    train(["--epochs", "1"] + common).check()                           # steps 7, 8, finite
    diverged = train(["--epochs", "2", "--resume", "--lr", "1e30"] + common)
    assert diverged.returncode == 2 and "training diverged" in diverged.output
    assert "not writing a checkpoint" in diverged.output
    from mpidl.training import checkpoint

    kept = steps(ck)  # the newest finite ones (a huge lr may leave one more finite step)
    assert len(kept) == 2 and kept[0] >= 7, kept
    for _, path in checkpoint.list_checkpoints(str(ck)):
        state = checkpoint.load(path)
        assert all(np.isfinite(v).all() for v in state["model"].values())
    assert json.loads(open(tmp_path / "a" / "metrics.jsonl").readlines()[-1])["epoch"] == 2


def test_a_full_disk_is_one_line_and_keeps_every_earlier_checkpoint(tmp_path):
    """A small tmpfs (root only) as the checkpoint folder: the third checkpoint does not
    fit. One line, exit 2, the first two intact; with space, --resume goes on to the end."""
    import shutil

    with small_tmpfs(tmp_path / "small", "40m") as small:
        ck = small / "ck"
        common = ["--epochs", "1", "--checkpoint-every", "2", "--keep-checkpoints", "5",
                  "--out-dir", tmp_path / "a"]
        full = train(common + ["--checkpoint-dir", ck])  # (the run's first log line, then)
        errors = [ln for ln in full.output.splitlines() if "error" in ln]
        assert full.returncode == 2 and "Traceback" not in full.output, full.output
        assert len(errors) == 1 and errors[0].startswith("mpidl: error: not enough space"), \
            full.output
        assert "are kept" in errors[0] and "--resume" in errors[0]
        assert steps(ck) == [2, 4]
        moved = tmp_path / "ck"
        shutil.copytree(ck, moved)
    train(common + ["--checkpoint-dir", moved, "--resume"]).check()
    assert steps(moved)[-1] == 8


def test_a_final_model_that_does_not_fit_loses_nothing_checkpointed(tmp_path):
    """--save on a 1 MiB tmpfs (root only): one line that says the final checkpoint holds
    the model; --resume with another --save writes it, equal to the checkpoint's."""
    ck = tmp_path / "ck"
    common = ["--epochs", "1", "--checkpoint-dir", ck, "--out-dir", tmp_path / "a"]
    with small_tmpfs(tmp_path / "small", "1m") as small:
        full = train(common + ["--save", small / "model.npz"])
    errors = [ln for ln in full.output.splitlines() if "error" in ln]
    assert full.returncode == 2 and "Traceback" not in full.output, full.output
    assert len(errors) == 1 and "cannot write the final model" in errors[0], full.output
    assert "the final checkpoint in" in errors[0] and "--resume" in errors[0]
    train(common + ["--resume", "--save", tmp_path / "model.npz"]).check()
    from mpidl.training import checkpoint

    state = checkpoint.load(checkpoint.list_checkpoints(str(ck))[-1][1])
    with np.load(tmp_path / "model.npz") as f:
        for k, v in state["model"].items():
            np.testing.assert_array_equal(f[k], v)


def test_resume_refuses_a_folder_whose_checkpoints_all_belong_to_another_model(tmp_path):
    """--resume (auto) where every checkpoint is another model's: one error line, exit 2,
    and the earlier run's outputs untouched (it used to start over in the same folder)."""
    out = tmp_path / "run"
    train(["--model", "mlp", "--epochs", "1", "--checkpoint-every", "4", "--out-dir",
           out]).check()
    model = (out / "model.npz").read_bytes()
    before = steps(out / "checkpoints")
    launch = train(["--model", "cnn", "--epochs", "1", "--resume", "auto", "--out-dir", out])
    last = [ln for ln in launch.output.splitlines() if ln.strip()][-1]
    assert launch.returncode == 2, launch.output
    assert last.startswith("mpidl: error: --resume: none of the") and \
        "its model has other parameters" in last, launch.output
    assert (out / "model.npz").read_bytes() == model
    assert steps(out / "checkpoints") == before


def sharded_train(n, args, env=None, ranks=None):
    """``mpidl train --zero 1`` on ``n`` ranks (ZeRO shards its checkpoints: every rank
    writes one); ``ranks``: an MPMD launch, one ``(count, prefix)`` per rank group."""
    from mpirun import mpiexec_cmd

    cmd = [sys.executable, "-m", "mpidl.cli.main", "train", *FAST, "--zero", "1",
           *[str(a) for a in args]]
    launch = [*mpiexec_cmd()]
    for i, (count, prefix) in enumerate(ranks or [(n, [])]):
        launch += ([":"] if i else []) + ["-n", str(count), *prefix, *cmd]
    return run_command(launch, timeout=180, env=env)


def test_a_diverging_sharded_run_writes_no_shard_of_its_non_finite_steps(tmp_path):
    """Under ZeRO every rank writes its chunks: the ranks agree that they are finite
    before any shard is written, so the diverged steps leave no shard and no index, and
    the last finite checkpoint stays whole."""
    ck = tmp_path / "ck"
    common = ["--checkpoint-every", "1", "--keep-checkpoints", "2", "--checkpoint-dir", ck,
              "--out-dir", tmp_path / "a"]
    sharded_train(2, ["--epochs", "1"] + common).check()  # steps 3, 4 (8 batches of 32)
    diverged = sharded_train(2, ["--epochs", "2", "--resume", "--lr", "1e30"] + common)
    assert diverged.returncode == 2 and "training diverged" in diverged.output, \
        diverged.output
    from mpidl.training import checkpoint

    kept = checkpoint.list_checkpoints(str(ck))
    assert len(kept) == 2, os.listdir(ck)
    indexed = {f"ckpt-{s:09d}-shard-{i}-of-2.npz" for s, _ in kept for i in range(2)}
    shards = {n for n in os.listdir(ck) if "-shard-" in n}
    assert shards == indexed, (sorted(shards), sorted(indexed))
    for _, path in kept:
        state = checkpoint.load(path)
        assert all(np.isfinite(v).all() for v in state["model"].values())


def test_a_checkpoint_folder_the_ranks_do_not_share_is_one_line(tmp_path):
    """Rank 1 in a mount namespace of its own, with a tmpfs over the checkpoint folder
    (as a folder local to each node would be): its shard is not where the first rank
    looks, so the first rank says so in one line, exit 2, instead of writing an index
    whose shard is elsewhere (root only: mount namespaces)."""
    if os.geteuid() != 0:
        pytest.skip("a mount namespace needs root (CI runs as root)")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a mount namespace here")
    ck = tmp_path / "ck"
    ck.mkdir()
    own = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs {ck} && exec "$@"', "sh"]
    launch = sharded_train(2, ["--epochs", "1", "--checkpoint-every", "2",
                               "--checkpoint-dir", ck, "--out-dir", tmp_path / "a"],
                           ranks=[(1, []), (1, own)])
    errors = [ln for ln in launch.output.splitlines() if "mpidl: error:" in ln]
    assert launch.returncode == 2 and "Traceback" not in launch.output, launch.output
    assert len(errors) == 1 and "ckpt-000000002-shard-1-of-2.npz, written by another rank, " \
        "is not in" in errors[0] and "shared file system" in errors[0], launch.output
    from mpidl.training import checkpoint

    assert checkpoint.list_checkpoints(str(ck)) == []  # no index of a checkpoint in pieces


@pytest.mark.parametrize("kind", ["dgc", "local-sgd"])
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_each_ranks_own_state_stays_on_its_rank_for_a_checkpoint(kind, n):
    """N ranks, a 48.5 MB MLP, DGC's residuals (local SGD's own parameters and momentum):
    making the runtime's part of a checkpoint keeps each rank's own arrays on it for its
    rank shard (under 4 MB allocated on any rank, the root's included), where gathering
    them put every rank's on the root (``tests/ranks/own_state.py``, both in the same
    run). CI: 2 ranks (the bound is per rank); 4 (14 s for DGC on 2 cores, the README's
    figures) with -m slow."""
    from mpirun import HERE, run_ranks

    out = run_ranks(n, [f"{HERE}/ranks/own_state.py", kind], timeout=300).check().output
    assert out.count(f"own_state {kind} rank") == n, out

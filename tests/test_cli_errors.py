"""Bad input gives one clear line on stderr and exit status 2, never a traceback.

The five cases the issue names (unknown config key, negative lr, missing data directory,
corrupt IDX file, a layer whose input does not fit its weights), a few more, and the same
under mpiexec with several ranks: every rank exits 2, the line is printed once.
"""

import json
import os
import re
import sys

import numpy as np
import pytest

from mpirun import assert_one_line_error, mpiexec_cmd, run_cli_cases, run_command

MPIDL = [sys.executable, "-m", "mpidl.cli.main"]
FAST = ["--no-progress", "--dataset", "synthetic", "--limit-train", "256", "--limit-test",
        "64", "--epochs", "1"]


def run(args, n=None, timeout=120):
    cmd = ([*mpiexec_cmd(), "-n", str(n)] if n else []) + MPIDL + [str(a) for a in args]
    return run_command(cmd, timeout=timeout)


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "mlp"\nlearning_rate = 0.1\n')
    assert_one_line_error(run(["train", "--config", cfg] + FAST),
                          "unknown key 'learning_rate'", str(cfg), "valid keys:", "lr")


def test_negative_lr():
    assert_one_line_error(run(["train", "--lr", "-0.1"] + FAST), "--lr must be positive",
                          "-0.1")


def test_missing_data_dir(tmp_path):
    missing = tmp_path / "no-such-dir"
    line = assert_one_line_error(
        run(["train", "--no-progress", "--dataset", "fashion-mnist", "--data-dir", missing]),
        str(missing), "does not exist", "apt-get install dataset-fashion-mnist")
    assert "--data-dir DIR" in line


def test_corrupt_idx_file(tmp_path):
    from mpidl.data.idx import write_idx

    for prefix, n in (("train", 20), ("t10k", 10)):
        write_idx(str(tmp_path / f"{prefix}-images-idx3-ubyte.gz"), np.zeros((n, 28, 28), np.uint8))
        write_idx(str(tmp_path / f"{prefix}-labels-idx1-ubyte.gz"), np.zeros(n, np.uint8))
    bad = tmp_path / "t10k-images-idx3-ubyte"  # a raw (not gzip) file, truncated
    os.remove(tmp_path / "t10k-images-idx3-ubyte.gz")
    write_idx(str(bad), np.zeros((10, 28, 28), np.uint8))
    bad.write_bytes(bad.read_bytes()[:-50])  # truncated
    assert_one_line_error(
        run(["train", "--no-progress", "--dataset", "fashion-mnist", "--data-dir", tmp_path]),
        str(bad), "truncated", "expected 7856")


def test_corrupt_magic_number(tmp_path):
    from mpidl.data.idx import write_idx

    for prefix, n in (("train", 20), ("t10k", 10)):
        write_idx(str(tmp_path / f"{prefix}-images-idx3-ubyte"), np.zeros((n, 28, 28), np.uint8))
        write_idx(str(tmp_path / f"{prefix}-labels-idx1-ubyte"), np.zeros(n, np.uint8))
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(b"\x08\x01\x00\x00" + labels.read_bytes()[4:])
    assert_one_line_error(
        run(["train", "--no-progress", "--dataset", "mnist", "--data-dir", tmp_path]),
        str(labels), "not an IDX file", "magic number")


def test_layer_input_does_not_fit_its_weights(tmp_path):
    """An MLP saved for 8x8 images (digits), started on 28x28 images: layer 1's weights
    expect 64 features, the data has 784."""
    from mpidl.engine.models import build_model
    from mpidl.training.checkpoint import save_model

    path = tmp_path / "digits-mlp.npz"
    save_model(str(path), build_model("mlp", input_shape=(1, 8, 8)),
               {"model": "mlp", "input_shape": [1, 8, 8], "num_classes": 10})
    assert_one_line_error(run(["train", "--init", path] + FAST),
                          "does not fit dataset 'synthetic'", "layer 1", "Linear",
                          "expects 64 input features, got 784")


def test_init_file_missing(tmp_path):
    assert_one_line_error(run(["train", "--init", tmp_path / "none.npz"] + FAST),
                          "--init", "none.npz", "no such file")


USER_ERRORS = [
    (["train", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["train", "--epochs", "two"], ["--epochs", "invalid int value"]),
    (["train", "--model", "vgg"] + FAST, ["unknown model 'vgg'", "mlp"]),
    (["train", "--dataset", "imagenet", "--no-progress"], ["unknown dataset 'imagenet'"]),
    (["train", "--strategy", "nosuch"] + FAST, ["strategy 'nosuch' is not available"]),
    (["train", "--schedule", "exp"] + FAST, ["--schedule 'exp'", "unknown schedule"]),
    (["train", "--resume"] + FAST, ["--resume needs"]),
    (["train", "--batch-size", "4096", "--drop-last"] + FAST, ["larger than the 256"]),
    (["train", "--model", "resnet-tiny", "--dropout", "0.1"] + FAST,
     ["--dropout: model 'resnet-tiny' has no dropout layers"]),
    (["train", "--dropout", "1.5"] + FAST, ["--dropout must be in [0, 1)"]),
    (["train", "--cuda-graph"] + FAST, ["--cuda-graph needs the model on a GPU",
                                        "--device gpu"]),
    (["train", "--cuda-graph", "--accumulate", "2"] + FAST,
     ["--cuda-graph captures a step of one batch", "--accumulate 2"]),
    (["train", "--cuda-graph", "--precision", "bf16"] + FAST,
     ["--precision bf16 cannot be used with --cuda-graph"]),
    ([], ["no command given"]),
]


@pytest.fixture(scope="module")
def one_process_errors():
    """The launches of USER_ERRORS, then of BAD_VALUES, in that order, every command
    through ``mpidl``'s main in one process (``mpirun.run_cli_cases``): they fail before
    any rank communicates."""
    return run_cli_cases([args for args, _ in USER_ERRORS]
                         + [["train"] + args + FAST for args, _ in BAD_VALUES])


def _ids(cases):
    return [" ".join(args)[:60] for args, _ in cases]


@pytest.mark.parametrize("case", range(len(USER_ERRORS)), ids=_ids(USER_ERRORS))
def test_more_user_errors(case, one_process_errors):
    assert_one_line_error(one_process_errors[case], *USER_ERRORS[case][1])


def test_user_error_in_its_own_process_is_one_line():
    """One of them as a command of its own: one line, exit 2, nothing else."""
    assert_one_line_error(run(["train", "--model", "vgg"] + FAST), "unknown model 'vgg'")


# (the other MPIs: test_any_mpi.py's test_user_error_is_one_mpidl_error_line_and_exit_2)
def test_user_error_under_mpiexec_is_printed_once_and_all_ranks_exit_2():
    launch = run(["train", "--lr", "-1"] + FAST, n=3)
    assert_one_line_error(launch, "--lr must be positive")


def test_help_explains_every_flag():
    launch = run(["train", "--help"]).check()
    for flag in ("--model", "--dataset", "--data-dir", "--epochs", "--batch-size",
                 "--optimizer", "--lr", "--momentum", "--weight-decay", "--schedule",
                 "--warmup-epochs", "--scale-lr", "--seed", "--device", "--dtype", "--config",
                 "--strategy", "--algorithm", "--bucket-mb", "--overlap", "--compression",
                 "--ratio", "--checkpoint-dir", "--checkpoint-every", "--resume", "--metrics",
                 "--save", "--out-dir", "--limit-train", "--limit-test", "--no-progress",
                 "--verbose", "--drop-last", "--init"):
        assert flag in launch.output, flag


def test_info():
    launch = run(["info"]).check()
    for key in ("mpidl", "numpy", "mpi4py", "numba", "mpi_library", "ranks", "backend",
                "gpus", "cuda_aware_mpi"):
        assert key in launch.output, key


# (the other MPIs: test_any_mpi.py's test_info_reports_the_loaded_mpi_library)
def test_info_under_mpiexec_json():
    import json

    launch = run(["info", "--json"], n=2).check()
    lines = [line for line in launch.output.splitlines() if line.startswith("{")]
    assert len(lines) == 1, launch.output  # rank 0 prints
    info = json.loads(lines[0])
    assert info["ranks"] == 2 and [r["rank"] for r in info["per_rank"]] == [0, 1]


@pytest.mark.parametrize("n, extra", [
    (None, []),
    (2, []),
    (3, ["--strategy", "ps", "--mode", "async"]),  # the server ends cleanly too
])
def test_a_diverging_run_stops_with_one_error_and_saves_nothing(tmp_path, n, extra):
    """A learning rate far too large (1e30: the loss overflows at once): once an epoch's
    loss is NaN or infinite, every rank stops after that epoch (exit 2, one line saying
    what to try) instead of training on NaN."""
    out = tmp_path / "run"
    launch = run(["train"] + FAST + ["--epochs", "4", "--limit-train", "2048", "--lr", "1e30",
                                     "--out-dir", out] + extra, n=n)
    assert not launch.timed_out, launch.output
    assert launch.returncode == 2, launch.output
    errors = [line for line in launch.output.splitlines() if "mpidl: error:" in line]
    assert len(errors) == 1, launch.output
    m = re.search(r"training diverged: the mean training loss of epoch (\d) is (nan|inf)",
                  errors[0])
    assert m, errors[0]
    assert "lower --lr" in errors[0]
    assert ("try --momentum 0" in errors[0]) == ("async" in extra)
    assert "Traceback" not in launch.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line]
    assert len(records) == int(m.group(1)) < 4  # stopped at the first diverged epoch,
    assert records[-1]["train_loss"] is None  # which is logged,
    assert not list(out.glob("*.npz")), sorted(os.listdir(out))  # but no model is saved


# -- values that used to end in a traceback (issue "Nothing lost, nothing silent", its
#    list of tracebacks): each is one line and exit 2, before any training time is spent

BAD_VALUES = [
    (["--lr", "inf"], ["--lr must be positive, got inf"]),
    (["--weight-decay", "nan"], ["--weight-decay must be a number >= 0, got nan"]),
    (["--warmup-epochs", "nan"], ["--warmup-epochs must be a number >= 0"]),
    (["--warmup-epochs", "inf"], ["--warmup-epochs must be a number >= 0"]),
    (["--bucket-mb", "inf"], ["--bucket-mb must be a positive number of MiB"]),
    (["--bucket-mb", "1e-9"], ["--bucket-mb must be a positive number of MiB, at least one"]),
    (["--seed", "-1"], ["--seed must be a whole number >= 0"]),
    (["--mode", "asynch"], ["--mode must be one of sync, async, ssp, backup"]),
    (["--sparse-grads", "foo"], ["--sparse-grads must be one of allgather, dense"]),
    (["--wait", "0"], ["--wait must be at least 1"]),
    (["--epoch-quorum", "0"], ["--epoch-quorum must be at least 1"]),
    (["--strategy", "ps", "--servers", "0"], ["--servers must be at least 1"]),
]


@pytest.mark.parametrize("case", range(len(BAD_VALUES)), ids=_ids(BAD_VALUES))
def test_bad_numbers_and_words_are_one_line(case, one_process_errors):
    assert_one_line_error(one_process_errors[len(USER_ERRORS) + case], *BAD_VALUES[case][1])


def test_bad_files_are_one_line(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_bytes(b'lr = "\xff\xfe"\n')
    assert_one_line_error(run(["train", "--config", toml] + FAST), "is not UTF-8 text")
    np.save(tmp_path / "a.npy", np.zeros(3))
    assert_one_line_error(run(["train", "--init", tmp_path / "a.npy"] + FAST),
                          "single array (.npy), not the .npz archive")
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04" + b"\0" * 40)
    assert_one_line_error(run(["train", "--init", tmp_path / "cut.npz"] + FAST),
                          "--init", "not a model file saved by mpidl train")


def test_unwritable_outputs_are_one_line_before_training(tmp_path):
    (tmp_path / "afile").write_text("")
    line = assert_one_line_error(
        run(["train", "--out-dir", tmp_path / "afile" / "sub"] + FAST),
        "--out-dir: cannot make the folder")
    assert "Not a directory" in line
    assert_one_line_error(run(["train", "--metrics", tmp_path, "--out-dir",
                               tmp_path / "o"] + FAST), "--metrics", "that is a folder")


def test_resuming_another_strategys_checkpoint_is_one_line(tmp_path):
    ck = tmp_path / "ck"
    run(["train", "--checkpoint-dir", ck, "--out-dir", tmp_path / "a"] + FAST, n=2).check()
    launch = run(["train", "--strategy", "ps", "--resume", "--checkpoint-dir", ck,
                  "--out-dir", tmp_path / "b"] + FAST, n=3)
    assert_one_line_error(launch, "cannot resume", "strategy: checkpoint 'allreduce', now 'ps'")


# -- ranks that disagree (MPMD launches with other settings on some ranks)

SAME_CHECK = pytest.mark.slow  # (one check compares every setting: a few flags in CI)


@pytest.mark.parametrize("flag, a, b", [
    ("--lr", "0.1", "0.2"), pytest.param("--momentum", "0.9", "0.5", marks=SAME_CHECK),
    pytest.param("--weight-decay", "0", "0.01", marks=SAME_CHECK),
    pytest.param("--schedule", "cosine", "constant", marks=SAME_CHECK),
    ("--optimizer", "sgd", "adam"), pytest.param("--seed", "1", "2", marks=SAME_CHECK),
    pytest.param("--epochs", "1", "2", marks=SAME_CHECK),
    pytest.param("--batch-size", "32", "64", marks=SAME_CHECK),
    ("--limit-train", "256", "128"), pytest.param("--overlap", "on", "off", marks=SAME_CHECK),
    ("--compression", "topk", "none"),
])
def test_ranks_that_disagree_end_with_one_line(tmp_path, flag, a, b):
    """Before, these diverged silently (lr, momentum, ...) or hung forever (epochs, batch
    size, limit-train, overlap, compression on one rank only). ``check_ranks_agree``
    compares every setting alike: CI runs a value that diverged (--lr), one that builds
    another optimizer (--optimizer), one that changed the data (--limit-train: the
    setting is named, not the data) and one that built another runtime (--compression);
    the other flags are slow."""
    common = MPIDL + ["train"] + FAST + ["--out-dir", str(tmp_path)]
    cmd = [*mpiexec_cmd(), "-n", "1"] + common + [flag, a, ":", "-n", "1"] + common + [flag, b]
    launch = run_command(cmd, timeout=60)
    assert_one_line_error(launch, f"ranks disagree on {flag}", "rank 0:", "rank 1:")


@pytest.mark.mpi_matrix
def test_flags_that_only_exist_on_one_rank_are_named(tmp_path):
    common = MPIDL + ["train"] + FAST + ["--out-dir", str(tmp_path)]
    for flag in ("--scale-lr", "--drop-last"):
        cmd = [*mpiexec_cmd(), "-n", "1"] + common + [flag, ":", "-n", "1"] + common
        assert_one_line_error(run_command(cmd, timeout=60), f"ranks disagree on {flag}",
                              "rank 0: True", "rank 1: False")

"""Worker groups of the parameter server (``--strategy ps --group-size G``).

On real ranks (``mpiexec``, float64):

1. one group of every worker under ``--mode sync`` trains bitwise like ``--strategy
   allreduce`` on as many ranks: the group's gradient is data parallelism's fused
   all-reduce over a group of the same size (same buckets, same algorithm, so the same
   sums), and the server's SGD step is the same element-wise update;
2. ``--group-size 1`` is the parameter server as it was: the preset builds the same
   ``PushPull`` part for the same workers, and a run with it equals one without the
   option bitwise (and the global-batch reference to 1e-12);
3. 1 server + 2 groups of 2 (``ranks/ps_groups_check.py``), sync and async: every rank
   of a group holds the same parameters after every pull and every barrier, every
   worker after a barrier; the server counted one push per group and step, from the
   leaders only; sync matches the single-process global-batch reference (the standard
   of ``test_parameter_server_mpi.py``: 1e-12 relative, here two means instead of one);
   async equals a single-process replay of the server's schedule in which each push is
   its group's mean gradient (measured: 0).

And the refusals, one line each: G not dividing the workers, G with another strategy,
G < 1. Slow (``-m slow``): a checkpoint written with groups and resumed after a worker
failed continues bitwise.
"""

import json
import os
from types import SimpleNamespace

import pytest

from mpirun import (HERE, assert_bitwise_equal, assert_one_line_error, model_arrays,
                    run_command, run_ranks, train_cmd)

CHECK = os.path.join(HERE, "ranks", "ps_groups_check.py")
SMALL = ["--dataset", "synthetic", "--model", "mlp", "--epochs", "2", "--batch-size", "16",
         "--limit-train", "512", "--limit-test", "64", "--seed", "3"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def test_one_group_of_every_worker_equals_allreduce_bitwise(tmp_path):
    ps, ar = tmp_path / "ps", tmp_path / "allreduce"
    run_command(train_cmd(5, ps, "--strategy", "ps", "--group-size", "4", "--mode", "sync",
                          *SMALL), timeout=120).check()
    run_command(train_cmd(4, ar, "--strategy", "allreduce", *SMALL), timeout=120).check()
    assert_bitwise_equal(model_arrays(ps / "model.npz"), model_arrays(ar / "model.npz"))
    last = _metrics(ps)[-1]
    steps = 2 * 512 // (16 * 4)
    assert last["ps_pushed"] == last["ps_applied"] == last["ps_updates"] == steps, last


def test_group_size_one_is_the_parameter_server_as_before(groups):
    """On the 5 ranks: ``group_size=1`` and the option left out build the same part (the
    plain worker side, the servers knowing all 4 workers) and train the same bits."""
    for name in ("g1_one", "g1_absent"):
        workers = groups[name][1:]
        assert [w["part"] for w in workers] == ["PushPull"] * 4, workers
        assert all(w["servers_know"] == [1, 2, 3, 4] for w in workers), workers
        assert groups[name][0]["stats"]["pushes_by_worker"] == {str(r): 12 for r in
                                                                 range(1, 5)}
    for w in groups["g1_compare"][1:]:
        assert w["bitwise"], w
        assert w["vs_reference"] <= 1e-12, w


def _fake_comm(rank, size):
    """What a preset reads from the world at build time (it does not communicate)."""
    return SimpleNamespace(rank=rank, size=size)


def test_group_size_one_builds_the_same_part():
    from mpidl.runtime import build
    from mpidl.runtime.sync.pushpull import PushPull

    for rank in (1, 2, 3):
        rt = build("ps", _fake_comm(rank, 4), mode="async", group_size=1)
        (_, sync), = rt.syncs
        assert type(sync) is PushPull and sync.worker_ranks == [1, 2, 3]
    server = build("ps", _fake_comm(0, 4), group_size=1).server
    assert server.worker_ranks == [1, 2, 3]
    # the all-reduce's settings serve groups only: without, they are said to do nothing
    assert build("ps", _fake_comm(1, 4), algorithm="ring").unused_options == ("algorithm",)
    rt = build("ps", _fake_comm(1, 5), algorithm="ring", group_size=2)
    assert rt.unused_options == () and rt.syncs[0][1].allreduce.algorithm == "ring"


def test_the_servers_know_only_the_leaders():
    from mpidl.runtime import build
    from mpidl.runtime.sync.groups import WorkerGroups

    server = build("ps", _fake_comm(0, 7), servers=1, group_size=3, mode="ssp",
                   staleness=1).server
    assert server.worker_ranks == [1, 4]
    rt = build("ps", _fake_comm(5, 7), servers=1, group_size=3)
    (_, sync), = rt.syncs
    assert isinstance(sync, WorkerGroups)
    assert sync.leader_sync.worker_ranks == [1, 4]
    assert rt.trainer_ranks == [1, 2, 3, 4, 5, 6]  # everyone still trains on its shard
    # the mode's checks count groups: backup waits for at most 2 of them
    from mpidl.errors import ConfigError

    with pytest.raises(ConfigError, match="first k of 2 workers"):
        build("ps", _fake_comm(0, 7), group_size=3, mode="backup", wait=3)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_groups") / "results.json"
    run_ranks(5, [CHECK, out], timeout=120).check()
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_groups_of_two(groups, mode):
    rows = groups[mode]
    server, workers = rows[0], rows[1:]
    st = server["stats"]
    assert [w["leader"] for w in workers] == [True, False, True, False]
    assert [w["group"] for w in workers] == [0, 0, 1, 1]
    assert [w["shard"] for w in workers] == [[i, 4] for i in range(4)]  # own data each
    steps = workers[0]["steps"]
    assert steps > 0 and all(w["steps"] == steps for w in workers)
    for w in workers:
        assert w["checks"] == steps
        assert w["step_mismatches"] == [], w    # the same parameters after every pull
        assert w["barrier_mismatches"] == [], w
        assert w["world_mismatches"] == [], w   # every group after the epoch barrier
    # one push per group and step, from the leaders only
    assert st["pushes_by_worker"] == {"1": steps, "3": steps}
    assert st["pushed"] == st["applied"] == 2 * steps and st["dropped"] == 0
    assert [w["pushes"] for w in workers] == [steps, 0, steps, 0]
    assert workers[0]["metrics"]["ps_pushed"] == 2 * steps  # what the root reports
    if mode == "sync":
        assert st["updates"] == steps and st["max_staleness"] == 0
        for w in workers:
            assert w["vs_reference"] <= 1e-12, w
    else:
        assert st["updates"] == 2 * steps
        assert st["max_staleness"] >= 1, st  # the slow group's pushes were stale
        for w in workers:
            assert w["vs_replay"] <= 1e-12, w


# -- refusals

def test_group_size_must_divide_the_workers():
    from mpidl.errors import ConfigError
    from mpidl.runtime import build

    with pytest.raises(ConfigError) as e:
        build("ps", _fake_comm(0, 4), group_size=2)
    msg = str(e.value)
    assert "--group-size 2 does not divide the 3 worker(s) (ranks 1..3; rank 0 serves)" \
        in msg and "(1, 3)" in msg and "mpiexec -n 5" in msg, msg


@pytest.mark.parametrize("strategy", ["allreduce", "local", "hogwild"])
def test_group_size_needs_the_parameter_server(strategy):
    from mpidl.errors import ConfigError
    from mpidl.runtime import build

    with pytest.raises(ConfigError, match=f"not of --strategy {strategy}: add --strategy ps"):
        build(strategy, _fake_comm(0, 4), group_size=2)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_group_size_below_one(bad):
    from mpidl.errors import ConfigError
    from mpidl.runtime import build

    with pytest.raises(ConfigError, match="--group-size must be a whole number"):
        build("ps", _fake_comm(0, 4), group_size=bad)


def test_group_size_below_one_from_the_command_line_or_a_config_file(tmp_path):
    from mpidl import config
    from mpidl.errors import ConfigError
    from mpidl.runtime.presets import cli_options

    config.register(cli_options())  # (what the command line does before parsing)
    with pytest.raises(ConfigError, match=r"--group-size must be at least 1 \(1: no "
                       r"groups\), got 0"):
        config.resolve({"group_size": 0})
    toml = tmp_path / "run.toml"
    toml.write_text("group_size = 2\n")
    assert config.strategy_kwargs(config.resolve({}, str(toml)))["group_size"] == 2


def test_cli_refusals_areassert_one_line_error(tmp_path):
    """Under mpiexec (every rank refuses, the line is printed once) and on one process."""
    fast = ["--dataset", "synthetic", "--limit-train", "64", "--limit-test", "32",
            "--epochs", "1"]
    assert_one_line_error(run_command(train_cmd(4, tmp_path, "--strategy", "ps", "--group-size", "2",
                                    *fast), timeout=60),
              "--group-size 2 does not divide the 3 worker(s)")
    cmd = train_cmd(None, tmp_path, "--group-size", "2", *fast)  # one process, no mpiexec
    assert_one_line_error(run_command(cmd, timeout=60), "--group-size 2 makes worker groups of a "
              "parameter server, not of --strategy local")


@pytest.mark.slow
def test_checkpoint_and_resume_with_groups_is_bitwise(tmp_path):
    """Checkpoints at epoch ends (the root leader asks the servers for their state; the
    leaders' compressor memories travel per rank): a non-leader that fails in epoch 3
    and a --resume give the uninterrupted run's model and counts."""
    args = ["--strategy", "ps", "--group-size", "2", "--compression", "topk", "--ratio",
            "0.05", "--dataset", "synthetic", "--model", "mlp", "--epochs", "3",
            "--batch-size", "16", "--limit-train", "512", "--limit-test", "64", "--seed", "3"]
    full, run = tmp_path / "full", tmp_path / "run"
    run_command(train_cmd(5, full, *args), timeout=180).check()
    ckpt = ["--checkpoint-dir", str(run / "ckpt")]
    steps = 512 // (16 * 4)
    failed = run_command(train_cmd(5, run, *args, *ckpt), timeout=180,
                         env={"MPIDL_FAIL_AT": f"4:{2 * steps + 3}"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    assert sorted(os.listdir(run / "ckpt")) == [f"ckpt-{steps:09d}.npz",
                                                f"ckpt-{2 * steps:09d}.npz"]
    resumed = run_command(train_cmd(5, run, *args, *ckpt, "--resume"), timeout=180).check()
    assert f"step {2 * steps}, epoch 3" in resumed.output, resumed.output
    assert_bitwise_equal(model_arrays(run / "model.npz"), model_arrays(full / "model.npz"))
    counts = ("ps_pushed", "ps_applied", "ps_updates", "ps_max_lead")
    a, b = _metrics(run)[-1], _metrics(full)[-1]
    assert {k: a[k] for k in counts} == {k: b[k] for k in counts}

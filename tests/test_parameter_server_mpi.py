"""Parameter server on real MPI ranks: one launch of many scenarios, plus the error paths.

``ranks/ps_check.py`` runs on 4 ranks (2 shared cores: oversubscribed, fine for
correctness) and records what every rank saw; the tests below assert on it:

1. sync PS == all-reduce data parallelism over the same worker ranks, and == the
   single-process global-batch reference, after 2 epochs of SGD with momentum and a
   changing lr: relative difference <= 1e-12 in float64 and <= 1e-5 in float32 (measured:
   0 against all-reduce, ~5e-16 / ~2e-7 against the reference), with 1 and 2 servers,
   dense and row-sparse (Embedding) gradients.
2. SSP never exceeds its bound: every push's lead (its clock minus the slowest active
   worker's) is <= s, with a 4x straggler; and it reaches s (the bound is what binds).
3. pushed == applied + dropped on every server, in every mode, and equals what the
   workers say they pushed.
4. Pushes compressed with each compressor (error feedback where it has one) arrive, are
   applied, and cost the bytes they should.
5. With one worker, async, SSP and backup give sync's parameters bitwise (nothing is
   stale), and sync matches the single-process reference.
6. With 3 workers and a straggler, async and SSP equal a single-process replay of the
   server's schedule (which push, computed from which version, applied when).
"""

import json
import os
import shutil
import sys
import time

import pytest

from mpirun import HERE, run_command, run_ranks

CHECK = os.path.join(HERE, "ranks", "ps_check.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps") / "results.json"
    launch = run_ranks(4, [CHECK, out], timeout=150)
    launch.check()
    with open(out) as f:
        return json.load(f)


def _workers(rows):
    return [r for r in rows if not r.get("server") and "vs_reference" in r]


@pytest.mark.parametrize("case, servers, tol", [
    ("eq_s1_f64", 1, 1e-12), ("eq_s2_f64", 2, 1e-12), ("eq_s1_f32", 1, 1e-5),
    ("eq_sparse_s2", 2, 1e-12)])
def test_sync_ps_equals_global_batch_reference(results, case, servers, tol):
    rows = results[case]
    workers = _workers(rows)
    assert len(workers) == 4 - servers
    for w in workers:
        assert w["vs_reference"] <= tol, (case, w)
        # data parallelism (all-reduce) over the same worker ranks
        assert w["vs_allreduce"] <= tol, (case, w)
    servers_rows = [r for r in rows if r.get("server")]
    assert len(servers_rows) == servers
    held = [n for r in servers_rows for n in r["holds"]]
    assert len(held) == len(set(held))  # every tensor on exactly one server
    for r in servers_rows:
        assert r["pushed"] == r["applied"] and r["dropped"] == 0
        assert r["opt_state"] == sorted(r["holds"])  # optimizer state: own shard only


def test_one_worker_every_mode_gives_sync_parameters(results):
    rows = results["one_worker"]
    worker = next(r for r in rows if "vs_sync" in r)
    server = next(r for r in rows if "counts" in r)
    assert sorted(worker["vs_sync"]) == sorted(["sync", "async", "async_salr", "softsync",
                                                "ssp0", "ssp2", "backup"])
    assert all(d == 0.0 for d in worker["vs_sync"].values()), worker["vs_sync"]
    assert worker["vs_reference"] <= 1e-12
    for mode, c in server["counts"].items():
        assert c["pushed"] == c["applied"] > 0 and c["dropped"] == 0, (mode, c)


def test_sparse_gradients_travel_as_rows(results):
    rows = results["eq_sparse_s2"]
    dense = _workers(rows)[0]["dense_bytes"]
    got = sum(r["bytes_received"] for r in rows if r.get("server"))
    pushes = rows[0]["pushed"]
    # the 1000x6 embedding table is pushed as 8x5 looked-up rows + ids, not densely
    assert got < pushes * dense


MODES = ["mode_sync", "mode_async", "mode_async_salr", "mode_ssp1", "mode_ssp3",
         "mode_backup", "mode_softsync"]


@pytest.mark.parametrize("case", MODES)
def test_accounting_pushed_equals_applied_plus_dropped(results, case):
    rows = results[case]
    st = rows[0]["stats"]
    workers = rows[1:]
    assert st["pushed"] == st["applied"] + st["dropped"]
    assert st["pushed"] == sum(w["worker"]["pushes"] for w in workers)
    by_worker = {int(k): v for k, v in st["pushes_by_worker"].items()}
    assert by_worker == {w["rank"]: w["worker"]["pushes"] for w in workers}
    assert len(st["trace"]) == st["pushed"]
    assert sum(1 for row in st["trace"] if row[4] == 0) == st["dropped"]
    for w in workers:
        assert w["finite"]
        m = w["metrics"]  # what the trainer's metrics record gets
        assert m["ps_pushed"] == m["ps_applied"] + m["ps_dropped"] == st["pushed"]
    if case == "mode_backup":
        assert st["dropped"] > 0  # the straggler's late gradients
        assert st["dropped_by_worker"][str(workers[-1]["rank"])] > 0
    else:
        assert st["dropped"] == 0


@pytest.mark.parametrize("case, s", [("mode_ssp1", 1), ("mode_ssp3", 3)])
def test_ssp_never_exceeds_its_bound(results, case, s):
    st = results[case][0]["stats"]
    leads = [row[2] for row in st["trace"]]
    assert max(leads) <= s and st["max_lead"] <= s
    assert max(leads) == s  # with the straggler the bound is reached, and holds
    # without the bound the fast workers run further ahead
    assert results["mode_async"][0]["stats"]["max_lead"] > 1


def test_sync_has_no_staleness_and_the_server_does_not_spin(results):
    assert results["mode_sync"][0]["stats"]["max_staleness"] == 0
    assert results["mode_async"][0]["stats"]["mean_staleness"] > 0
    for case in MODES:
        st = results[case][0]["stats"]
        # 4 ranks on 2 cores, workers mostly compute: the waiting server sleeps
        assert st["cpu_s"] < 0.5 * st["wall_s"] + 0.05, (case, st["cpu_s"], st["wall_s"])


@pytest.mark.parametrize("case", ["replay_async", "replay_ssp1", "replay_async_salr"])
def test_async_and_ssp_equal_a_replay_of_the_servers_schedule(results, case):
    """3 workers, a 3x straggler, float64: recomputing every applied push from the
    version it was computed on, in the server's order, gives its parameters."""
    r = results[case][0]
    assert r["stale"] > 0 and r["max_staleness"] >= 2, r  # staleness really happened
    assert r["vs_replay"] <= 1e-12, r


@pytest.mark.parametrize("case, c", [("replay_softsync1", 1), ("replay_softsync2", 2),
                                     ("replay_softsync3", 3)])
def test_softsync_equals_a_replay_of_its_weighted_groups(results, case, c):
    """n-softsync with c = 1, 2 and 3 (the default: all 3 workers) of 3 workers, a 3x
    straggler, float64: each update is the mean of c gradients (fewer only at an epoch's
    end), each weighted by 1/staleness; recomputing them from the trace gives the
    server's parameters. No worker waits for an update, so gradients are stale."""
    r = results[case]
    row = r[0]
    assert row["vs_replay"] <= 1e-12, row
    assert max(row["group_sizes"]) == c and min(row["group_sizes"]) >= 1, row
    assert row["updates"] < row["pushes"] or c == 1, row
    assert row["stale"] > 0, row


@pytest.mark.parametrize("case", ["quorum_async", "quorum_ssp", "quorum_backup"])
def test_epoch_quorum_ends_epochs_without_the_straggler(results, case):
    """--epoch-quorum 2 of 3, the last worker 6x slower: the two fast workers do their
    whole shard in both epochs, the straggler stops early (fewer pushes), and every push
    is still counted as applied or dropped. Under SSP the fast workers cannot get more
    than s clocks ahead, so the straggler is cut short by at most s steps an epoch and the
    bound still holds."""
    rows = results[case]
    st = rows[0]["stats"]
    workers = rows[1:]
    full = 2 * workers[0]["steps_per_epoch"]
    fast, slow = workers[:-1], workers[-1]
    assert all(w["pushes"] == full for w in fast), (full, workers)
    if case == "quorum_ssp":
        assert full - 2 * 1 <= slow["pushes"] <= full, (full, workers)
        assert st["max_lead"] <= 1
    else:
        assert 0 < slow["pushes"] < full, (full, workers)
    assert st["pushed"] == st["applied"] + st["dropped"] == sum(w["pushes"] for w in workers)
    assert all(w["finite"] for w in workers)


@pytest.mark.parametrize("bad", [pytest.param("shape", marks=pytest.mark.mpi_matrix_extra),
                                 "dtype"])
def test_bad_push_ends_every_rank_with_the_message(bad):
    t0 = time.monotonic()
    launch = run_ranks(3, [CHECK, "--bad-push", bad], timeout=60)
    assert not launch.timed_out, launch.output
    assert launch.returncode != 0
    assert time.monotonic() - t0 < 30
    want = ("worker rank 2 pushed gradient '2.weight' with shape (3, 3)" if bad == "shape"
            else "worker rank 2 pushed gradient '2.weight' with shape (16, 16) and dtype "
                 "float16")
    assert want in launch.output, launch.output
    for rank in range(3):  # every rank printed it before the job ended
        assert f"mpidl ps [rank {rank}]: error: parameter server 0 (rank 0): {want}" \
            in launch.output, launch.output


def _mpidl():
    exe = os.path.join(os.path.dirname(sys.executable), "mpidl")
    return exe if os.path.exists(exe) else shutil.which("mpidl")


def _cli_ready():
    try:
        import mpidl.engine.models  # noqa: F401
        import mpidl.comm  # noqa: F401
    except ImportError:
        return False
    return _mpidl() is not None


@pytest.mark.mpi_matrix_extra
@pytest.mark.skipif(not _cli_ready(), reason="needs the engine's models and the communicator")
def test_cli_ps_two_servers_ssp_with_straggler(tmp_path):
    from mpirun import mpiexec_cmd

    metrics = tmp_path / "m.jsonl"
    cmd = [*mpiexec_cmd(), "-n", "4", _mpidl(), "train", "--strategy", "ps", "--servers",
           "2", "--mode", "ssp", "--staleness", "1", "--straggler", "3:2",
           "--dataset", "synthetic", "--model", "mlp", "--epochs", "2", "--batch-size", "32",
           "--limit-train", "512", "--limit-test", "256", "--no-progress",
           "--metrics", str(metrics), "--out-dir", str(tmp_path)]
    launch = run_command(cmd, timeout=120)
    launch.check()
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert [r["epoch"] for r in records] == [1, 2]
    # the first worker's own step time, and the epoch until every worker is done (the
    # straggler's tail included)
    assert all(0 < r["epoch_time"] <= r["epoch_wall"] for r in records), records
    last = records[-1]
    assert last["ps_pushed"] == last["ps_applied"] + last["ps_dropped"]
    assert last["ps_pushed"] == 2 * 2 * 2 * (512 // 64)  # servers x workers x epochs x steps
    assert last["ps_max_lead"] <= 1
    assert last["test_acc"] > 0.15  # chance is 0.1; the accuracy runs are on Fashion-MNIST
    assert "pushed" in launch.output and "applied" in launch.output
    assert os.path.exists(tmp_path / "model.npz")


@pytest.mark.skipif(_mpidl() is None, reason="mpidl command not installed")
def test_cli_epoch_quorum_cuts_the_stragglers_epochs(tmp_path):
    """The trainer's side of --epoch-quorum: the straggler (6x slower) leaves each epoch
    when the two others are done, and the run still ends normally with every count."""
    from mpirun import mpiexec_cmd

    metrics = tmp_path / "m.jsonl"
    cmd = [*mpiexec_cmd(), "-n", "4", _mpidl(), "train", "--strategy", "ps", "--mode",
           "backup", "--epoch-quorum", "2", "--straggler", "3:6", "--dataset", "synthetic",
           "--model", "mlp", "--epochs", "2", "--batch-size", "32", "--limit-train", "768",
           "--limit-test", "256", "--no-progress", "--metrics", str(metrics),
           "--out-dir", str(tmp_path)]
    run_command(cmd, timeout=120).check()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert [r["epoch"] for r in records] == [1, 2]
    last = records[-1]
    full = 3 * 2 * (768 // (32 * 3))  # workers x epochs x steps
    assert last["step"] == 2 * (768 // (32 * 3))
    assert last["ps_pushed"] == last["ps_applied"] + last["ps_dropped"]
    assert 2 * 2 * (768 // (32 * 3)) < last["ps_pushed"] < full  # only the straggler cut
    assert os.path.exists(tmp_path / "model.npz")


@pytest.mark.skipif(_mpidl() is None, reason="mpidl command not installed")
def test_cli_ps_on_one_rank_is_a_one_line_error():
    launch = run_command([_mpidl(), "train", "--strategy", "ps", "--dataset", "synthetic",
                          "--epochs", "1"], timeout=60)
    assert launch.returncode == 2, launch.output
    assert "needs at least 2 ranks" in launch.output
    assert "Traceback" not in launch.output


@pytest.mark.parametrize("name, max_fraction", [
    ("fp16", 0.5), ("topk", 0.25), ("onebit", 0.05), ("qsgd", 0.2), ("randomk", 0.3),
    ("dgc", 0.25)])
def test_compressed_pushes(results, name, max_fraction):
    rows = results["comp_" + name]
    server, workers = rows[0], rows[1:]
    assert server["pushed"] == server["applied"] == sum(w["pushes"] for w in workers)
    assert server["bytes_received"] == sum(w["bytes_sent"] for w in workers)
    for w in workers:
        assert w["finite"]
        assert w["bytes_sent"] <= max_fraction * w["pushes"] * w["dense_bytes"] + 64
        if name == "fp16":  # nearly lossless: close to the uncompressed reference
            assert w["vs_reference"] < 1e-3


def _model_arrays(path):
    import numpy as np

    with np.load(path) as z:
        return {k: z[k] for k in z.files if not k.startswith("__")}  # not the metadata


@pytest.mark.skipif(not _cli_ready(), reason="needs the engine's models and the communicator")
@pytest.mark.parametrize("extra", [[], pytest.param(
    ["--servers", "2", "--compression", "topk", "--ratio", "0.05"], marks=pytest.mark.slow)],
    ids=["1-server", "2-servers-topk"])
def test_cli_ps_checkpoint_after_rank_failure_then_resume_is_bitwise_equal(tmp_path, extra):
    """Sync PS writes a checkpoint at every epoch end (servers' optimizer state and counts
    included); a worker that fails in epoch 3 and a --resume give the uninterrupted run's
    model and counts."""
    import numpy as np

    from mpirun import mpiexec_cmd

    n = 4 if "--servers" in extra else 3  # two workers either way
    steps_per_epoch = 512 // (32 * 2)
    args = ["train", "--strategy", "ps", "--dataset", "synthetic", "--model", "mlp",
            "--epochs", "3", "--batch-size", "32", "--limit-train", "512", "--limit-test",
            "128", "--seed", "3", "--no-progress"] + extra
    cmd = [*mpiexec_cmd(), "-n", str(n), _mpidl()] + args
    full, run = tmp_path / "full", tmp_path / "run"
    run_command(cmd + ["--out-dir", str(full)], timeout=120).check()
    ckpt = ["--out-dir", str(run), "--checkpoint-dir", str(run / "ckpt")]
    failed = run_command(cmd + ckpt, timeout=120,
                         env={"MPIDL_FAIL_AT": f"{n - 1}:{2 * steps_per_epoch + 3}"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    assert sorted(os.listdir(run / "ckpt")) == [f"ckpt-{steps_per_epoch:09d}.npz",
                                                f"ckpt-{2 * steps_per_epoch:09d}.npz"]
    resumed = run_command(cmd + ckpt + ["--resume"], timeout=120)
    resumed.check()
    assert f"step {2 * steps_per_epoch}, epoch 3" in resumed.output, resumed.output
    a, b = _model_arrays(run / "model.npz"), _model_arrays(full / "model.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k} differs after the resume"
    # the servers' counts go on from the checkpoint: the last epoch's line is the same
    last = [json.loads((d / "metrics.jsonl").read_text().splitlines()[-1]) for d in (run, full)]
    counts = ("ps_pushed", "ps_applied", "ps_dropped", "ps_updates", "ps_max_lead")
    assert {k: last[0][k] for k in counts} == {k: last[1][k] for k in counts}, last


@pytest.mark.skipif(_mpidl() is None, reason="mpidl command not installed")
def test_cli_ps_refuses_checkpoint_every():
    launch = run_command([_mpidl(), "train", "--strategy", "ps", "--dataset", "synthetic",
                          "--epochs", "1", "--checkpoint-every", "5"], timeout=60)
    assert launch.returncode == 2, launch.output
    assert "--checkpoint-every is not supported with --strategy ps" in launch.output
    assert "Traceback" not in launch.output


@pytest.mark.parametrize("spec", [
    pytest.param(["--compression", "onebit"], marks=pytest.mark.slow),
    ["--compression", "dgc:momentum=0.9", "--ratio", "0.05"]])
def test_compression_means_the_same_under_ps_and_allreduce(tmp_path, spec):
    """``--compression`` is built in one place for every strategy: a momentum-correcting
    memory (onebit, dgc) takes the optimizer's momentum over, wherever the optimizer runs.
    Before, under ``--strategy ps`` the servers' optimizer kept its momentum: onebit lost
    its momentum correction and ``dgc:momentum=0.9`` applied momentum twice. Now sync PS on
    2 workers gives the parameters all-reduce gives on 2 ranks (same shards, same
    compressed gradients, averaged in rank order)."""
    import numpy as np

    from mpirun import mpiexec_cmd

    common = ["train", "--dataset", "synthetic", "--model", "mlp", "--epochs", "2",
              "--batch-size", "32", "--limit-train", "512", "--limit-test", "64",
              "--momentum", "0.9", "--lr", "0.02", "--no-progress"] + spec
    saved = {}
    for name, n, extra in (("allreduce", 2, []), ("ps", 3, ["--strategy", "ps"])):
        out = tmp_path / name
        run_command([*mpiexec_cmd(), "-n", str(n), _mpidl()] + common + extra +
                    ["--out-dir", str(out)], timeout=180).check()
        with np.load(out / "model.npz") as f:
            saved[name] = {k: f[k] for k in f.files if k != "__meta__"}
    worst = max(float(np.max(np.abs(saved["ps"][k] - saved["allreduce"][k]))) /
                max(float(np.max(np.abs(saved["allreduce"][k]))), 1e-30)
                for k in saved["allreduce"])
    assert worst <= 1e-6, worst

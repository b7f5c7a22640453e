"""Parallax (``--sparse-sync ps``): the token embedding through parameter servers, the
dense rest all-reduced among the trainers.

On real ranks (``ranks/parallax_check.py``, 5 ranks, float64, gpt-tiny):

1. ``--mode sync`` is bitwise ``--strategy allreduce`` on as many ranks as there are
   trainers, after every step (AdamW with 2 servers, one of them holding nothing; SGD
   with momentum and weight decay, tied weights, and untied: the lazy row update, with
   ``--accumulate 2``), and within 1e-12 of one process at the global batch. The reduction order is the same: each trainer pushes its rows coalesced
   (the arrays the all-gather sends), the server concatenates them in trainer order and
   multiplies by 1/n, and the same optimizer code steps the table (Adam densifies, SGD
   updates the touched rows), on the server instead of on every trainer;
2. the embedding and its optimizer state live on its server only; a trainer pushes
   exactly its batch's distinct ids as rows each step; the epoch line's bytes are the
   buckets' all-reduce plus those pushes;
3. ``--ps-params`` puts named parameters on the servers (dense ones too, then within
   1e-12 of all-reduce: the server divides a sum by n where the buckets scale first),
   and row-sparse ones it leaves out go through the all-gather;
4. ``--mode async``: every push applied, one update per trainer and step, dense
   parameters the same on every trainer after every step, everything after a barrier.

Through the command line: a run (its dense buckets' all-reduce overlapped with backward)
equals all-reduce bitwise (model and validation loss), a
trainer killed in epoch 3 and ``--resume`` end bitwise equal to the uninterrupted run
(epoch-end checkpoints, the servers' AdamW state included), and the refusals are one
line each (exit 2).
"""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from mpirun import (HERE, assert_bitwise_equal, assert_one_line_error, model_arrays,
                    run_command, run_ranks, train_cmd)

CHECK = os.path.join(HERE, "ranks", "parallax_check.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallax") / "results.json"
    run_ranks(5, [CHECK, out], timeout=240).check()
    with open(out) as f:
        return json.load(f)


def _split(rows):
    return [r for r in rows if r["server"]], [r for r in rows if not r["server"]]


@pytest.mark.mpi_matrix_extra
@pytest.mark.parametrize("case, servers, trainers", [("sync_s2", 2, 3), ("sync_tied", 1, 2),
                                                     ("sync_lazy", 1, 1)])
def test_sync_is_allreduce_bitwise(ranks, case, servers, trainers):
    srv, tr = _split(ranks[case])
    assert len(srv) == servers and len(tr) == trainers
    for t in tr:
        assert t["steps"] > 0 and all(t["bitwise_steps"]), t
        assert t["vs_allreduce"] == 0.0, t
        assert t["vs_reference"] <= 1e-12, t
        assert t["remote"] == ["0.weight"] and t["gathered"] == []
        assert "0.weight" not in t["opt_state"] and t["opt_state"], t  # dense state only
    # the table on one server, with its optimizer state; the other server holds nothing
    assert sorted(tuple(s["holds"]) for s in srv) == sorted(
        [("0.weight",)] + [()] * (servers - 1))
    for s in srv:
        assert s["opt_state"] == s["holds"]
    if case == "sync_lazy":  # some step left rows untouched: they and their momentum stay
        assert min(t["fewest_rows"] for t in tr) < tr[0]["vocab"]


def test_traffic_is_the_batch_rows_and_the_buckets(ranks):
    _, tr = _split(ranks["sync_s2"])
    for t in tr:
        # every step: the batch's distinct ids, 8 bytes of index + a float64 row each
        assert t["pushed"] == t["expected_pushed"] > 0, t
        assert t["rows_names"] == ["0.weight"]
        assert t["bytes_sent_per_step"] == t["dense_plus_pushed"], t
        assert t["pulled_per_step"] == t["table_bytes"], t  # the answer: the whole table
        # one push per trainer and step, to each of the 2 servers (counted by each)
        assert t["ps_pushed"] == 2 * 3 * t["steps"]


def test_named_parameters_on_the_servers(ranks):
    srv, tr = _split(ranks["pattern"])
    assert srv[0]["holds"] == ["1.weight", "3.body.1.weight", "3.body.1.bias"]
    for t in tr:
        assert t["remote"] == ["1.weight", "3.body.1.bias", "3.body.1.weight"]
        assert t["gathered"] == ["0.weight"]  # row-sparse, kept: the all-gather
        assert not set(t["bucketed"]) & set(t["remote"] + t["gathered"])
        assert t["vs_allreduce"] <= 1e-12 and t["vs_reference"] <= 1e-12, t
        assert not all(t["bitwise_steps"])  # dense sums on the server: another order


def test_async_applies_every_push(ranks):
    rows = ranks["async"]
    st, tr = rows[0]["stats"], rows[1:]
    steps = tr[0]["steps"]
    assert st["pushed"] == st["applied"] == st["updates"] == 4 * steps and st["dropped"] == 0
    assert st["pushes_by_worker"] == {str(r): steps for r in range(1, 5)}
    assert st["max_lead"] <= 1  # the all-reduce keeps the trainers within a step
    for t in tr:
        assert t["steps"] == steps and t["finite"]
        assert all(t["dense_agree"]), t
        assert t["barrier_agree"], t
        assert t["metrics"]["ps_pushed"] == t["metrics"]["ps_applied"] == 4 * steps


# -- the command line

def corpus(tmp_path, n=3000):
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.txt"
    path.write_text(" ".join(words[i] for i in rng.integers(0, len(words), n // 4)) + "\n",
                    encoding="utf-8")
    return path


def gpt_args(tmp_path, *extra):
    return ["--model", "gpt-tiny", "--dataset", "text", "--data-dir", str(corpus(tmp_path)),
            "--layers", "1", "--heads", "2", "--width", "16", "--context", "16",
            "--limit-train", "48", "--limit-test", "8", "--batch-size", "4", *extra]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def test_cli_equals_allreduce_and_resumes_bitwise(tmp_path):
    """1 server + 2 trainers (overlapped ring all-reduce of small buckets) against
    all-reduce on 2 ranks without overlap, AdamW, 3 epochs; then the same
    run with a trainer killed in epoch 3 and resumed from the epoch-2 checkpoint."""
    args = gpt_args(tmp_path, "--epochs", "3")
    parallax = ["--sparse-sync", "ps", "--overlap", "on", "--algorithm", "ring",
                "--bucket-mb", "0.01"]
    px, ar, run = tmp_path / "parallax", tmp_path / "allreduce", tmp_path / "run"
    launch = run_command(train_cmd(3, px, *parallax, *args), timeout=180).check()
    assert "1 server(s), 2 workers" in launch.output, launch.output
    run_command(train_cmd(2, ar, "--overlap", "off", *args), timeout=180).check()
    assert_bitwise_equal(model_arrays(px / "model.npz"), model_arrays(ar / "model.npz"))
    mp, ma = _metrics(px), _metrics(ar)
    steps = 48 // 8
    assert [m["test_loss"] for m in mp] == [m["test_loss"] for m in ma]
    assert all(m["overlap"] == 1 for m in mp) and all(m["overlap"] == 0 for m in ma)
    assert mp[-1]["ps_pushed"] == mp[-1]["ps_applied"] == 2 * 3 * steps
    assert mp[-1]["ps_updates"] == 3 * steps
    ckpt = ["--checkpoint-dir", str(run / "ckpt")]
    failed = run_command(train_cmd(3, run, *parallax, *args, *ckpt), timeout=180,
                         env={"MPIDL_FAIL_AT": f"2:{2 * steps + 2}"})
    assert failed.returncode != 0 and not failed.timed_out, failed.output
    assert sorted(os.listdir(run / "ckpt")) == [f"ckpt-{steps:09d}.npz",
                                                f"ckpt-{2 * steps:09d}.npz"]
    resumed = run_command(train_cmd(3, run, *parallax, *args, *ckpt, "--resume"),
                          timeout=180).check()
    assert f"step {2 * steps}, epoch 3" in resumed.output, resumed.output
    assert_bitwise_equal(model_arrays(run / "model.npz"), model_arrays(px / "model.npz"))
    counts = ("ps_pushed", "ps_applied", "ps_updates", "test_loss")
    assert {k: _metrics(run)[-1][k] for k in counts} == {k: mp[-1][k] for k in counts}


def test_cli_refusals_are_one_line(tmp_path):
    fast = ["--dataset", "synthetic", "--limit-train", "64", "--limit-test", "32",
            "--epochs", "1"]
    # one process: no servers to be had
    assert_one_line_error(run_command(train_cmd(None, tmp_path, "--sparse-sync", "ps", *fast),
                                      timeout=60),
                          "--sparse-sync ps needs server ranks and trainer ranks: run under "
                          "mpiexec -n 2 or more")
    # a model without row-sparse parameters (checked on every rank before training)
    assert_one_line_error(run_command(train_cmd(3, tmp_path, "--sparse-sync", "ps", *fast),
                                      timeout=60),
                          "the model has no parameter with row-sparse gradients",
                          "--ps-params PATTERNS")
    # checkpoints between epochs only, as with --strategy ps
    assert_one_line_error(run_command(train_cmd(3, tmp_path, "--sparse-sync", "ps",
                                                "--checkpoint-every", "2",
                                                *gpt_args(tmp_path, "--epochs", "1")),
                                      timeout=60),
                          "--checkpoint-every is not supported with --strategy allreduce "
                          "--sparse-sync ps")


def _comm(rank, size):
    """What a preset reads from the world at build time (it does not communicate)."""
    return SimpleNamespace(rank=rank, size=size)


@pytest.mark.parametrize("strategy, options, message", [
    ("ps", {}, "not --strategy ps: --strategy ps already keeps every parameter on the servers"),
    ("hogwild", {}, "not --strategy hogwild; drop one of them"),
    ("allreduce", {"zero": 1}, "cannot be used with --zero 1"),
    ("allreduce", {"tensor_parallel": 2}, "cannot be used with --tensor-parallel 2"),
    ("allreduce", {"pipeline_stages": 3}, "cannot be used with --pipeline-stages 3"),
    ("allreduce", {"compression": "topk", "ratio": 0.1}, "cannot be used with --compression"),
    ("allreduce", {"sync": "local-sgd", "period": 4}, "cannot be used with --sync local-sgd"),
    ("allreduce", {"precision": "bf16"}, "cannot be used with --precision bf16"),
    ("allreduce", {"hybrid": "conv-dp-fc-mp"}, "cannot be used with --hybrid"),
    ("allreduce", {"mode": "async", "epoch_quorum": 2}, "cannot be used with --epoch-quorum"),
    ("allreduce", {"servers": 4}, "with 4 server(s) needs at least 5 ranks"),
    ("allreduce", {"mode": "backup", "wait": 4}, "first k of 3 workers"),
    ("allreduce", {"wait": 2}, "--wait applies to --mode backup or softsync"),
])
def test_what_does_not_compose_is_refused(strategy, options, message):
    from mpidl.errors import ConfigError
    from mpidl.runtime import build

    with pytest.raises(ConfigError) as e:
        build(strategy, _comm(0, 4), sparse_sync="ps", **options)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_patterns_need_parallax_and_settings_without_it_do_nothing():
    from mpidl.errors import ConfigError
    from mpidl.runtime import build

    with pytest.raises(ConfigError, match="add --sparse-sync ps, or drop --ps-params"):
        build("allreduce", _comm(0, 4), ps_params="0.weight")
    with pytest.raises(ConfigError, match="must name at least one parameter pattern"):
        build("allreduce", _comm(0, 4), sparse_sync="ps", ps_params=" , ")
    # the servers' settings serve --sparse-sync ps only: without it, refused from Python
    # and said to do nothing from the command line (strict=False)
    with pytest.raises(ConfigError, match="strategy 'allreduce' does not take option"
                       "\\(s\\) mode, servers"):
        build("allreduce", _comm(0, 4), servers=2, mode="async")
    rt = build("allreduce", _comm(0, 4), strict=False, servers=2, mode="async")
    assert rt.unused_options == ("mode", "servers") and rt.role == "trainer"
    # with it: ranks 0..S-1 serve the others
    rt = build("allreduce", _comm(1, 4), sparse_sync="ps", servers=2)
    assert rt.role == "server" and rt.server.worker_ranks == [2, 3]
    assert rt.checkpoint_at_epoch_end
    rt = build("allreduce", _comm(2, 4), sparse_sync="ps", servers=2)
    assert rt.role == "trainer" and rt.trainer_ranks == [2, 3] and rt.shard() == (0, 2)


def test_the_servers_parameters_are_chosen_from_the_model():
    from mpidl.engine.models import build_model
    from mpidl.errors import ConfigError
    from mpidl.runtime.sync.parallax import Split

    gpt = build_model("gpt-tiny", input_shape=(6,), num_classes=11, layers=1, heads=2,
                      width=8, context=6)
    auto = Split()
    auto.check(gpt)
    assert auto.remote == {"0.weight"} == auto.rows
    named = Split(["*.bias", "1.weight"])
    named.check(gpt)
    assert "1.weight" in named.remote and "0.weight" not in named.remote
    assert all(n.endswith(".bias") for n in named.remote - {"1.weight"})
    with pytest.raises(ConfigError, match="'x\\*' matches none of the model's parameters "
                       "\\(0.weight, 1.weight,"):
        Split(["x*"]).check(gpt)
    with pytest.raises(ConfigError, match="every parameter of the model on the servers"):
        Split(["*"]).check(gpt)
    mlp = build_model("mlp", hidden=(4,))
    with pytest.raises(ConfigError, match="no parameter with row-sparse gradients"):
        Split().check(mlp)


def test_flags_from_the_command_line_or_a_config_file(tmp_path):
    from mpidl import config
    from mpidl.errors import ConfigError
    from mpidl.runtime.presets import cli_options

    config.register(cli_options())
    with pytest.raises(ConfigError, match="--sparse-sync"):
        config.resolve({"sparse_sync": "gather"})
    with pytest.raises(ConfigError, match="--ps-params must name at least one"):
        config.resolve({"ps_params": ","})
    toml = tmp_path / "run.toml"
    toml.write_text('sparse_sync = "ps"\nps_params = "0.weight"\n')
    kwargs = config.strategy_kwargs(config.resolve({}, str(toml)))
    assert kwargs["sparse_sync"] == "ps" and kwargs["ps_params"] == "0.weight"
    # a checkpoint written with Parallax resumes only with it (the servers hold state)
    assert {"sparse_sync", "ps_params"} <= set(config.RESUME_KEYS)

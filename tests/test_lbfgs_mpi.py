"""Sandblaster L-BFGS (``--strategy ps --optimizer lbfgs``) on real MPI ranks.

1. The iterates do not depend on the layout: one process, 1 server + 2 workers, and 2
   servers + 3 workers with one worker 4x slower give the same metrics line for every
   iteration (loss, gradient norms, step, evaluations, and a CRC of every tensor of the
   iterate) and bitwise the same final parameters, in float64, for the logistic
   regression and the mlp on a Fashion-MNIST subset (unmarked: 2 servers + 3 workers
   with the straggler, the strongest case; the slow marker adds 1 + 2, and 3 servers
   for logreg's 2 tensors in float32).
2. Every rank runs the same number of function evaluations (each one counts its own).
   A line search that fails (RESTART), and the abnormal stop after it, end there too.
3. What the coordinator exchanges with the shards (the servers' group: its counters)
   is exactly the README's formula, O(m) scalars per tensor and iteration; each
   evaluation's portions are applied exactly once on every server.
4. L-BFGS with what it cannot serve is one line.
"""

import json
import os

import numpy as np
import pytest

from mpirun import (HERE, assert_one_line_error, fashion_available, mpiexec_cmd,
                    run_cli_cases, run_command, run_ranks)
from test_cli_errors import MPIDL

FAST = ["--no-progress", "--limit-test", "200", "--dtype", "float64"]


def train(tmp_path, name, *args, n=1):
    out = tmp_path / name
    launcher = [*mpiexec_cmd(), "-n", str(n)] if n > 1 else []
    cmd = launcher + MPIDL + ["train", "--optimizer", "lbfgs", "--out-dir", str(out), *FAST,
                              *args]
    run_command([str(c) for c in cmd], timeout=300).check()
    with np.load(out / "model.npz") as f:
        params = {k: f[k] for k in f.files if not k.startswith("__")}
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        line.pop("elapsed")
    return params, lines[:-1], lines[-1]


def tensors_per_shard(model, servers):
    """How many tensors each server holds (the sharding every rank computes)."""
    from mpidl.engine import build_model
    from mpidl.ps.sharding import shard_parameters

    layout = shard_parameters(build_model(model).named_parameters(), servers)
    return [len(names) for names in layout.names]


def exchange(records, tensors):
    """(bytes, messages) on the servers' group: every message the protocol sends between
    the coordinator and each other shard (holding T tensors), listed from the iteration
    records, as float64 values; the README's formula sums the same."""
    sizes = []
    for T in tensors[1:]:
        sizes.append(3 * T)  # the starting point's report: crc, max |g|, g.g per tensor
        for before, rec in zip(records, records[1:]):
            sizes += [1 + 2 * before["pairs"] + 1, 2 * T]  # DIRECTION; g.d, d.d
            sizes += [2, T] * rec["evaluations"]  # TRIAL; g_t.d after each evaluation
            k = rec["pairs"]
            new_pair = [1] + [3] * (k - 1) if rec["updated"] else []  # y.y; s.y_j, y.s_j, y.y_j
            sizes += [3, T * (3 + 2 * k + sum(new_pair))]  # ACCEPT; its report
            sizes += [1, 2, 2 * T] * rec["restarts"]  # RESTART; DIRECTION along -g; answer
        sizes.append(2)  # STOP
    return 8 * sum(sizes), len(sizes)


ARGS = {"logreg": ["--limit-train", "600", "--lbfgs-iterations", "6"],
        "mlp": ["--limit-train", "256", "--lbfgs-iterations", "3", "--portion-size", "64"]}
FASHION = pytest.mark.skipif(not fashion_available(),
                             reason="needs Fashion-MNIST (Debian's dataset-fashion-mnist)")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """model -> the one-process run (made once per model)."""
    runs = {}

    def get(model):
        if model not in runs:
            runs[model] = train(tmp_path_factory.mktemp(f"one-{model}"), "one",
                                "--model", model, *ARGS[model])
        return runs[model]
    return get


@FASHION
@pytest.mark.parametrize("model, servers, workers, straggler", [
    pytest.param("logreg", 1, 2, None, marks=pytest.mark.slow),
    ("logreg", 2, 3, "4:4"),
    pytest.param("mlp", 1, 2, None, marks=pytest.mark.slow),
    ("mlp", 2, 3, "4:4"),
])
def test_iterates_are_the_same_bits_on_every_layout(tmp_path, one_process, model, servers,
                                                    workers, straggler):
    one, lines, final = one_process(model)
    assert final["stop"] == "iteration limit reached"
    assert len({r["x_crc"] for r in lines}) == len(lines)  # (every iterate differs)
    extra = ["--straggler", straggler] if straggler else []
    params, their_lines, their_final = train(
        tmp_path, "ps", "--model", model, *ARGS[model], "--strategy", "ps", "--servers",
        str(servers), *extra, n=servers + workers)
    assert their_lines == lines
    assert sorted(params) == sorted(one) and all(np.array_equal(params[k], one[k])
                                                 for k in one)
    # every rank went through every evaluation
    assert len(their_final["evaluations_per_rank"]) == servers + workers
    assert set(their_final["evaluations_per_rank"].values()) == {final["evaluations"]}
    # the coordinator's exchange: the formula, to the byte and the message
    assert (their_final["coordinator_bytes"], their_final["coordinator_messages"]) == \
        exchange(lines, tensors_per_shard(model, servers))
    # each evaluation's portions applied once on every server (backup copies dropped)
    applied = their_final["ps_pushed"] - their_final["ps_dropped"]
    assert applied == servers * final["evaluations"] * final["portions"]
    assert their_final["portions_dealt"] >= final["evaluations"] * final["portions"]


@FASHION
@pytest.mark.slow
def test_more_servers_than_tensors_and_float32(tmp_path):
    """logreg's two tensors over 3 servers (one shard holds nothing but still follows
    every operation), in float32, with a straggler: the one-process bits."""
    args = ["--model", "logreg", "--limit-train", "600", "--lbfgs-iterations", "6",
            "--dtype", "float32"]
    one, lines, final = train(tmp_path, "one", *args)
    params, their_lines, their_final = train(tmp_path, "ps6", *args, "--strategy", "ps",
                                             "--servers", "3", "--straggler", "5:3", n=6)
    assert their_lines == lines and all(np.array_equal(params[k], one[k]) for k in one)
    assert set(their_final["evaluations_per_rank"].values()) == {final["evaluations"]}
    assert (their_final["coordinator_bytes"], their_final["coordinator_messages"]) == \
        exchange(lines, tensors_per_shard("logreg", 3))


@FASHION
def test_failed_line_searches_on_ranks_end_where_one_process_ends(tmp_path):
    """A line search that fails with pairs held (RESTART, then -g), then fails again
    without them (STOP, the shards back on the last accepted point): 2 servers and 3
    workers, one of them 3x slower, end with the one-process run's iterates, its final
    parameters and its evaluations on every rank (the Python API: one-evaluation line
    searches are not a flag)."""
    from ranks import lbfgs_check

    records, final, params = lbfgs_check.run()
    assert "abnormal" in final["stop"]
    out = tmp_path / "ranks"
    run_ranks(5, [os.path.join(HERE, "ranks", "lbfgs_check.py"), out, 2, "3:3"],
              timeout=180).check()
    with open(f"{out}.json") as f:
        theirs = json.load(f)
    with np.load(f"{out}.npz") as f:
        their_params = {k: f[k] for k in f.files}
    assert theirs["records"] == records
    assert theirs["final"]["stop"] == final["stop"]
    assert theirs["final"]["iterations"] == final["iterations"]
    assert set(theirs["final"]["evaluations_per_rank"].values()) == {final["evaluations"]}
    assert sorted(their_params) == sorted(params) and all(
        np.array_equal(their_params[k], params[k]) for k in params)


SLOW = pytest.mark.slow
ERRORS = [
    (2, ["--strategy", "allreduce"], "--optimizer lbfgs runs on one process (--strategy "
     "local) or on parameter servers (--strategy ps"),
    (3, ["--strategy", "ps", "--mode", "async"], "cannot be used with --mode async: every "
     "rank follows the coordinator's line-search decisions"),
    pytest.param(3, ["--strategy", "ps", "--deal", "batches"], "drop --deal batches",
                 marks=SLOW),
    pytest.param(1, ["--compression", "topk", "--ratio", "0.1"], "cannot be used with "
                 "--compression topk: its line search needs exact gradients", marks=SLOW),
    (1, ["--accumulate", "2"], "cannot be used with --accumulate 2"),
    pytest.param(1, ["--precision", "bf16", "--dtype", "float32"], "cannot be used with "
                 "--precision bf16", marks=SLOW),
    pytest.param(1, ["--weight-decay", "0.1"], "cannot be used with --weight-decay 0.1",
                 marks=SLOW),
    pytest.param(1, ["--checkpoint-dir", "ck"], "its runs keep no checkpoints yet",
                 marks=SLOW),
    pytest.param(1, ["--servers", "2"], "cannot be used with --servers 2: it has no use "
                 "with --strategy local", marks=SLOW),
    (1, ["--model", "mlp", "--dropout", "0.5"], "--optimizer lbfgs: layer 3 is Dropout"),
    (1, ["--model", "cnn"], "is BatchNorm2d, whose running statistics would depend"),
    (1, ["--lbfgs-history", "0"], "--lbfgs-history must be at least 1"),
]


def _lbfgs(out, args):
    return ["train", "--optimizer", "lbfgs", "--model", "logreg", "--dataset", "synthetic",
            "--no-progress", "--out-dir", str(out), *args]


@pytest.fixture(scope="module")
def lbfgs_refusals(tmp_path_factory):
    """``launch(n, args)``: that ERRORS case's Launch. The first case asked for on ``n``
    ranks runs every case of ``n`` ranks through ``mpidl``'s main, one after another in
    one launch (``mpirun.run_cli_cases``): each is refused before training starts."""
    tmp = tmp_path_factory.mktemp("lbfgs-refusals")
    cases = [e.values if isinstance(e, type(pytest.param())) else e for e in ERRORS]
    done = {}

    def launch(n, args):
        if n not in done:
            mine = [a for m, a, _ in cases if m == n]
            got = run_cli_cases([_lbfgs(tmp / "out", a) for a in mine], n=n, cwd=tmp)
            done[n] = {tuple(a): g for a, g in zip(mine, got)}
        return done[n][tuple(args)]
    return launch


@pytest.mark.parametrize("n, args, needle", ERRORS)
def test_what_lbfgs_cannot_serve_is_one_line(lbfgs_refusals, n, args, needle):
    assert_one_line_error(lbfgs_refusals(n, args), needle)

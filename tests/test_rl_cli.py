"""``mpidl rl`` from the command line: help, a short run's JSON lines, a config file, bad
input (one line, status 2, no traceback, on every rank count) and an actor that dies
(its traceback, every rank ended, never a hang)."""

import json
import os
import sys

import pytest

from mpirun import mpiexec_cmd, run_command
from test_cli_errors import assert_one_line_error

pytest.importorskip("gymnasium", reason="pip install 'mpidl[rl]'")

MPIDL = [sys.executable, "-m", "mpidl.cli.main", "rl"]
SHORT = ["--no-progress", "--frames", "800", "--learn-start", "200", "--hidden", "16",
         "--eval-every", "0", "--final-episodes", "2", "--actor-steps", "40"]


def run(args, n=None, timeout=120, env=None):
    cmd = ([*mpiexec_cmd(), "-n", str(n)] if n else []) + MPIDL + [str(a) for a in args]
    return run_command(cmd, timeout=timeout, env=env)


def json_lines(output):
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_help_lists_the_roles_flags():
    out = run(["--help"])
    assert out.returncode == 0, out.output
    for flag in ("--algo", "--env", "--actors", "--replay-shards", "--learners", "--servers",
                 "--seed", "--frames", "--deterministic"):
        assert flag in out.output


def test_dqn_run_prints_metrics_and_takes_a_config_file(tmp_path):
    cfg = tmp_path / "rl.toml"
    cfg.write_text('algo = "dqn"\nframes = 600\nhidden = [16]\n')
    out = run(["--config", cfg, "--no-progress", "--learn-start", "200", "--eval-every",
               "300", "--eval-episodes", "2", "--final-episodes", "2"])
    assert out.returncode == 0, out.output
    lines = json_lines(out.output)
    assert [r["frames"] for r in lines] == [300, 600, 600]
    assert lines[-1]["final"] and lines[-1]["updates"] == int(0.25 * 400)
    assert "final_eval_100" in lines[-1] and "mean_return_100" in lines[-1]


def test_apex_on_four_ranks_reports_from_the_learner():
    out = run(["--algo", "apex"] + SHORT, n=4)
    assert out.returncode == 0, out.output
    final = json_lines(out.output)[-1]
    assert final["final"] and final["frames"] == 800 and final["inserted"] > 0
    assert "learners [0] | shards [1] | actors [2, 3]" in out.output


def test_unknown_environment():
    assert_one_line_error(run(["--env", "NoSuchEnv-v0"] + SHORT), "--env NoSuchEnv-v0",
                          "unknown environment", "CartPole-v1")


def test_observation_shape_the_network_cannot_take():
    assert_one_line_error(run(["--network", "conv"] + SHORT), "--network conv",
                          "shape (4,)", "--network mlp")


def test_discrete_observations():
    assert_one_line_error(run(["--env", "FrozenLake-v1"] + SHORT), "Box", "Discrete(16)")


def test_more_replay_shards_than_ranks():
    line = assert_one_line_error(run(["--algo", "apex", "--replay-shards", "4"] + SHORT, n=3),
                                 "--replay-shards 4", "3 ranks", "mpiexec -n 6")
    assert line.count("mpidl: error") == 1


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "rl.toml"
    cfg.write_text("epsilon = 0.1\n")
    assert_one_line_error(run(["--config", cfg] + SHORT), "unknown key 'epsilon'", "valid keys")


# (an actor's exception ends the job through the same path under either algorithm: its
# rank prints the traceback and aborts the job; Gorila's run is slow)
@pytest.mark.parametrize("algo", ["apex", pytest.param("gorila", marks=pytest.mark.slow)])
def test_an_actor_that_dies_ends_the_job_with_its_traceback(algo):
    out = run(["--algo", algo] + SHORT, n=4, timeout=90, env={"MPIDL_FAIL_AT": "3:2"})
    assert not out.timed_out, out.output
    assert out.returncode != 0, out.output
    assert "[rank 3] Traceback" in out.output
    assert "InjectedFailure: actor rank 3: failure injected before round 2" in out.output


@pytest.mark.slow  # (a benchmark script's run, like tests/test_bench_scripts.py's)
def test_bench_script_writes_curves_and_plot(tmp_path):
    import subprocess

    from mpirun import HERE, mpi_env

    root = os.path.dirname(HERE)
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "rl.py"), "learn",
                           "--runs", "dqn", "--frames", "600", "--out-dir", tmp_path,
                           "--extra", "--learn-start 200 --hidden 16 --eval-every 300 "
                           "--eval-episodes 2 --final-episodes 2"],
                          capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "rl_cartpole.json").read_text())
    run = out["runs"][0]
    assert [e["frames"] for e in run["evals"]] == [300, 600]
    assert run["final"]["final"] and run["command"].startswith("mpidl rl --algo dqn")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "rl_cartpole.png").stat().st_size > 1000


# -- learning CartPole to 475 (minutes; run with -m slow)

@pytest.mark.slow
@pytest.mark.parametrize("algo, ranks", [("dqn", None), ("apex", 4)])
def test_cartpole_reaches_475(algo, ranks):
    """Budget: 100 k environment frames; the result is the 100-episode greedy evaluation
    of the best-evaluated parameters (the final parameters' is printed too)."""
    out = run(["--algo", algo, "--frames", "100000", "--no-progress"], n=ranks, timeout=3600)
    assert out.returncode == 0, out.output
    final = json_lines(out.output)[-1]
    assert final["best_eval_100"] >= 475, out.output


def test_minatar_with_the_conv_network():
    pytest.importorskip("minatar", reason="pip install 'mpidl[rl]'")
    out = run(["--env", "MinAtar/Breakout-v1", "--network", "conv", "--frames", "300",
               "--learn-start", "200", "--batch-size", "8", "--eval-every", "0",
               "--final-episodes", "1", "--no-progress"])
    assert out.returncode == 0, out.output
    assert "obs (10, 10, 4), 3 actions" in out.output
    assert json_lines(out.output)[-1]["updates"] == 25

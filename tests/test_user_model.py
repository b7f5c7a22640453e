"""Your own model: ``mpidl train --model FILE.py:FUNC`` and the README's Python API.

The model file here is not one of the built-ins (LayerNorm and Tanh, which no built-in
uses); it trains on one and on two ranks, is saved and loads again with ``--init``, and
every mistake in the spec is one line and exit 2.
"""

import json
import os
import re
import sys

import pytest

from mpirun import fashion_available, mpiexec_cmd, run_cli_cases, run_command, run_ranks

MODEL_FILE = '''
from mpidl.engine import Flatten, LayerNorm, Linear, Sequential, Tanh


def tanh_net(input_shape, num_classes, rng, dtype):
    n = 1
    for d in input_shape:
        n *= d
    return Sequential(Flatten(), Linear(n, 48, rng=rng, dtype=dtype),
                      LayerNorm(48, dtype=dtype), Tanh(),
                      Linear(48, num_classes, rng=rng, dtype=dtype))


def not_a_model(input_shape, num_classes, rng, dtype):
    return [input_shape, num_classes]


HIDDEN = 48
'''


def _mpidl():
    return os.path.join(os.path.dirname(sys.executable), "mpidl")


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def _train(args, n=1, cwd=None):
    cmd = ([*mpiexec_cmd(), "-n", str(n)] if n > 1 else []) + [_mpidl(), "train"] + args
    return run_command(cmd, timeout=120, cwd=cwd)


def _records(output):
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("n", [1, 2])
def test_a_model_of_your_own_trains_saves_and_reloads(tmp_path, model_file, n):
    common = ["--dataset", "synthetic", "--epochs", "2", "--batch-size", "32",
              "--limit-train", "256", "--limit-test", "64", "--no-progress", "--lr", "0.1"]
    out = tmp_path / "run"
    launch = _train(["--model", f"{model_file}:tanh_net", "--out-dir", str(out)] + common,
                    n=n).check()
    records = _records(launch.output)
    assert [r["epoch"] for r in records] == [1, 2]
    assert records[-1]["train_loss"] < records[0]["train_loss"], records
    import numpy as np

    with np.load(out / "model.npz") as f:
        assert f["2.weight"].shape == (48,)           # the LayerNorm of the user's model
        meta = json.loads(bytes(f["__meta__"]).decode())
    assert meta["model"] == f"{model_file}:tanh_net"
    again = _train(["--init", str(out / "model.npz"), "--epochs", "1", "--out-dir",
                    str(tmp_path / "again")] + common[2:], n=1).check()
    assert _records(again.output)


SPEC_MISTAKES = [
    ("{file}:nope", r"defines no 'nope' \(it defines not_a_model, tanh_net\)"),
    ("{file}:not_a_model", "returned list, not an mpidl Layer"),
    ("{file}:HIDDEN", "'HIDDEN' is not a function"),
    ("{dir}/missing.py:f", "no such file"),
    ("{file}:9bad", "expected FILE.py:FUNC"),
    ("{dir}/broken.py:f", "importing .*broken.py failed: SyntaxError"),
]


@pytest.fixture(scope="module")
def spec_mistakes(tmp_path_factory):
    """Every mistake's (launch, spec) in one process (``mpirun.run_cli_cases``), but the
    first, which runs as an ``mpidl`` process of its own."""
    tmp = tmp_path_factory.mktemp("specs")
    model = tmp / "my_model.py"
    model.write_text(MODEL_FILE)
    (tmp / "broken.py").write_text("def f(:\n")
    specs = [spec.format(file=model, dir=tmp) for spec, _ in SPEC_MISTAKES]
    args = [["--model", spec, "--dataset", "synthetic", "--epochs", "1"] for spec in specs]
    launches = [_train(args[0])] + run_cli_cases([["train", *a] for a in args[1:]])
    return list(zip(launches, specs))


@pytest.mark.parametrize("case", range(len(SPEC_MISTAKES)),
                         ids=[m.split(":")[-1] for m, _ in SPEC_MISTAKES])
def test_mistakes_in_the_model_spec_are_one_line(spec_mistakes, case):
    launch, spec = spec_mistakes[case]
    message = SPEC_MISTAKES[case][1]
    assert launch.returncode == 2, (spec, launch.output)
    lines = [ln for ln in launch.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mpidl: error:"), launch.output
    assert re.search(message, lines[0]), lines[0]


def readme_example():
    """The fenced Python block after the README's python-api-example marker."""
    readme = os.path.join(os.path.dirname(HERE_TESTS), "README.md")
    text = open(readme, encoding="utf-8").read()
    after = text.split("<!-- python-api-example", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


HERE_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(not fashion_available(), reason="needs Fashion-MNIST "
                    "(apt-get install dataset-fashion-mnist)")
def test_the_readme_python_api_example_runs_on_two_ranks(tmp_path):
    code = readme_example()
    assert "class Gate(Layer)" in code and "Trainer(" in code  # the block we mean
    script = tmp_path / "train_mine.py"
    script.write_text(code)
    launch = run_ranks(2, [script], timeout=180, cwd=tmp_path).check()
    records = _records(launch.output)
    assert [r["epoch"] for r in records] == [1, 2], launch.output
    assert records[-1]["ranks"] == 2 and records[-1]["test_acc"] > 0.7


OWN_LOOP = '''
import sys
import numpy as np
from mpi4py import MPI
from mpidl.comm import Communicator
from mpidl.engine import SGD, Linear, ReLU, Sequential, SoftmaxCrossEntropy
from mpidl.runtime.distributed import DistributedOptimizer

B, STEPS = 8, 5
def make(seed):
    rng = np.random.default_rng(seed)
    return Sequential(Linear(6, 16, rng=rng, dtype="float64"), ReLU(),
                      Linear(16, 3, rng=rng, dtype="float64"))
data = np.random.default_rng(9)
x = data.standard_normal((STEPS, 2 * B, 6)); y = data.integers(0, 3, (STEPS, 2 * B))
loss = SoftmaxCrossEntropy()
r = MPI.COMM_WORLD.rank
model = make(1 if r == 0 else 50)          # rank 1's own weights are replaced by rank 0's
opt = DistributedOptimizer(SGD(model.named_parameters(), lr=0.1, momentum=0.9), model,
                           Communicator(), algorithm="ring")
for s in range(STEPS):
    opt.zero_grad()
    loss.forward(model(x[s][r * B:(r + 1) * B]), y[s][r * B:(r + 1) * B])
    model.backprop(loss.backward())
    opt.step()
ref = make(1)
ropt = SGD(ref.named_parameters(), lr=0.1, momentum=0.9)
for s in range(STEPS):
    ropt.zero_grad()
    loss.forward(ref(x[s]), y[s])
    ref.backprop(loss.backward())
    ropt.step()
worst = max(float(np.max(np.abs(p.data - q.data)) / np.max(np.abs(q.data)))
            for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()))
assert worst <= 1e-13, worst
print(f"rank {r} OWN LOOP OK {worst:.1e}", flush=True)
'''


@pytest.mark.mpi_matrix_extra
def test_distributed_optimizer_in_your_own_loop_equals_one_process(tmp_path):
    """Horovod's pattern: 2 ranks with batch b and the wrapped optimizer end where one
    process with batch 2b ends (float64, relative 1e-13)."""
    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP)
    launch = run_ranks(2, [script], timeout=120).check()
    assert launch.output.count("OWN LOOP OK") == 2, launch.output

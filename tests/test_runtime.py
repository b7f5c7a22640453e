"""The runtime's structure: presets are compositions of parts, each part declares its own
settings, the configuration imports nothing above it, and the step's pieces compose.

Multi-rank equivalence of the compositions is in test_data_parallel.py (all-reduce),
test_parameter_server_mpi.py (push/pull) and test_accumulate.py (micro-batches, SyncBN).
"""

import ast
import os

import numpy as np
import pytest

from mpidl.errors import ConfigError
from mpidl.runtime import averaging, build, cli_options, presets
from mpidl.runtime import dealing as dealing_part
from mpidl.runtime import hybrid as hybrid_part
from mpidl.runtime import precision as precision_part
from mpidl.runtime import schedule as schedule_part
from mpidl.runtime import tensor_parallel as tp_part
from mpidl.runtime import pipeline as pipeline_part
from mpidl.runtime import zero as zero_part
from mpidl.runtime.placement import OnServers, Replicated
from mpidl.runtime.sync import (FusedAllreduce, GradSync, PerTensorCompressed, PushPull,
                                RowSparseAllgather, compressed, fused, groups, parallax,
                                pushpull, rowsparse)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def kinds(runtime):
    return [type(s) for _, s in runtime.syncs]


def test_presets_are_compositions_of_parts():
    local = build("local")
    assert kinds(local) == [GradSync] and local.placement_cls is Replicated
    dp = build("allreduce", FakeComm(0, 2))
    assert kinds(dp) == [FusedAllreduce, RowSparseAllgather]
    assert kinds(build("allreduce", FakeComm(0, 2), compression="topk")) == \
        [PerTensorCompressed]
    fp16 = build("allreduce", FakeComm(0, 2), compression="fp16")  # element-wise: a bucket hook
    assert kinds(fp16) == [FusedAllreduce]
    assert isinstance(fp16.syncs[0][1].hook, compressed.BucketHook)
    assert kinds(build("allreduce", FakeComm(0, 2), sparse_grads="dense")) == [FusedAllreduce]
    worker = build("ps", FakeComm(1, 3))
    assert kinds(worker) == [PushPull] and worker.placement_cls is OnServers
    server = build("ps", FakeComm(0, 3))
    assert kinds(server) == [] and server.role == "server" and not server.trains_on_data
    assert build("allreduce", FakeComm(0, 2), accumulate=4).schedule.k == 4
    zero = build("allreduce", FakeComm(0, 2), zero=2)  # ZeRO: its own sync and placement
    assert kinds(zero) == [zero_part.ZeroSync] and zero.placement_cls.func is zero_part.Sharded


def test_each_preset_takes_exactly_its_parts_options():
    def names(opts):
        return {o.name for o in opts}
    common = names(schedule_part.OPTIONS) | names(precision_part.OPTIONS)
    tp = names(tp_part.OPTIONS) | names(pipeline_part.OPTIONS)  # the model-parallel layouts
    assert presets.PRESETS["local"][1] == common | {"cuda_graph"} | tp
    assert presets.PRESETS["allreduce"][1] == (common | tp | names(hybrid_part.OPTIONS)
                                               | names(fused.OPTIONS)
                                               | names(rowsparse.OPTIONS)
                                               | names(compressed.OPTIONS) | {"sync_bn"}
                                               | names(averaging.OPTIONS)
                                               | set(presets.AVERAGING_CHECK)
                                               | names(zero_part.OPTIONS)
                                               | set(presets.BENCH_TUNING)
                                               # --sparse-sync ps: Parallax's servers
                                               | names(parallax.OPTIONS)
                                               | names(pushpull.OPTIONS))
    # (worker groups: --group-size, and the fused all-reduce's settings inside a group;
    # --deal portions)
    assert presets.PRESETS["ps"][1] == (common | names(pushpull.OPTIONS)
                                        | names(compressed.OPTIONS) | set(presets.PS_TUNING)
                                        | names(groups.OPTIONS) | names(fused.OPTIONS)
                                        | names(dealing_part.OPTIONS)
                                        | set(presets.BENCH_TUNING))
    # every flag is declared once, by one part
    declared = [o.name for o in cli_options()]
    assert len(declared) == len(set(declared))
    with pytest.raises(ConfigError, match="strategy 'local' does not take option"):
        build("local", algorithm="ring")
    rt = build("local", strict=False, algorithm="ring", mode="async")
    assert rt.unused_options == ("algorithm", "mode")


def test_bad_values_are_caught_by_the_part_that_owns_them():
    with pytest.raises(ConfigError, match="--accumulate"):
        build("local", accumulate=0)
    with pytest.raises(ConfigError, match="--straggler"):
        build("allreduce", FakeComm(0, 2), straggler="5:2")
    with pytest.raises(ConfigError, match="--ratio is a compression setting"):
        build("allreduce", FakeComm(0, 2), ratio=0.1)
    with pytest.raises(ConfigError, match="trains on one process"):
        build("local", FakeComm(0, 2))


def _imports(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_config_imports_nothing_above_it():
    """The configuration sits at the bottom of the front end: the parts' settings are
    registered into it by the command line, never imported by it."""
    imported = _imports(os.path.join(ROOT, "mpidl", "config.py"))
    above = {m for m in imported if m.startswith(("mpidl.runtime", "mpidl.strategies",
                                                  "mpidl.training", "mpidl.cli",
                                                  "mpidl.ps", "mpidl.comm"))}
    assert not above, above
    assert not os.path.exists(os.path.join(ROOT, "mpidl", "strategies"))


def test_runtime_parts_import_nothing_from_the_front_end():
    """The runtime (parts, presets) is below the trainer and the command line."""
    runtime = os.path.join(ROOT, "mpidl", "runtime")
    for folder, _, files in os.walk(runtime):
        for f in files:
            if f.endswith(".py"):
                imported = _imports(os.path.join(folder, f))
                bad = {m for m in imported if m.startswith(("mpidl.cli", "mpidl.config"))}
                assert not bad, (f, bad)


def test_a_new_sync_part_composes_without_touching_the_others():
    """A sync of one's own (here: gradients scaled by 2 before a plain local update)
    plugs into a Runtime beside the built-in parts."""
    from mpidl.engine import SGD, Linear, Sequential, SoftmaxCrossEntropy
    from mpidl.runtime import Runtime
    from mpidl.runtime.schedule import MicroBatches

    class Doubling(GradSync):
        name = "doubling"

        def finish(self):
            for p in self.params.values():
                p.grad = p.grad * 2
            yield self.names

    def run(sync, lr):
        model = Sequential(Linear(4, 3, rng=np.random.default_rng(0), dtype="float64"))
        rt = Runtime(None, "mine", MicroBatches(1), [(lambda n: True, sync)], Replicated)
        rt.setup(model, SGD(model.named_parameters(), lr=lr), SoftmaxCrossEntropy())
        x = np.random.default_rng(1).standard_normal((8, 4))
        rt.train_step(x, np.arange(8) % 3)
        return model.named_parameters()[0][1].data

    np.testing.assert_array_equal(run(Doubling(), 0.05), run(GradSync(), 0.1))


def test_every_mpidl_variable_is_read_in_one_place():
    """Library code reads MPIDL_* variables through mpidl.env only, and every one it
    names is in env.VARIABLES (the table `mpidl.env` documents)."""
    import re

    from mpidl import env

    reads = re.compile(r"(environ\.get\(\s*[\"']MPIDL_|getenv\(\s*[\"']MPIDL_|"
                       r"environ\[[\"']MPIDL_[A-Z_]+[\"']\](?!\s*=))")
    named = set()
    for top in ("mpidl", "kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py") or f == "env.py" and top == "mpidl":
                    continue
                text = open(os.path.join(folder, f), encoding="utf-8").read()
                assert not reads.search(text), f"{folder}/{f} reads an MPIDL_ variable itself"
                named.update(re.findall(r"\bMPIDL_[A-Z][A-Z_]+\b", text))
    assert named <= set(env.VARIABLES), named - set(env.VARIABLES)

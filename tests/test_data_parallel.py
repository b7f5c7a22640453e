"""The all-reduce data-parallel strategy: fusion layout, options, and N-rank equivalence.

The multi-rank part launches ``tests/ranks/dp_equivalence.py`` once per N in {1, 2, 3, 4};
one launch runs every case for that N (5 algorithms x overlap on/off x 2 bucket sizes,
plus an Embedding model with row-sparse gradients) against a one-process reference with
batch N*b, within 1e-12 in float64 (see that script).
"""

import json
import os

import numpy as np
import pytest

from mpirun import run_ranks
from mpidl.engine import SGD, Linear, ReLU, Sequential, SoftmaxCrossEntropy
from mpidl.errors import ConfigError
from mpidl.runtime import build, canonical
from mpidl.runtime.fusion import FusionBuffers, plan
from mpidl.runtime.sync import FusedAllreduce
from mpidl.runtime.sync import fused as dp

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "ranks")


def mlp(seed=0, dtype="float32", sizes=(6, 8, 8, 3)):
    rng = np.random.default_rng(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [Linear(a, b, rng=rng, dtype=dtype), ReLU()]
    return Sequential(*layers[:-1])


# -- fusion layout -----------------------------------------------------------------------------

def test_plan_reverse_order_and_size_bound():
    model = mlp(sizes=(6, 8, 8, 3))  # 0.weight 48, 0.bias 8, 2.weight 64, 2.bias 8, 4.* 24+3
    named = model.named_parameters()
    groups = plan(named, bucket_bytes=80 * 4)
    flat = [n for g in groups for n, _ in g]
    assert flat == [n for n, _ in reversed(named)]  # backward's order
    for g in groups:
        nbytes = sum(p.data.nbytes for _, p in g)
        assert nbytes <= 320 or len(g) == 1
    assert [[n for n, _ in g] for g in groups] == [
        ["4.bias", "4.weight", "2.bias"], ["2.weight", "0.bias"], ["0.weight"]]


def test_plan_oversized_parameter_gets_own_bucket_and_dtypes_split():
    rng = np.random.default_rng(0)
    model = Sequential(Linear(4, 4, rng=rng, dtype="float64"), Linear(4, 4, rng=rng))
    groups = plan(model.named_parameters(), bucket_bytes=8)
    assert all(len(g) == 1 for g in groups)
    groups = plan(model.named_parameters(), bucket_bytes=1 << 20)
    assert [[n for n, _ in g] for g in groups] == [["1.bias", "1.weight"],
                                                   ["0.bias", "0.weight"]]
    assert {g[0][1].data.dtype for g in groups} == {np.dtype("float32"), np.dtype("float64")}


def test_fusion_views_pack_unpack_without_allocation():
    model = mlp()
    f = FusionBuffers(model.named_parameters(), bucket_bytes=64 * 4)
    buffers = [b.buffer for b in f.buckets]
    x = np.random.default_rng(1).standard_normal((5, 6)).astype("float32")
    loss = SoftmaxCrossEntropy()
    for step in range(2):
        f.begin_step()
        loss.forward(model.forward(x), np.arange(5) % 3)
        model.backward(loss.backward())
        grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        for name in grads:
            f.pack(name)
        assert [b.index for b in f.ready()] == list(range(len(f)))
        for b in f.buckets:
            f.unpack(b)
        for n, p in model.named_parameters():
            np.testing.assert_array_equal(p.grad, grads[n])
            bucket = f.slot[n][0]
            assert np.shares_memory(p.grad, bucket.buffer)  # no copy out
        assert [b.buffer for b in f.buckets] == buffers  # the same arrays every step


def test_buckets_launch_in_index_order_whatever_the_completion_order():
    model = mlp()
    f = FusionBuffers(model.named_parameters(), bucket_bytes=1)  # one tensor per bucket
    for _, p in model.named_parameters():
        p.grad = np.ones_like(p.data)
    f.begin_step()
    names = [b.names[0] for b in f.buckets]
    assert f.pack(names[2]) and f.ready() == []        # bucket 2 complete, 0 is not
    assert f.pack(names[0]) and [b.index for b in f.ready()] == [0]
    assert f.pack(names[1]) and [b.index for b in f.ready()] == [1, 2]
    f.pack_rest()
    assert [b.index for b in f.ready()] == list(range(3, len(f)))


def test_missing_gradient_packs_zeros():
    model = mlp()
    f = FusionBuffers(model.named_parameters(), bucket_bytes=1 << 20)
    f.buckets[0].buffer.fill(7)
    f.begin_step()
    f.pack_rest()  # no backward ran: every grad is None
    assert not f.buckets[0].buffer.any()


def fused_sync(runtime):
    """The fused all-reduce part of an allreduce runtime."""
    return next(s for _, s in runtime.syncs if isinstance(s, FusedAllreduce))


# -- the preset in one process ------------------------------------------------------------------

def test_registry_and_options():
    assert canonical("allreduce") == canonical("data_parallel") == canonical("dp")
    with pytest.raises(ConfigError, match="strategy 'butterflies' is not available"):
        build("butterflies", None)
    with pytest.raises(ConfigError, match="algorithm"):
        build("allreduce", None, algorithm="butterfly")
    with pytest.raises(ConfigError, match="bucket"):
        build("allreduce", None, bucket_mb=0)
    with pytest.raises(ConfigError, match="does not take"):
        build("allreduce", None, servers=2)


def test_without_communicator_matches_local_training():
    x = np.random.default_rng(2).standard_normal((4, 8, 6))
    y = np.random.default_rng(3).integers(0, 3, (4, 8))
    results = []
    for name in ("local", "allreduce"):
        model = mlp(seed=5, dtype="float64")
        opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9)
        s = build(name, None)
        s.setup(model, opt, SoftmaxCrossEntropy())
        for i in range(4):
            s.train_step(x[i], y[i])
        results.append({n: p.data.copy() for n, p in model.named_parameters()})
    for n in results[0]:
        np.testing.assert_array_equal(results[0][n], results[1][n])


# -- N ranks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, pytest.param(3, marks=pytest.mark.mpi_matrix), 4])
def test_n_ranks_equal_one_rank_with_n_times_the_batch(n):
    launch = run_ranks(n, [os.path.join(RANKS, "dp_equivalence.py")], timeout=60).check()
    assert f"[N={n}] ALL OK" in launch.output, launch.output


# -- overlap="auto" ------------------------------------------------------------------------------

class _Comm:
    """Enough of a Communicator for overlap_pays (no ``mpi``: no agreement step)."""

    def __init__(self, size, local_size):
        self.size, self.local_size, self.rank = size, local_size, 0


def test_overlap_auto_wants_a_spare_core_per_rank(monkeypatch):
    named = mlp().named_parameters()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(dp.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(dp.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    ok, why = dp.overlap_pays(_Comm(2, 2), named)
    assert not ok and "no spare core" in why             # 2 ranks on 2 CPUs
    monkeypatch.setattr(dp.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(dp.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert dp.overlap_pays(_Comm(2, 2), named)[0]        # 2 ranks on 8 CPUs
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert not dp.overlap_pays(_Comm(2, 2), named)[0]    # ... each with 4 BLAS threads
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(dp.os, "sched_getaffinity", lambda pid: {2, 3}, raising=False)
    assert dp.overlap_pays(_Comm(4, 4), named)[0]        # bound to 2 CPUs of its own
    monkeypatch.setattr(dp.os, "sched_getaffinity", lambda pid: {2}, raising=False)
    assert not dp.overlap_pays(_Comm(8, 8), named)[0]    # bound to 1 CPU
    assert not dp.overlap_pays(_Comm(1, 1), named)[0]    # one rank


def test_overlap_option_values():
    assert fused_sync(build("allreduce", None)).overlap_mode == "auto"
    assert fused_sync(build("allreduce", None, overlap=True)).overlap_mode == "on"
    assert fused_sync(build("allreduce", None, overlap=False)).overlap_mode == "off"
    assert fused_sync(build("allreduce", None, overlap="on")).overlap_mode == "on"
    assert fused_sync(build("allreduce", None, overlap="off")).overlap_mode == "off"
    with pytest.raises(ConfigError, match="overlap"):
        build("allreduce", None, overlap="sometimes")


DROPOUT_MASKS = """
import json, sys
import numpy as np
from mpi4py import MPI
from mpidl.comm import Communicator
from mpidl.engine import SGD, Dropout, Linear, Sequential, SoftmaxCrossEntropy
from mpidl.runtime import build

model = Sequential(Linear(4, 64, rng=np.random.default_rng(0)), Dropout(0.5, seed=3))
strategy = build(sys.argv[2], Communicator(MPI.COMM_WORLD))
strategy.setup(model, SGD(model.named_parameters(), lr=0.1), SoftmaxCrossEntropy())
if strategy.trains_on_data:
    mask = (model.forward(np.ones((8, 4), np.float32)) != 0).tolist()
else:
    mask = None
masks = MPI.COMM_WORLD.gather(mask)
if MPI.COMM_WORLD.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump([m for m in masks if m is not None], f)
"""


@pytest.mark.parametrize("strategy, ranks", [("allreduce", 2), ("ps", 3)])
def test_each_rank_draws_its_own_dropout_masks(tmp_path, strategy, ranks):
    """Replicas are built from one seed; their dropout masks must still differ by rank,
    else every rank drops the same units and dropout regularizes less."""
    script = tmp_path / "masks.py"
    script.write_text(DROPOUT_MASKS)
    masks = []
    for run in range(2):
        out = tmp_path / f"masks{run}.json"
        run_ranks(ranks, [script, out, strategy], timeout=60).check()
        masks.append(json.loads(out.read_text()))
    assert len(masks[0]) == 2
    assert masks[0][0] != masks[0][1]  # two training ranks, two masks
    assert masks[0] == masks[1]  # and the same ones again in the same set-up

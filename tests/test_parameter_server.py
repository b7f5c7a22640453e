"""Parameter server, in one process: sharding, option checks, what a bad push is told.

The multi-rank behaviour (equivalence with data parallelism, SSP's bound, accounting,
clean ends) is in test_parameter_server_mpi.py.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.comm import Communicator
from mpidl.engine.module import Parameter, SparseGrad
from mpidl.errors import ConfigError
from mpidl.ps.modes import ModeConfig
from mpidl.ps.protocol import PSError
from mpidl.ps.server import ParameterServer, _mean
from mpidl.ps.sharding import shard_parameters
from mpidl.runtime import build
from mpidl.runtime.schedule import MicroBatches, Transient, parse_straggler
from mpidl.runtime.sync.pushpull import mode_config, summarize


def _params(*shapes, dtype=np.float32):
    return [(f"{i}.w", Parameter(np.zeros(s, dtype))) for i, s in enumerate(shapes)]


# -- sharding

def test_sharding_is_greedy_largest_first_and_deterministic():
    named = _params((10, 10), (50,), (30, 30), (5,), (20, 20), (1,))
    layout = shard_parameters(named, 2)
    # bytes: 400, 200, 3600, 20, 1600, 4 -> 3600 | 1600, 400, 200, 20, 4
    assert layout.names == (("2.w",), ("0.w", "1.w", "3.w", "4.w", "5.w"))
    assert layout.nbytes == (3600, 2224)
    assert shard_parameters(named, 2) == layout  # same input, same answer
    assert layout.server_of("4.w") == 1
    # every tensor exactly once, in the model's order within a server
    flat = [n for names in layout.names for n in names]
    assert sorted(flat) == sorted(n for n, _ in named)


def test_sharding_balance_bound_and_more_servers_than_tensors():
    rng = np.random.default_rng(0)
    shapes = [(int(rng.integers(1, 200)),) for _ in range(40)]
    named = _params(*shapes)
    for s in (1, 2, 3, 5):
        layout = shard_parameters(named, s)
        total, largest = sum(layout.nbytes), max(4 * n for (n,) in shapes)
        assert max(layout.nbytes) <= total / s + largest  # Graham's bound
    layout = shard_parameters(_params((3,), (2,)), 4)
    assert layout.names == (("0.w",), ("1.w",), (), ())
    with pytest.raises(ValueError):
        shard_parameters(named, 0)


# -- options

def test_mode_config_checks():
    assert ModeConfig("backup").check(4).quorum(4) == 3  # default: all but one
    assert ModeConfig("backup", wait=2).check(4).quorum(4) == 2
    assert ModeConfig("sync").check(3).quorum(3) == 3
    with pytest.raises(ConfigError, match="unknown parameter-server mode 'bogus'"):
        ModeConfig("bogus").check(2)
    with pytest.raises(ConfigError, match="--wait 5"):
        ModeConfig("backup", wait=5).check(3)
    with pytest.raises(ConfigError, match="--staleness must be >= 0"):
        ModeConfig("ssp", staleness=-1).check(3)
    with pytest.raises(ConfigError, match="async or ssp only"):
        ModeConfig("sync", staleness_aware_lr=True).check(3)
    assert ModeConfig("softsync").check(3).quorum(3) == 3  # default: 1-softsync
    assert ModeConfig("softsync", wait=1).check(3).quorum(3) == 1
    with pytest.raises(ConfigError, match=r"--wait 4: softsync .* 1 <= c <= 3"):
        ModeConfig("softsync", wait=4).check(3)
    with pytest.raises(ConfigError, match="async or ssp only"):
        ModeConfig("softsync", staleness_aware_lr=True).check(3)  # softsync weighs already
    with pytest.raises(ConfigError, match="--wait applies to --mode backup or softsync"):
        mode_config(3, "sync", wait=2)
    with pytest.raises(ConfigError, match=r"--staleness applies to --mode ssp \(got --mode "
                       r"async\)"):
        mode_config(3, "async", staleness=1)
    assert mode_config(3, "ssp", staleness=0).staleness == 0
    assert ModeConfig("async", epoch_quorum=2).check(3).epoch_quorum == 2
    with pytest.raises(ConfigError, match="--epoch-quorum applies to --mode async, ssp or "
                       "backup"):
        ModeConfig("sync", epoch_quorum=2).check(3)
    with pytest.raises(ConfigError, match=r"--epoch-quorum 4: .* 1 <= K <= 3"):
        ModeConfig("backup", epoch_quorum=4).check(3)


def test_straggler_parsing():
    assert parse_straggler("3:2") == (3, 2.0)
    assert parse_straggler("1:1.5") == (1, 1.5)
    assert parse_straggler(None) is None
    for bad in ("3", "a:2", "3:x", "3:2:1"):
        with pytest.raises(ConfigError, match="RANK:FACTOR"):
            parse_straggler(bad)
    with pytest.raises(ConfigError, match=">= 1"):
        parse_straggler("2:0.5")


def test_transient_straggler_parsing():
    assert parse_straggler("transient:4:0.1") == Transient(4.0, 0.1, 0)
    assert parse_straggler("transient:2:0.5:7") == Transient(2.0, 0.5, 7)
    for bad, why in (("transient:4", "transient:FACTOR:Q"), ("transient:x:0.1", "FACTOR:Q"),
                     ("transient:4:0.1:1:2", "FACTOR:Q"), ("transient:0.5:0.1", ">= 1"),
                     ("transient:inf:0.1", ">= 1"), ("transient:4:1.5", "probability"),
                     ("transient:4:nan", "probability"), ("transient:4:0.1:-1", "SEED")):
        with pytest.raises(ConfigError, match=why):
            parse_straggler(bad)


def _slowed(transient, rank, steps=400):
    """Which of ``steps`` steps a rank's schedule slowed (a tiny model, real sleeps)."""
    from mpidl.engine.linear import Linear  # noqa: PLC0415
    from mpidl.engine.losses import SoftmaxCrossEntropy  # noqa: PLC0415
    from mpidl.engine.module import Sequential  # noqa: PLC0415

    sched = MicroBatches(1, transient=transient, rank=rank)
    model = Sequential(Linear(2, 2, rng=np.random.default_rng(0)))
    x, y = np.ones((1, 2), np.float32), np.zeros(1, np.int64)
    slowed = []
    for step in range(steps):
        before = sched.slowed_steps
        sched.run(model, SoftmaxCrossEntropy(), x, y)
        if sched.slowed_steps > before:
            slowed.append(step)
            assert sched.straggle_s > 0
        else:
            assert sched.straggle_s == 0.0
    return slowed


def test_transient_stragglers_are_seeded_per_rank():
    """Each step a rank is slowed with probability Q, from (SEED, rank): the same steps
    every run, other steps on another rank or with another seed."""
    t = Transient(1.01, 0.1, seed=3)
    first = _slowed(t, rank=1)
    assert first == _slowed(t, rank=1)
    assert first != _slowed(t, rank=2)
    assert first != _slowed(Transient(1.01, 0.1, seed=4), rank=1)
    assert 20 <= len(first) <= 65, len(first)  # 400 x 0.1 = 40 expected (binomial)
    assert _slowed(Transient(1.01, 0.0), rank=0) == []


class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_strategy_option_errors():
    with pytest.raises(ConfigError, match="needs at least 2 ranks"):
        build("ps", None)
    with pytest.raises(ConfigError, match="needs at least 4 ranks"):
        build("ps", FakeComm(0, 3), servers=3)
    with pytest.raises(ConfigError, match="rank 0 is not a worker"):
        build("ps", FakeComm(0, 3), straggler="0:2")
    with pytest.raises(ConfigError, match="does not take option"):
        build("ps", FakeComm(0, 3), bogus=1)
    with pytest.raises(ConfigError, match="--ratio is a compression setting"):
        build("ps", FakeComm(0, 3), ratio=0.1)
    with pytest.raises(ConfigError, match="--compression bogus"):
        build("ps", FakeComm(0, 3), compression="bogus")
    with pytest.raises(ConfigError, match="powersgd needs all-reduces"):
        build("ps", FakeComm(0, 3), compression="powersgd:rank=2")
    s = build("ps", FakeComm(1, 3), compression="topk:ratio=0.05")
    assert s.compressor.name == "topk" and s.compressor.memory is not None
    # from the command line, other layouts' options are accepted and reported unused
    s = build("ps", FakeComm(1, 4), strict=False, servers=2, mode="ssp", staleness=2,
              algorithm="ring")
    assert s.unused_options == ("algorithm",)
    assert (s.roles["server"], s.roles["trainer"]) == ([0, 1], [2, 3])
    assert not s.trains_on_data and not s.is_root and s.shard() == (0, 2)
    w = build("ps", FakeComm(3, 4), servers=2)
    assert w.trains_on_data and w.shard() == (1, 2) and not w.is_root
    assert build("ps", FakeComm(2, 4), servers=2).is_root


def test_summarize_sums_servers():
    a = {"pushed": 10, "applied": 7, "dropped": 3, "updates": 4, "max_lead": 2,
         "sum_staleness": 5, "pushes_by_worker": {1: 6, 2: 4}}
    b = {"pushed": 10, "applied": 8, "dropped": 2, "updates": 5, "max_lead": 1,
         "sum_staleness": 5, "pushes_by_worker": {1: 6, 2: 4}}
    s = summarize([a, b])
    assert s["ps_pushed"] == s["ps_applied"] + s["ps_dropped"] == 20
    assert s["ps_updates"] == 5 and s["ps_max_lead"] == 2 and s["ps_mean_staleness"] == 0.5
    assert s["ps_pushed_by_worker"] == {"1": 6, "2": 4}
    assert summarize(None) == {}


# -- averaging

def test_staleness_weight_and_weighted_mean():
    from mpidl.ps.modes import staleness_weight  # noqa: PLC0415

    assert [staleness_weight(t) for t in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]
    a, b = np.array([1.0, 2.0]), np.array([4.0, 8.0])
    assert _mean([a, b], 2, weights=[1.0, 0.5]).tolist() == [1.5, 3.0]
    assert _mean([a, b], 2, weights=[1.0, 1.0]).tolist() == _mean([a, b], 2).tolist()
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [4.0, 8.0]  # inputs untouched
    s = SparseGrad(np.array([1]), np.array([[2.0, 4.0]]), (3, 2))
    got = _mean([s, s], 2, weights=[1.0, 0.25])
    assert isinstance(got, SparseGrad)
    assert got.to_dense().tolist() == [[0, 0], [1.25, 2.5], [0, 0]]


def test_mean_dense_and_sparse():
    a, b = np.ones(4, np.float32), np.full(4, 3, np.float32)
    np.testing.assert_array_equal(_mean([a, b], 2), np.full(4, 2))
    np.testing.assert_array_equal(_mean([a], 3), np.full(4, 1 / 3, np.float32))
    s1 = SparseGrad(np.array([0, 2]), np.ones((2, 3)), (4, 3))
    s2 = SparseGrad(np.array([2]), np.full((1, 3), 3.0), (4, 3))
    m = _mean([s1, s2], 2)
    assert isinstance(m, SparseGrad)
    np.testing.assert_allclose(m.to_dense(), (s1.to_dense() + s2.to_dense()) / 2)
    np.testing.assert_allclose(_mean([s1, np.ones((4, 3))], 2),
                               (s1.to_dense() + 1) / 2)


# -- a bad push is named (the server alone: no peers to tell, it raises at once)

@pytest.fixture
def lone_server():
    params = [("0.weight", Parameter(np.zeros((4, 3), np.float32))),
              ("1.embed", Parameter(np.zeros((10, 2), np.float32)))]

    class NoOpt:
        lr = 0.1

        def step(self, names=None):
            pass

    comm = Communicator(MPI.COMM_SELF)
    srv = ParameterServer(comm, 0, params, NoOpt(), ModeConfig("sync").check(1),
                          workers=[7], servers=[0], abort_grace=0.1)
    srv.workers = []  # nobody to tell: the abort raises without waiting
    yield srv
    comm.close()


def _push(*tensors):
    header = {"tensors": [(name, enc, None, len(arrays)) for name, enc, arrays in tensors]}
    return header, [a for _, _, arrays in tensors for a in arrays]


@pytest.mark.parametrize("tensors, message", [
    ([("0.weight", "dense", [np.zeros((3, 4), np.float32)])],
     r"worker rank 7 pushed gradient '0.weight' with shape \(3, 4\) and dtype float32; "
     r"the parameter has shape \(4, 3\) and dtype float32"),
    ([("0.weight", "dense", [np.zeros((4, 3), np.float64)])],
     r"worker rank 7 pushed gradient '0.weight' with shape \(4, 3\) and dtype float64"),
    ([("9.nope", "dense", [np.zeros(3, np.float32)])],
     r"worker rank 7 pushed gradient '9.nope', which server 0 \(rank 0\) does not hold"),
    ([("1.embed", "sparse", [np.array([1, 12]), np.zeros((2, 2), np.float32)])],
     r"'1.embed': row index out of range \[0, 10\)"),
    ([("1.embed", "sparse", [np.array([1]), np.zeros((1, 3), np.float32)])],
     r"'1.embed' \(sparse rows\) with shape \(3,\)"),
    ([("0.weight", "compressed", [np.zeros(2, np.uint8)])],
     r"'0.weight' compressed, but the server has no compressor"),
    ([("0.weight", "dense", [np.zeros((4, 3), np.float32)])] * 2, r"'0.weight' twice"),
])
def test_bad_push_names_worker_and_tensor(lone_server, tensors, message, capsys):
    header, arrays = _push(*tensors)
    with pytest.raises(PSError, match=message):
        lone_server._decode(7, header, arrays)
    assert "parameter server 0 (rank 0): worker rank 7" in capsys.readouterr().err


def test_good_push_decodes(lone_server):
    header, arrays = _push(("0.weight", "dense", [np.ones((4, 3), np.float32)]),
                           ("1.embed", "sparse", [np.array([3, 3]),
                                                  np.ones((2, 2), np.float32)]))
    grads = lone_server._decode(7, header, arrays)
    assert grads["0.weight"].shape == (4, 3)
    assert isinstance(grads["1.embed"], SparseGrad)
    assert grads["1.embed"].to_dense()[3].tolist() == [2.0, 2.0]

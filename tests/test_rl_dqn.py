"""DQN's pieces on mpidl layers, checked against hand computations: n-step returns,
Ape-X's epsilons, the Huber loss and its gradient, clipping, double-DQN targets."""

import numpy as np
import pytest

from mpidl.engine.clip import clip_grad_norm
from mpidl.engine.losses import HuberLoss
from mpidl.engine.module import Parameter
from mpidl.errors import ConfigError
from mpidl.rl.actor import NStep
from mpidl.rl.dqn import DQN, apex_epsilon, build_q_network, copy_params

gym = pytest.importorskip("gymnasium", reason="pip install 'mpidl[rl]'")


def test_nstep_returns_terminated_and_truncated():
    g = 0.5
    ns = NStep(3, g)
    o = [np.full(2, float(k)) for k in range(10)]
    ns.step(o[0], 0, 1.0, o[1], False, False)
    ns.step(o[1], 1, 2.0, o[2], False, False)
    ns.step(o[2], 0, 4.0, o[3], False, False)       # window full: emit s0
    ns.step(o[3], 1, 8.0, o[4], True, False)        # terminated: flush s1, s2, s3
    b = ns.take((2,))
    assert b["obs"][:, 0].tolist() == [0, 1, 2, 3]
    assert b["reward"].tolist() == [1 + g * 2 + g * g * 4, 2 + g * 4 + g * g * 8,
                                    4 + g * 8, 8.0]
    assert b["next_obs"][:, 0].tolist() == [3, 4, 4, 4]
    assert b["discount"].tolist() == [g ** 3, 0.0, 0.0, 0.0]
    ns.step(o[5], 0, 1.0, o[6], False, False)
    ns.step(o[6], 0, 1.0, o[7], False, True)        # time limit: bootstrap from o7
    b = ns.take((2,))
    assert b["discount"].tolist() == [g ** 2, g]
    assert b["next_obs"][:, 0].tolist() == [7, 7]


def test_apex_epsilons():
    eps = [apex_epsilon(i, 8) for i in range(8)]
    assert eps[0] == 0.4 and eps[-1] == pytest.approx(0.4 ** 8)
    assert eps[3] == pytest.approx(0.4 ** (1 + 7 * 3 / 7))
    assert all(a > b for a, b in zip(eps, eps[1:]))
    assert apex_epsilon(0, 1) == 0.4


def test_huber_value_and_gradient():
    out = np.array([0.0, 0.5, 3.0, -4.0])
    tgt = np.zeros(4)
    w = np.array([1.0, 2.0, 1.0, 0.5])
    h = HuberLoss(1.0)
    v = h.forward(out, tgt, w)
    per = np.array([0.0, 0.125, 2.5, 3.5]) * w
    assert v == pytest.approx(per.mean())
    g = h.backward()
    np.testing.assert_allclose(g, np.array([0.0, 0.5, 1.0, -1.0]) * w / 4)
    # against a finite difference
    eps = 1e-6
    for k in range(4):
        d = np.zeros(4)
        d[k] = eps
        num = (HuberLoss(1.0).forward(out + d, tgt, w) - HuberLoss(1.0).forward(out - d, tgt, w)) / (2 * eps)
        assert num == pytest.approx(g[k], abs=1e-6)


def test_clip_grad_norm():
    ps = [Parameter(np.zeros(2)), Parameter(np.zeros(1))]
    ps[0].grad, ps[1].grad = np.array([3.0, 0.0]), np.array([4.0])
    assert clip_grad_norm(ps, 10.0) == 5.0 and ps[0].grad[0] == 3.0
    assert clip_grad_norm(ps, 1.0) == 5.0
    assert np.sqrt(ps[0].grad @ ps[0].grad + ps[1].grad @ ps[1].grad) == pytest.approx(1.0)


def test_double_dqn_targets_by_hand():
    d = DQN((4,), 2, hidden=(8,), seed=3)
    rng = np.random.default_rng(0)
    for _, p in d.target.named_parameters():  # a target different from the online net
        p.data += rng.normal(0, 0.3, p.data.shape)
    batch = {"obs": rng.normal(size=(5, 4)), "action": rng.integers(0, 2, 5),
             "reward": rng.normal(size=5), "next_obs": rng.normal(size=(5, 4)),
             "discount": np.array([0.9, 0.0, 0.81, 0.9, 0.9])}
    qo = d.online.forward(batch["next_obs"])
    qt = d.target.forward(batch["next_obs"])
    best = qo.argmax(1)
    want = batch["reward"] + batch["discount"] * qt[np.arange(5), best]
    np.testing.assert_array_equal(d.targets(batch), want)
    d.double = False
    np.testing.assert_array_equal(d.targets(batch), batch["reward"] + batch["discount"] * qt.max(1))
    # one update moves the online net, not the target; after target_every it is copied
    d.double, d.target_every = True, 2
    before = [p.data.copy() for _, p in d.target.named_parameters()]
    d.learn(batch)
    assert all(np.array_equal(a, p.data) for a, (_, p) in zip(before, d.target.named_parameters()))
    d.learn(batch)
    assert all(np.array_equal(p.data, q.data) for (_, p), (_, q) in
               zip(d.online.named_parameters(), d.target.named_parameters()))


def test_learning_reduces_the_loss_on_a_fixed_batch():
    d = DQN((4,), 3, hidden=(16,), seed=0, lr=1e-2, target_every=0)
    rng = np.random.default_rng(1)
    batch = {"obs": rng.normal(size=(32, 4)), "action": rng.integers(0, 3, 32),
             "reward": rng.normal(size=32), "next_obs": rng.normal(size=(32, 4)),
             "discount": np.zeros(32)}
    first = d.learn(batch)[1]
    for _ in range(200):
        last = d.learn(batch)[1]
    assert last < 0.1 * first


def test_networks():
    conv = build_q_network("conv", (10, 10, 4), 6, seed=0)
    assert conv.forward(np.zeros((2, 10, 10, 4))).shape == (2, 6)
    with pytest.raises(ConfigError, match="--network conv takes"):
        build_q_network("conv", (4,), 2)
    a, b = build_q_network("mlp", (4,), 2, seed=1), build_q_network("mlp", (4,), 2, seed=2)
    copy_params(a, b)
    assert all(np.array_equal(p.data, q.data) for (_, p), (_, q) in
               zip(a.named_parameters(), b.named_parameters()))

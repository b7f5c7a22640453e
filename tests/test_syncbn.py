"""SyncBatchNorm: multi-rank equivalence with one process, and its single-process rules."""

import os

import numpy as np
import pytest
from mpirun import run_ranks

from mpidl.engine import BatchNorm1d, BatchNorm2d, ShapeError, build_model, convert_sync_batchnorm

RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranks")


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.mpi_matrix_extra), 3])
def test_sync_batchnorm_on_n_ranks_equals_one_process(n):
    launch = run_ranks(n, [os.path.join(RANKS, "syncbn_check.py")], timeout=120).check()
    assert f"syncbn ok: {n} ranks, 8 cases" in launch.output


class OneRank:
    """A group of one process that records what it is asked to all-reduce."""

    size = 1

    def __init__(self):
        self.sizes = []

    def allreduce(self, x, out=None, op="sum"):
        assert op == "sum" and out is x
        self.sizes.append(x.size)
        return x


def randn(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("cls,shape", [(BatchNorm1d, (6, 4)), (BatchNorm2d, (3, 4, 2, 3))])
def test_a_group_of_one_is_bitwise_plain_batchnorm_with_three_packed_allreduces(cls, shape):
    group = OneRank()
    plain, synced = cls(4, dtype="float64"), cls(4, dtype="float64", sync_group=group)
    x, dy = randn(*shape) * 2 + 1, randn(*shape, seed=2)
    y, ys = plain(x), synced(x)
    assert group.sizes == [4 + 1, 4]  # sums and count in one buffer, then squared deviations
    dx, dxs = plain.backprop(dy.copy()), synced.backprop(dy.copy())
    assert group.sizes == [5, 4, 2 * 4]  # sum(dy) and sum(dy * xhat) in one buffer
    assert np.array_equal(y, ys) and np.array_equal(dx, dxs)
    for name in ("weight", "bias"):
        assert np.array_equal(getattr(plain, name).grad, getattr(synced, name).grad)
    for name, value in plain.state_dict().items():
        assert np.array_equal(value, synced.state_dict()[name]), name
    synced.eval()
    synced.backprop(synced(x))
    assert len(group.sizes) == 3  # eval mode: no communication
    assert repr(synced) == f"{cls.__name__}(4, sync over 1 rank(s))"


def test_sync_group_is_a_settable_attribute_and_the_forward_group_serves_backward():
    bn = BatchNorm1d(3, dtype="float64")
    group = OneRank()
    bn.sync_group = group
    x = randn(5, 3)
    bn(x)
    bn.sync_group = None  # changed between forward and backward: backward still syncs
    bn.backprop(np.ones_like(x))
    assert group.sizes == [4, 3, 6]


def test_sync_batchnorm_needs_two_values_over_the_group():
    bn = BatchNorm1d(3, sync_group=OneRank())
    with pytest.raises(ShapeError, match=r"more than one value per channel over the sync "
                                         r"group \(1 in all\), got input shape \(1, 3\)"):
        bn(randn(1, 3))


def test_convert_sync_batchnorm():
    model = build_model("resnet-tiny")
    group = OneRank()
    assert convert_sync_batchnorm(model, group) == 9  # stem, 2 + 3 + 3 in the blocks
    bns = [m for _, m in model.modules() if isinstance(m, (BatchNorm1d, BatchNorm2d))]
    assert len(bns) == 9 and all(bn.sync_group is group for bn in bns)
    assert convert_sync_batchnorm(model, None) == 9
    assert all(bn.sync_group is None for bn in bns)
    assert convert_sync_batchnorm(build_model("mlp"), group) == 0
    with pytest.raises(TypeError, match="needs an mpidl Communicator"):
        convert_sync_batchnorm(model, "world")

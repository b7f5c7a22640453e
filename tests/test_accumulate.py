"""Two features the runtime's parts make small, held to exactness through ``mpidl train``:

* ``--accumulate K``: the schedule runs K micro-batches per step and the syncs send once,
  so ``--accumulate 4 --batch-size 32`` is ``--batch-size 128`` (float64, 1e-12), on the
  MLP and on a convolutional model without BatchNorm (with BatchNorm the statistics are
  per micro-batch, as in every framework);
* ``--sync-bn``: BatchNorm statistics all-reduced over the data-parallel group in forward
  and backward, so N ranks with batch b are one process with batch N*b for the built-in
  models with BatchNorm (cnn, resnet-tiny; float64, 1e-10, N = 2, 3, 4).
"""

import os
import sys

import numpy as np
import pytest

from mpirun import fashion_available, mpiexec_cmd, run_command

CONV_NO_BN = '''
from mpidl.engine import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential


def conv_net(input_shape, num_classes, rng, dtype):
    c, h, w = input_shape
    return Sequential(Conv2d(c, 6, 3, padding=1, rng=rng, dtype=dtype), ReLU(), MaxPool2d(2),
                      Conv2d(6, 8, 3, padding=1, rng=rng, dtype=dtype), ReLU(), MaxPool2d(2),
                      Flatten(), Linear(8 * (h // 4) * (w // 4), 32, rng=rng, dtype=dtype),
                      ReLU(), Linear(32, num_classes, rng=rng, dtype=dtype))
'''


def _mpidl():
    return os.path.join(os.path.dirname(sys.executable), "mpidl")


def train(out, args, n=1, timeout=300):
    cmd = ([*mpiexec_cmd(), "-n", str(n)] if n > 1 else []) + [_mpidl(), "train"]
    run_command(cmd + args + ["--dtype", "float64", "--no-progress", "--out-dir", str(out)],
                timeout=timeout).check()
    with np.load(os.path.join(out, "model.npz")) as f:
        return {k: f[k] for k in f.files if k != "__meta__"}


def max_rel_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) / max(float(np.max(np.abs(b[k]))), 1e-300)
               for k in a)


@pytest.mark.skipif(not fashion_available(), reason="needs Fashion-MNIST "
                    "(apt-get install dataset-fashion-mnist)")
@pytest.mark.parametrize("model", ["mlp", "conv"])
def test_accumulate_4_of_32_equals_a_batch_of_128(tmp_path, model):
    if model == "conv":
        path = tmp_path / "conv.py"
        path.write_text(CONV_NO_BN)
        model = f"{path}:conv_net"
    common = ["--model", model, "--epochs", "1", "--limit-train", "2048", "--limit-test",
              "64", "--lr", "0.05", "--momentum", "0.9", "--seed", "3"]
    big = train(tmp_path / "b128", common + ["--batch-size", "128"])
    acc = train(tmp_path / "a4", common + ["--batch-size", "32", "--accumulate", "4"])
    assert max_rel_diff(acc, big) <= 1e-12
    # and it is not trivially so: a batch of 32 without accumulation differs
    small = train(tmp_path / "b32", common + ["--batch-size", "32"])
    assert max_rel_diff(small, big) > 1e-3


@pytest.mark.parametrize("model", ["cnn", "resnet-tiny"])
@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_sync_bn_on_n_ranks_equals_one_process_at_n_times_the_batch(tmp_path, model, n):
    common = ["--model", model, "--dataset", "digits", "--epochs", "1", "--limit-train",
              "192", "--limit-test", "64", "--lr", "0.05", "--seed", "5"]
    one = train(tmp_path / "one", common + ["--batch-size", str(16 * n)])
    synced = train(tmp_path / "sync", common + ["--batch-size", "16", "--sync-bn"], n=n)
    assert max_rel_diff(synced, one) <= 1e-10
    if n == 2:  # without --sync-bn each rank normalizes its own 16 samples: not equal
        plain = train(tmp_path / "plain", common + ["--batch-size", "16"], n=n)
        assert max_rel_diff(plain, one) > 1e-6

"""Data loaders: IDX and CIFAR-10 parsing on tiny generated files, and the sharded sampler."""

import gzip
import os

import numpy as np
import pytest

from mpidl.data import BatchLoader, epoch_permutation, eval_batches, load_dataset, shard_range
from mpidl.data.cifar import read_cifar_batch, write_cifar_batch
from mpidl.data.idx import parse_idx, read_idx, read_idx_head, write_idx
from mpidl.errors import ConfigError, DataError

FASHION_DIR = "/usr/share/datasets/fashion-mnist"


def make_idx_dataset(root, n_train=20, n_test=10, gz=True, side=28, seed=0):
    rng = np.random.default_rng(seed)
    ext = ".gz" if gz else ""
    files = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, side, side), dtype=np.uint8)
        y = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(os.path.join(root, f"{prefix}-images-idx3-ubyte{ext}"), x)
        write_idx(os.path.join(root, f"{prefix}-labels-idx1-ubyte{ext}"), y)
        files[prefix] = (x, y)
    return files


# -- IDX

@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32,
                                   np.float64])
def test_idx_roundtrip(tmp_path, gz, dtype):
    a = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5)
    if dtype == np.uint8:
        a = np.arange(30, dtype=np.uint8).reshape(2, 3, 5)
    path = str(tmp_path / ("a.idx" + (".gz" if gz else "")))
    write_idx(path, a)
    b = read_idx(path)
    assert b.dtype == np.dtype(dtype) and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_idx_header_is_big_endian(tmp_path):
    path = str(tmp_path / "l.idx")
    write_idx(path, np.array([1, 2, 3], dtype=np.uint8))
    raw = open(path, "rb").read()
    assert raw == b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02\x03"


@pytest.mark.parametrize("data, match", [
    (b"\x00\x00", "truncated"),
    (b"\x12\x34\x08\x01\x00\x00\x00\x01\x05", "magic number"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "magic number"),
    (b"\x00\x00\x08\x03\x00\x00", "truncated inside its header"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02", "truncated: 10 bytes, expected 13"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", "longer than its header"),
])
def test_idx_corrupt(data, match):
    with pytest.raises(DataError, match=match) as e:
        parse_idx(data, path="some/file")
    assert "some/file" in str(e.value)


def test_idx_wrong_ndim():
    with pytest.raises(DataError, match="1 dimension.*expected 3"):
        parse_idx(b"\x00\x00\x08\x01\x00\x00\x00\x01\x05", path="x", ndim=3)


def test_idx_truncated_gzip(tmp_path):
    path = str(tmp_path / "x.gz")
    write_idx(path, np.zeros((4, 28, 28), np.uint8))
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"x\.gz.*damaged gzip"):
        read_idx(path)


def test_idx_truncated_payload_in_gzip(tmp_path):
    path = str(tmp_path / "train-images-idx3-ubyte.gz")
    write_idx(str(tmp_path / "full"), np.zeros((4, 28, 28), np.uint8))
    raw = open(tmp_path / "full", "rb").read()
    with open(path, "wb") as f:
        f.write(gzip.compress(raw[:-100]))
    with pytest.raises(DataError, match="truncated.*expected 3152 for dimensions 4x28x28"):
        read_idx(path)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_dataset(tmp_path, gz):
    files = make_idx_dataset(str(tmp_path), gz=gz)
    d = load_dataset("fashion-mnist", str(tmp_path))
    assert d.input_shape == (1, 28, 28) and d.num_classes == 10
    assert d.train_x.dtype == np.float32 and d.train_y.dtype == np.int64
    assert d.train_x.shape == (20, 1, 28, 28) and d.test_x.shape == (10, 1, 28, 28)
    np.testing.assert_array_equal(d.train_y, files["train"][1])
    assert abs(float(d.train_x.mean())) < 1e-5 and abs(float(d.train_x.std()) - 1) < 1e-4
    # standardization is monotone: the brightest raw pixel stays the brightest
    assert np.argmax(d.train_x) == np.argmax(files["train"][0])


def test_idx_dataset_dot_spelling(tmp_path):
    for prefix, n in (("train", 6), ("t10k", 3)):
        write_idx(str(tmp_path / f"{prefix}-images.idx3-ubyte"), np.zeros((n, 28, 28), np.uint8))
        write_idx(str(tmp_path / f"{prefix}-labels.idx1-ubyte"), np.zeros(n, np.uint8))
    assert len(load_dataset("mnist", str(tmp_path)).train_y) == 6


def test_idx_dataset_mismatched_counts(tmp_path):
    make_idx_dataset(str(tmp_path))
    write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), np.zeros(9, np.uint8))
    with pytest.raises(DataError, match="10 images but .*t10k-labels.* 9 labels"):
        load_dataset("fashion-mnist", str(tmp_path))


def test_idx_dataset_bad_labels(tmp_path):
    make_idx_dataset(str(tmp_path))
    write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), np.full(10, 12, np.uint8))
    with pytest.raises(DataError, match="labels must be 0-9"):
        load_dataset("fashion-mnist", str(tmp_path))


@pytest.mark.parametrize("gz", [True, False])
def test_idx_head_reads_the_first_rows(tmp_path, gz):
    x = np.arange(7 * 3 * 2, dtype=np.uint8).reshape(7, 3, 2)
    path = str(tmp_path / ("x.idx" + (".gz" if gz else "")))
    write_idx(path, x)
    for rows in (1, 4, 7, 9):
        head, total = read_idx_head(path, rows, ndim=3)
        assert total == 7 and np.array_equal(head, x[:rows]), rows
    labels = str(tmp_path / "y.idx")
    write_idx(labels, np.zeros(4, np.uint8))
    with pytest.raises(DataError, match="expected 3"):
        read_idx_head(labels, 2, ndim=3)


def test_limited_loads_read_only_their_rows_once_the_sums_are_cached(tmp_path, monkeypatch):
    """The first load reads every file whole and caches the images' byte sums; later
    limited loads decompress only the rows they keep: the same arrays, bitwise, as
    cutting the whole data set. A changed file or a damaged entry is read whole again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "data"
    make_idx_dataset(str(data), n_train=50, n_test=20)
    whole = load_dataset("fashion-mnist", str(data))
    entries = tmp_path / "cache" / "mpidl" / "idx-sums"
    assert len(os.listdir(entries)) == 2  # the two image files

    def same(a, b):
        for k in ("train_x", "train_y", "test_x", "test_y"):
            x, y = getattr(a, k), getattr(b, k)
            assert x.dtype == y.dtype and np.array_equal(x, y), k

    for limits in ((10, 5), (50, 20), (60, None), (None, 3)):
        same(load_dataset("fashion-mnist", str(data), *limits), whole.limit(*limits))
    # a changed training set: its sums are computed again (not the cached ones)
    make_idx_dataset(str(data), n_train=50, n_test=20, seed=1)
    fresh = load_dataset("fashion-mnist", str(data), 10, 5)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    same(fresh, load_dataset("fashion-mnist", str(data)).limit(10, 5))
    assert not np.array_equal(fresh.train_x, whole.train_x[:10])
    # a damaged entry is ignored; an entry that cannot be written costs nothing
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in os.listdir(entries):
        (entries / name).write_text("{not json")
    same(load_dataset("fashion-mnist", str(data), 10, 5), fresh)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    same(load_dataset("fashion-mnist", str(data), 10, 5), fresh)


def test_a_truncated_training_set_is_found_on_a_limited_first_load(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    make_idx_dataset(str(tmp_path))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(DataError, match="truncated"):
        load_dataset("fashion-mnist", str(tmp_path), limit_train=2)


def test_missing_data_dir_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("fashion-mnist", str(tmp_path / "nope"))
    msg = str(e.value)
    assert "nope" in msg and "does not exist" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "--data-dir" in msg
    assert "zalandoresearch/fashion-mnist" in msg


def test_missing_file(tmp_path):
    make_idx_dataset(str(tmp_path))
    os.remove(tmp_path / "train-labels-idx1-ubyte.gz")
    with pytest.raises(DataError, match="has no train-labels-idx1-ubyte"):
        load_dataset("fashion-mnist", str(tmp_path))


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown dataset 'imagenet'.*fashion-mnist"):
        load_dataset("imagenet")


@pytest.mark.skipif(not os.path.isdir(FASHION_DIR), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_default_location():
    d = load_dataset("fashion-mnist")
    assert len(d.train_y) == 60000 and len(d.test_y) == 10000
    assert np.bincount(d.test_y).tolist() == [1000] * 10
    # limits given to the loader convert only the rows kept, with the whole training
    # set's statistics: the same arrays as cutting the whole data set
    for limits in ((1200, 1000), (5, None), (None, 7), (0, 0)):
        cut = load_dataset("fashion-mnist", limit_train=limits[0], limit_test=limits[1])
        whole = d.limit(*limits)
        for k in ("train_x", "train_y", "test_x", "test_y"):
            a, b = getattr(cut, k), getattr(whole, k)
            assert a.dtype == b.dtype and np.array_equal(a, b), (limits, k)


def test_limits_given_to_a_float_data_set_cut_after_standardizing():
    d = load_dataset("synthetic", n_train=64, n_test=16)
    cut = load_dataset("synthetic", limit_train=10, limit_test=3, n_train=64, n_test=16)
    assert np.array_equal(cut.train_x, d.train_x[:10])
    assert np.array_equal(cut.test_y, d.test_y[:3])


# -- CIFAR-10

def test_cifar_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "cifar-10-batches-bin"
    expected = {}
    for name, n in [(f"data_batch_{i}.bin", 3) for i in range(1, 6)] + [("test_batch.bin", 4)]:
        x = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, size=n)
        write_cifar_batch(str(root / name), x, y)
        expected[name] = (x, y)
    x, y = read_cifar_batch(str(root / "test_batch.bin"))
    np.testing.assert_array_equal(x, expected["test_batch.bin"][0])
    np.testing.assert_array_equal(y, expected["test_batch.bin"][1])
    d = load_dataset("cifar10", str(tmp_path))  # finds the cifar-10-batches-bin subfolder
    assert d.input_shape == (3, 32, 32) and len(d.train_y) == 15 and len(d.test_y) == 4
    np.testing.assert_array_equal(d.train_y[:3], expected["data_batch_1.bin"][1])
    # the red channel of the first image is its first 1024 bytes after the label
    raw = open(root / "data_batch_1.bin", "rb").read()
    red = np.frombuffer(raw[1:1025], np.uint8).reshape(32, 32)
    np.testing.assert_array_equal(red, expected["data_batch_1.bin"][0][0, 0])


def test_cifar_corrupt(tmp_path):
    path = tmp_path / "test_batch.bin"
    path.write_bytes(b"\x00" * 3000)
    with pytest.raises(DataError, match="test_batch.bin has 3000 bytes, expected a multiple of 3073"):
        read_cifar_batch(str(path))
    path.write_bytes(b"\x0b" + b"\x00" * 3072)
    with pytest.raises(DataError, match="label 11"):
        read_cifar_batch(str(path))


def test_cifar_missing(tmp_path):
    with pytest.raises(DataError, match="no CIFAR-10 binary files"):
        load_dataset("cifar10", str(tmp_path))


# -- digits and synthetic

def test_digits():
    pytest.importorskip("sklearn")
    d = load_dataset("digits")
    assert d.input_shape == (1, 8, 8) and len(d.train_y) + len(d.test_y) == 1797
    assert d.train_x.dtype == np.float32


def test_byte_images_standardize_as_float_images_bitwise():
    """The byte path (integer sums, a 256-entry table) gives the arrays of the general
    float path: on Fashion-MNIST when installed, and on random images of 1-3 channels."""
    from mpidl.data import datasets

    rng = np.random.default_rng(0)
    cases = []
    for _ in range(100):
        shape = (int(rng.integers(1, 200)), int(rng.integers(1, 4)), 3, 3)
        hi = int(rng.integers(1, 257))
        cases.append((rng.integers(0, hi, shape, dtype=np.uint8),
                      rng.integers(0, 256, (5,) + shape[1:], dtype=np.uint8)))
    if os.path.isdir(FASHION_DIR):
        from mpidl.data.idx import read_idx

        cases.append(tuple(read_idx(os.path.join(FASHION_DIR, f), ndim=3)[:, None] for f in
                           ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz")))
    for train_x, test_x in cases:
        fast = datasets.standardize(train_x, test_x)
        general = datasets._standardize_floats(train_x, test_x)
        for a, b in zip(fast, general):
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, b)


def test_digits_read_from_the_file_are_scikit_learns_arrays():
    """digits reads scikit-learn's table itself (importing scikit-learn takes seconds a
    process): the images and labels are exactly load_digits'."""
    load_digits = pytest.importorskip("sklearn.datasets").load_digits
    from mpidl.data.datasets import digits_file

    table = np.loadtxt(digits_file(), delimiter=",")
    want = load_digits()
    np.testing.assert_array_equal(table[:, :-1].reshape(-1, 8, 8), want.images)
    np.testing.assert_array_equal(table[:, -1].astype(np.int64), want.target)
    d = load_dataset("digits")
    assert sorted(np.concatenate([d.train_y, d.test_y]).tolist()) == sorted(want.target.tolist())


def test_synthetic_is_seeded_and_learnable():
    a = load_dataset("synthetic", seed=3, n_train=2000, n_test=500)
    b = load_dataset("synthetic", seed=3, n_train=2000, n_test=500)
    np.testing.assert_array_equal(a.train_x, b.train_x)
    # nearest class mean (a linear classifier) separates the classes
    x = a.train_x.reshape(len(a.train_y), -1)
    means = np.stack([x[a.train_y == c].mean(0) for c in range(10)])
    tx = a.test_x.reshape(len(a.test_y), -1)
    pred = np.argmin(((tx[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == a.test_y).mean() > 0.9


def test_limit():
    d = load_dataset("synthetic", n_train=100, n_test=50).limit(10, 5)
    assert len(d.train_y) == 10 and len(d.test_x) == 5


# -- the sampler

def test_permutation_depends_on_seed_and_epoch_only():
    np.testing.assert_array_equal(epoch_permutation(100, 1, 2), epoch_permutation(100, 1, 2))
    assert not np.array_equal(epoch_permutation(100, 1, 2), epoch_permutation(100, 1, 3))
    assert not np.array_equal(epoch_permutation(100, 1, 2), epoch_permutation(100, 2, 2))


@pytest.mark.parametrize("n", [1, 7, 64, 100, 101, 257])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_make_the_global_batch(n, count, drop_last):
    b = 8
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.arange(n)
    if drop_last and n < b * count:
        with pytest.raises(ConfigError, match="larger than"):
            BatchLoader(x, y, b, shard=(0, count), drop_last=drop_last)
        return
    shards = [BatchLoader(x, y, b, shard=(r, count), seed=5, drop_last=drop_last, device=False)
              for r in range(count)]
    one = BatchLoader(x, y, b * count, seed=5, drop_last=drop_last, device=False)
    steps = {len(s) for s in shards}
    assert steps == {len(one)}  # every rank runs the same number of steps
    expect = n // (b * count) if drop_last else -(-n // (b * count))
    assert len(one) == expect
    for epoch in (0, 1):
        batches = [list(s.epoch(epoch)) for s in shards]
        seen = []
        for step, (_, gx, gy) in enumerate(one.epoch(epoch)):
            pieces = [batches[r][step] for r in range(count)]
            assert all(p[0] == step and len(p[2]) == b for p in pieces)
            # the union (concatenation, in rank order) of the shards is the global batch
            np.testing.assert_array_equal(np.concatenate([p[2] for p in pieces]), gy)
            np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), gx)
            seen.extend(gy.tolist())
        if drop_last:
            assert len(set(seen)) == len(seen) == expect * b * count
        else:
            assert set(seen) == set(range(n))  # padding wraps around: nothing is skipped


def test_resume_mid_epoch_gives_the_same_batches():
    x = np.arange(50, dtype=np.float32)[:, None]
    loader = BatchLoader(x, np.arange(50), 4, seed=9, device=False)
    full = [b[2].tolist() for b in loader.epoch(3)]
    tail = [b[2].tolist() for b in loader.epoch(3, start=5)]
    assert tail == full[5:]


def test_batches_are_moved_to_the_device():
    x = np.zeros((10, 3), np.float32)
    loader = BatchLoader(x, np.zeros(10, np.int64), 4, dtype="float64")
    _, bx, by = next(loader.epoch(0))
    assert bx.dtype == np.float64 and by.dtype == np.int64


@pytest.mark.parametrize("n, count", [(10, 3), (2, 4), (0, 2), (100, 7)])
def test_eval_shards_cover_everything_once(n, count):
    pieces = [shard_range(n, r, count) for r in range(count)]
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    x = np.arange(n)
    got = np.concatenate([np.concatenate([b[1] for b in eval_batches(x, x, 3, (r, count))] or
                                         [np.zeros(0, int)]) for r in range(count)])
    np.testing.assert_array_equal(got, x)

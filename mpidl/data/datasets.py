"""Named datasets: Fashion-MNIST (default), MNIST, CIFAR-10, scikit-learn digits, synthetic,
and character-level text (``mpidl.data.text``).

``load_dataset(name, data_dir=None)`` returns a ``Dataset`` whose arrays live on the host
(NumPy): images as float32 (N, C, H, W) standardized per channel with the training set's
mean and standard deviation, labels as int64. Moving batches to the device is the batch
loader's job, just before use.
"""

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from mpidl import env
from mpidl.data.cifar import CLASSES as CIFAR_CLASSES
from mpidl.data.cifar import read_cifar10
from mpidl.data.idx import read_idx, read_idx_head
from mpidl.data.text import text_dataset
from mpidl.errors import DataError

SYSTEM_DATA_ROOT = "/usr/share/datasets"
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot"]
IDX_FILES = {  # role -> base name; ".gz" or raw, and the "train-images.idx3-ubyte" spelling
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


@dataclass
class Dataset:
    """A train/test split on the host: x float32 (N, *input_shape), y int64 (N,).

    ``task``: what the labels are: ``"classification"`` (a class per sample) or
    ``"language-model"`` (``mpidl.data.text``: x and y int64 (N, T), y the next token of
    each position; ``vocab`` the characters of ids 0 .. len(vocab) - 1).
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    classes: list = field(default_factory=list)
    source: str = ""
    task: str = "classification"
    vocab: str = None

    @property
    def input_shape(self):
        return tuple(self.train_x.shape[1:])

    def limit(self, n_train=None, n_test=None):
        """A copy keeping the first ``n_train`` training and ``n_test`` test samples."""
        return Dataset(self.name, _first(self.train_x, n_train), _first(self.train_y, n_train),
                       _first(self.test_x, n_test), _first(self.test_y, n_test),
                       self.num_classes, self.classes, self.source, self.task, self.vocab)

    def __repr__(self):
        return (f"Dataset({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
                f"input_shape={self.input_shape}, classes={self.num_classes})")


def standardize(train_x, test_x, keep=(None, None)):
    """Float32 images scaled by the training set's per-channel mean and std. ``keep``:
    (n_train, n_test), the rows to return (``Dataset.limit``'s meaning); the statistics
    are still the whole training set's, and byte images convert only the kept rows (a
    run on a few thousand images of Fashion-MNIST then starts half a second sooner)."""
    if train_x.dtype == np.uint8 and test_x.dtype == np.uint8:
        return _standardize_bytes(train_x, test_x, keep)
    tx, vx = _standardize_floats(train_x, test_x)
    return _first(tx, keep[0]), _first(vx, keep[1])


def _first(a, n):
    """The first ``n`` rows of ``a``; all of them when ``n`` is None or not positive."""
    return a if n is None or n <= 0 else a[:n]


def _standardize_floats(train_x, test_x):
    train_x = train_x.astype(np.float32)
    test_x = test_x.astype(np.float32)
    axes = (0,) + tuple(range(2, train_x.ndim))
    mean = train_x.mean(axis=axes, dtype=np.float64, keepdims=True).astype(np.float32)
    std = train_x.std(axis=axes, dtype=np.float64, keepdims=True).astype(np.float32)
    std[std == 0] = 1.0
    return (train_x - mean) / std, (test_x - mean) / std


def _standardize_bytes(train_x, test_x, keep=(None, None)):
    """``standardize`` for byte images (MNIST, Fashion-MNIST, CIFAR-10) at a fraction of the
    cost: each channel's mean and std come from exact integer sums of the values and their
    squares, and every image maps through a 256-entry table of the float32 results. The
    table holds exactly the float32 operations of the general path, so the arrays are the
    same whenever the two paths' float64 statistics round to the same float32
    (``tests/test_data.py`` checks the data sets mpidl reads)."""
    return _map_bytes(_byte_sums(train_x), _first(train_x, keep[0]), _first(test_x, keep[1]))


def _byte_sums(x):
    """Per channel of byte images ``x`` (N, C, ...): [count, sum, sum of squares], exact."""
    return [[x[:, c].size, int(x[:, c].sum(dtype=np.uint64)),
             int(np.square(x[:, c], dtype=np.uint32).sum(dtype=np.uint64))]
            for c in range(x.shape[1])]


def _map_bytes(sums, *arrays):
    """``arrays`` of byte images standardized with the training set's ``_byte_sums``."""
    tables = []
    for n, total, squares in sums:
        mean = np.float32(total / n)
        std = np.float32(math.sqrt((n * squares - total * total) / (n * n)))
        if std == 0:
            std = np.float32(1.0)
        tables.append((np.arange(256, dtype=np.float32) - mean) / std)
    out = []
    for x in arrays:
        y = np.empty(x.shape, np.float32)
        for c, table in enumerate(tables):
            y[:, c] = table[x[:, c]]
        out.append(y)
    return out


# -- IDX datasets (MNIST, Fashion-MNIST)

_IDX_HELP = {
    "fashion-mnist": ("install the Debian/Ubuntu package (sudo apt-get install "
                      "dataset-fashion-mnist; it puts the files in "
                      "/usr/share/datasets/fashion-mnist), or download the four IDX files "
                      "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
                      "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) from "
                      "https://github.com/zalandoresearch/fashion-mnist (folder data/fashion) "
                      "into DIR and pass --data-dir DIR"),
    "mnist": ("download the four IDX files (train-images-idx3-ubyte.gz, "
              "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
              "t10k-labels-idx1-ubyte.gz) of MNIST into DIR and pass --data-dir DIR"),
}


def _find_idx_file(data_dir, base):
    for name in (base + ".gz", base, base.replace("-idx", ".idx") + ".gz",
                 base.replace("-idx", ".idx")):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    return None


def _default_dirs(name):
    dirs = []
    root = env.get("MPIDL_DATA_DIR")
    if root:
        dirs.append(os.path.join(root, name))
    dirs.append(os.path.join(SYSTEM_DATA_ROOT, name))
    return dirs


def _idx_dataset(name, data_dir, classes, keep=(None, None)):
    if data_dir is None:
        candidates = _default_dirs(name)
        found = [d for d in candidates if _find_idx_file(d, IDX_FILES["test_y"])]
        if not found:
            raise DataError(f"{name} not found (looked in {', '.join(candidates)}): "
                            f"{_IDX_HELP[name]}")
        data_dir = found[0]
    elif not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} does not exist; for {name}, "
                        f"{_IDX_HELP[name]}")
    paths = {}
    for role, base in IDX_FILES.items():
        path = _find_idx_file(data_dir, base)
        if path is None:
            raise DataError(f"data directory {data_dir} has no {base}[.gz] for {name}; "
                            f"{_IDX_HELP[name]}")
        paths[role] = path
    # Images: a file read whole once (its byte sums cached, see _ImageCache) is read only
    # as far as a limited run keeps; labels are small and always read whole.
    arrays, counts, sums = {}, {}, {}
    for role, p in paths.items():
        rows = keep[0] if role == "train_x" else keep[1] if role == "test_x" else None
        cached = _ImageCache.sums(p) if role.endswith("_x") else None
        if cached is not None and rows is not None and rows > 0:
            arrays[role], counts[role] = read_idx_head(p, rows, ndim=3)
        else:
            arrays[role] = read_idx(p, ndim=3 if role.endswith("_x") else 1)
            counts[role] = len(arrays[role])
            if role.endswith("_x") and cached is None and arrays[role].dtype == np.uint8:
                cached = _ImageCache.store(p, _byte_sums(arrays[role][:, None]))
        sums[role] = cached
    for split in ("train", "test"):
        images, y = counts[f"{split}_x"], arrays[f"{split}_y"]
        if images != len(y):
            raise DataError(f"{paths[split + '_x']} has {images} images but "
                            f"{paths[split + '_y']} has {len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise DataError(f"{paths[split + '_y']}: labels must be 0-{len(classes) - 1}, "
                            f"found {y.min()}-{y.max()}")
    if arrays["train_x"].shape[1:] != arrays["test_x"].shape[1:]:
        raise DataError(f"{paths['train_x']} has images of {arrays['train_x'].shape[1:]} "
                        f"but {paths['test_x']} of {arrays['test_x'].shape[1:]}")
    if sums["train_x"] is not None and arrays["test_x"].dtype == np.uint8:
        tx, vx = _map_bytes(sums["train_x"], _first(arrays["train_x"], keep[0])[:, None],
                            _first(arrays["test_x"], keep[1])[:, None])
    else:  # images of another type: read whole above
        tx, vx = standardize(arrays["train_x"][:, None], arrays["test_x"][:, None], keep)
    return Dataset(name, tx, _first(arrays["train_y"], keep[0]).astype(np.int64), vx,
                   _first(arrays["test_y"], keep[1]).astype(np.int64), len(classes),
                   list(classes), os.path.abspath(data_dir))


class _ImageCache:
    """Byte sums of IDX image files read whole, kept in ``env.cache_dir()/idx-sums`` by
    the file's path, size and modification time: a training set's statistics then cost
    nothing on the next start, and an entry also says the file was read and checked
    whole, so a limited run may decompress only the rows it keeps (Fashion-MNIST's
    training images: 0.4 s of gunzip per process). The cache is only ever a shortcut: a
    missing, stale or unreadable entry, or a folder that cannot be written, means the
    file is read whole as before."""

    @staticmethod
    def _entry(path):
        st = os.stat(path)
        real = os.path.realpath(path)
        name = hashlib.sha1(real.encode("utf-8", "surrogateescape")).hexdigest()
        return (os.path.join(env.cache_dir(), "idx-sums", name + ".json"),
                {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns})

    @classmethod
    def sums(cls, path):
        try:
            where, key = cls._entry(path)
            with open(where, encoding="utf-8") as f:
                entry = json.load(f)
            if entry.get("file") == key:
                return [[int(v) for v in channel] for channel in entry["sums"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    @classmethod
    def store(cls, path, sums):
        try:
            where, key = cls._entry(path)
            os.makedirs(os.path.dirname(where), exist_ok=True)
            tmp = f"{where}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"file": key, "sums": sums}, f)
            os.replace(tmp, where)  # ranks writing at once write the same entry
        except OSError:
            pass
        return sums


def fashion_mnist(data_dir=None, keep=(None, None)):
    return _idx_dataset("fashion-mnist", data_dir, FASHION_CLASSES, keep)


def mnist(data_dir=None, keep=(None, None)):
    return _idx_dataset("mnist", data_dir, [str(i) for i in range(10)], keep)


def cifar10(data_dir=None, keep=(None, None)):
    if data_dir is None:
        candidates = _default_dirs("cifar10")
        found = [d for d in candidates if os.path.isdir(d)]
        data_dir = found[0] if found else candidates[-1]
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} does not exist; download "
                        "cifar-10-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, "
                        "unpack it into DIR and pass --data-dir DIR")
    tx, ty, vx, vy = read_cifar10(data_dir)
    tx, vx = standardize(tx, vx, keep)
    ty, vy = _first(ty, keep[0]), _first(vy, keep[1])
    return Dataset("cifar10", tx, ty, vx, vy, 10, list(CIFAR_CLASSES), os.path.abspath(data_dir))


def digits_file():
    """The digits table scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``), found
    without importing scikit-learn, which takes seconds: each row is 64 pixels and the label."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("sklearn")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                            "digits.csv.gz")
    if path is None or not os.path.isfile(path):
        raise DataError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
    return path


def digits(data_dir=None, seed=0, test_fraction=0.2):
    """scikit-learn's bundled 8x8 digits (1797 images), split 80/20 by a fixed seed; the
    same arrays as ``sklearn.datasets.load_digits``, read from its file."""
    table = np.loadtxt(digits_file(), delimiter=",")
    x = table[:, :-1].reshape(-1, 1, 8, 8).astype(np.float32)
    y = table[:, -1].astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    tx, vx = standardize(x[train], x[test])
    return Dataset("digits", tx, y[train], vx, y[test], 10, [str(i) for i in range(10)],
                   "sklearn.datasets.load_digits")


def synthetic(data_dir=None, n_train=4096, n_test=1024, input_shape=(1, 28, 28),
              num_classes=10, seed=0, separation=0.15, noise=1.0):
    """Seeded, learnable data: each class is a random prototype plus Gaussian noise.

    The prototypes are small next to the noise per pixel (``separation`` vs ``noise``),
    but the signal adds up over all pixels, so a linear model separates the classes
    after a few hundred steps; the same seed always gives the same data.
    """
    rng = np.random.default_rng(seed)
    dim = int(np.prod(input_shape))
    protos = rng.standard_normal((num_classes, dim)) * separation

    def make(n):
        y = rng.integers(0, num_classes, size=n)
        x = protos[y] + noise * rng.standard_normal((n, dim))
        return x.astype(np.float32).reshape((n,) + tuple(input_shape)), y.astype(np.int64)

    tx, ty = make(n_train)
    vx, vy = make(n_test)
    return Dataset("synthetic", tx, ty, vx, vy, num_classes,
                   [str(i) for i in range(num_classes)], f"synthetic(seed={seed})")


DATASETS = {
    "fashion-mnist": fashion_mnist,
    "mnist": mnist,
    "cifar10": cifar10,
    "digits": digits,
    "synthetic": synthetic,
    "text": text_dataset,
}
_ALIASES = {"fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist",
            "cifar-10": "cifar10", "cifar": "cifar10"}


#: the loaders that convert only the rows kept (byte images; ``standardize``)
_CUT_WHILE_LOADING = ("fashion-mnist", "mnist", "cifar10")


def load_dataset(name="fashion-mnist", data_dir=None, limit_train=None, limit_test=None,
                 **options):
    """Load the dataset ``name`` (see ``DATASETS``) from ``data_dir`` or its usual place;
    ``limit_train``/``limit_test``: keep only the first N samples of each split
    (``Dataset.limit``; images are still standardized with the whole training set's
    statistics)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if data_dir is not None:
        data_dir = os.path.expanduser(str(data_dir))
    if key in _CUT_WHILE_LOADING:
        options = dict(options, keep=(limit_train, limit_test))
    data = DATASETS[key](data_dir, **options)
    return data.limit(limit_train, limit_test) if limit_train or limit_test else data

"""Reader for the CIFAR-10 binary format (``cifar-10-batches-bin``).

Each file is a sequence of 3073-byte records: one label byte (0-9), then a 32x32 image as
1024 red, 1024 green and 1024 blue bytes, row-major. The training set is
``data_batch_1.bin`` ... ``data_batch_5.bin``, the test set ``test_batch.bin``.
"""

import os

import numpy as np

from mpidl.errors import DataError

RECORD = 1 + 3 * 32 * 32
TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
TEST_FILES = ["test_batch.bin"]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck"]


def read_cifar_batch(path):
    """One CIFAR-10 binary file -> (images uint8 (N, 3, 32, 32), labels int64 (N,))."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read CIFAR-10 file {path}: {e.strerror or e}") from None
    if len(raw) == 0 or len(raw) % RECORD:
        raise DataError(f"CIFAR-10 file {path} has {len(raw)} bytes, expected a multiple of "
                        f"{RECORD} (1 label byte + 3072 pixel bytes per image); "
                        "it is truncated or not CIFAR-10 binary")
    rec = np.frombuffer(raw, dtype=np.uint8).reshape(-1, RECORD)
    labels = rec[:, 0].astype(np.int64)
    if labels.max() > 9:
        bad = int(np.argmax(labels > 9))
        raise DataError(f"CIFAR-10 file {path}: record {bad} has label {labels[bad]}, "
                        "expected 0-9")
    images = rec[:, 1:].reshape(-1, 3, 32, 32).copy()
    return images, labels


def find_cifar_dir(data_dir):
    """``data_dir`` itself or its ``cifar-10-batches-bin`` subfolder, whichever has the files."""
    for d in (data_dir, os.path.join(data_dir, "cifar-10-batches-bin")):
        if os.path.exists(os.path.join(d, TEST_FILES[0])):
            return d
    return None


def read_cifar10(data_dir):
    """(train_images, train_labels, test_images, test_labels) from a CIFAR-10 binary folder."""
    d = find_cifar_dir(data_dir)
    if d is None:
        raise DataError(
            f"{data_dir} has no CIFAR-10 binary files (expected data_batch_1.bin ... "
            "data_batch_5.bin and test_batch.bin, possibly under cifar-10-batches-bin/); "
            "download cifar-10-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, "
            "unpack it and pass --data-dir DIR")
    missing = [f for f in TRAIN_FILES if not os.path.exists(os.path.join(d, f))]
    if missing:
        raise DataError(f"CIFAR-10 folder {d} lacks {', '.join(missing)}")
    parts = [read_cifar_batch(os.path.join(d, f)) for f in TRAIN_FILES]
    tx = np.concatenate([p[0] for p in parts])
    ty = np.concatenate([p[1] for p in parts])
    vx, vy = read_cifar_batch(os.path.join(d, TEST_FILES[0]))
    return tx, ty, vx, vy


def write_cifar_batch(path, images, labels):
    """Write images (N, 3, 32, 32) uint8 and labels as a CIFAR-10 binary file (for tests)."""
    images = np.asarray(images, dtype=np.uint8).reshape(len(labels), -1)
    rec = np.concatenate([np.asarray(labels, dtype=np.uint8)[:, None], images], axis=1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(rec.tobytes())

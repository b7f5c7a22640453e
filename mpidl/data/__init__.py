"""Datasets and the sharded batch loader.

``load_dataset(name, data_dir)`` gives host arrays (``Dataset``); ``BatchLoader`` yields
this rank's shard of each shuffled global batch, on the device.
"""

from mpidl.data.datasets import DATASETS, Dataset, load_dataset
from mpidl.data.loader import BatchLoader, epoch_permutation, eval_batches, shard_range

__all__ = ["DATASETS", "Dataset", "load_dataset", "BatchLoader", "epoch_permutation",
           "eval_batches", "shard_range"]

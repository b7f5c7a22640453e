"""Gradient syncs: how one group of parameters' gradients become the ones the optimizer
applies (``base.GradSync``). One module per way: ``fused`` (all-reduce of fused
buckets, with an optional compression hook), ``compressed`` (per-tensor compressed
exchange), ``rowsparse`` (all-gather of Embedding's touched rows), ``pushpull``
(parameter server), ``groups`` (a parameter server's worker groups: all-reduce in a
group, then its first rank's push/pull), ``parallax`` (``--sparse-sync ps``: row-sparse
parameters pushed to servers, the rest all-reduced among the trainers). A step may use
several, each for its own parameters."""

from mpidl.runtime.sync.base import GradSync
from mpidl.runtime.sync.compressed import BucketHook, PerTensorCompressed
from mpidl.runtime.sync.fused import FusedAllreduce
from mpidl.runtime.sync.groups import WorkerGroups
from mpidl.runtime.sync.parallax import Parallax
from mpidl.runtime.sync.pushpull import PushPull
from mpidl.runtime.sync.rowsparse import RowSparseAllgather

__all__ = ["BucketHook", "FusedAllreduce", "GradSync", "Parallax", "PerTensorCompressed",
           "PushPull", "RowSparseAllgather", "WorkerGroups"]

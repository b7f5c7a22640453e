"""Small helpers shared by the layers (not part of the public API)."""

import numpy as np

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu


def float_dtype(dtype):
    """``dtype`` as a NumPy float dtype, refusing anything but float32/float64."""
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    return dt


def as_input(x, dtype, like=None):
    """``x`` in the layer's dtype (integers and the other float width are cast) and on
    the device of ``like`` (a parameter), with its array module. Casting here keeps
    float64 data from silently promoting a float32 model (and running at half speed);
    moving here lets a host batch enter a GPU model."""
    xp = array_module(like if like is not None else x)
    if not hasattr(x, "dtype") or array_module(x) is not xp:
        x = xp.asarray(x)
    if x.dtype != dtype:
        x = x.astype(dtype)
    return x, xp


def pair(value, name):
    """An int or a pair of ints as an ``(h, w)`` tuple of non-negative ints."""
    if isinstance(value, (int, np.integer)):
        value = (int(value), int(value))
    value = tuple(int(v) for v in value)
    if len(value) != 2 or min(value) < 0:
        raise ValueError(f"{name} must be an int or a pair of non-negative ints, got {value}")
    return value


def shape_str(x):
    return str(tuple(int(d) for d in x.shape))


def colsum(a2):
    """Column sums of a tall ``(rows, C)`` matrix as a GEMV with a vector of ones: NumPy's
    own ``sum(axis=0)`` walks such a matrix row by row and is ~20x slower for C ~ 32."""
    if is_gpu_array(a2):
        return _fused_gpu.column_sums(a2)
    xp = array_module(a2)
    return xp.ones(a2.shape[0], dtype=a2.dtype) @ a2


def column_dot(a2, b2):
    """``sum_i a2[i, j] * b2[i, j]`` for each column j of two ``(rows, C)`` matrices."""
    if is_gpu_array(a2):
        return _fused_gpu.column_sums(a2, b2)
    return array_module(a2).einsum("ij,ij->j", a2, b2)

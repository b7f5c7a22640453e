"""Reduction operators: their names, MPI counterparts and the array functions that apply them.

``"mean"`` is a sum followed by one division by the number of ranks, so it needs a
floating dtype. float16 sums add in float16: NumPy and CuPy compute each ``a + b`` in
float32 and round the result once to float16 (24 >= 2*11 + 2 bits, so that is a correctly
rounded half-precision addition). So each of the p-1 additions of a reduction rounds once
to half precision: the error is at most about ``(p - 1) * 2**-11 * sum(|x_i|)`` (plus
overflow above 65504).

Reductions of the 2-byte formats are always mpidl's own (``own_reduction``): float16 and
bfloat16 words (``mpidl.bfloat16.BFLOAT16``: each addition in float32, rounded once to
bfloat16). MPI's MPIX_C_FLOAT16 is an extension some libraries lack (Open MPI 4.1 has
none), and no MPI knows bfloat16, so the communicator never hands these dtypes to MPI for
a reduction: ``algorithm="mpi"`` (or an ``auto`` choice of it) runs the ring instead. Data
movement (broadcast, all-gather) passes bytes and is fine.
"""

import numpy as np
from mpi4py import MPI

from mpidl import bfloat16

OPS = ("sum", "mean", "max", "min")

_MPI_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_UFUNC_NAMES = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}
# Kinds of dtype a reduction accepts: signed/unsigned ints, floats (bool and complex not).
_REDUCIBLE_KINDS = "iuf"


def own_reduction(dtype):
    """True for the dtypes mpidl always reduces itself (never through an MPI datatype):
    float16 and bfloat16 words."""
    return dtype == np.float16 or dtype == bfloat16.BFLOAT16


def check_op(op, dtype):
    """Raise a clear error unless ``op`` can reduce arrays of ``dtype``."""
    if op not in _MPI_OPS:
        raise ValueError(f"unknown reduction op {op!r}: expected one of {', '.join(OPS)}")
    if dtype == bfloat16.BFLOAT16:
        if op != "sum":
            raise TypeError(f"bfloat16 words reduce with op 'sum' only, got {op!r}")
        return
    if dtype.kind not in _REDUCIBLE_KINDS:
        raise TypeError(f"cannot reduce dtype {dtype} with op {op!r}: "
                        "reductions take integer or floating arrays")
    if op == "mean" and dtype.kind != "f":
        raise TypeError(f"op 'mean' needs a floating dtype, got {dtype}: "
                        "use op='sum' and divide, or cast to float first")


def mpi_op(op):
    """The MPI operation that implements ``op`` (``mean`` is SUM, divided afterwards)."""
    return _MPI_OPS[op]


_ufuncs = {}


def ufunc(xp, op):
    """The element-wise function of module ``xp`` (numpy or cupy) that combines two arrays."""
    fn = _ufuncs.get((xp, op))
    if fn is None:
        fn = _ufuncs[(xp, op)] = getattr(xp, _UFUNC_NAMES[op])
    return fn


_datatypes = {}


def mpi_datatype(dtype):
    """The predefined MPI datatype of a NumPy dtype (float16 is MPIX_C_FLOAT16)."""
    dt = _datatypes.get(dtype)
    if dt is None:
        try:
            dt = MPI.Datatype.fromcode(np.dtype(dtype).char)
        except Exception as exc:  # KeyError / ValueError across mpi4py versions
            raise TypeError(f"MPI has no datatype for {np.dtype(dtype)}") from exc
        _datatypes[dtype] = dt
    return dt


class Op:
    """A reduction as every algorithm receives it: the element-wise array function (NumPy
    or CuPy, for the home-made algorithms) and the MPI operation (for MPI's own call).

    Carrying both in one object gives every algorithm module the same signature, native.py
    included. ``name`` is the user's op (``"mean"`` reduces with ``fn = add`` and MPI.SUM;
    the communicator divides afterwards).
    """

    __slots__ = ("name", "fn", "mpi")

    def __init__(self, name, fn, mpi):
        self.name, self.fn, self.mpi = name, fn, mpi

    def __repr__(self):
        return f"<Op {self.name}>"


_op_objects = {}


def reduction(xp, op, dtype=None):
    """The (cached) ``Op`` of reduction ``op`` on arrays of module ``xp`` (and ``dtype``:
    bfloat16 words add with ``mpidl.bfloat16.add``; MPI has no operation for them)."""
    if dtype is not None and dtype == bfloat16.BFLOAT16:
        return _BF16_SUM
    obj = _op_objects.get((xp, op))
    if obj is None:
        obj = _op_objects[(xp, op)] = Op(op, ufunc(xp, op), _MPI_OPS[op])
    return obj


_BF16_SUM = Op("sum", bfloat16.add, None)

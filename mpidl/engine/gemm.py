"""Matrix products for the layers: NumPy's ``@`` on the host, cuBLAS called directly on a GPU.

Why not CuPy's ``@`` on a GPU: CuPy refuses every cuBLAS call while a stream is being
captured into a CUDA graph, and a training step is mostly matrix products. Calling
cuBLAS through its C interface (ctypes, the library CuPy itself loaded) lets a whole
step be captured (``mpidl.engine.cuda_graph``). It also pins the workspace cuBLAS has on
each stream (one per stream, set explicitly): cuBLAS picks its algorithm from the
workspace it is given, so a product gives the same bits on every stream, and an eager
step and its graph replay agree bit for bit.

Products are float32 with float32 accumulation (no TF32, as CuPy by default) or float64.
Operands may be C- or F-ordered 2-D views (a transpose costs nothing); other strides are
copied contiguous first. Anything else (other dtypes, mixed dtypes, other ranks) goes to
``@``.
"""

import ctypes
import functools

import numpy as np

from mpidl.backend import cupy_module, is_gpu_array

_OP_N, _OP_T = 0, 1
_TYPES = {np.dtype(np.float32): (0, 68), np.dtype(np.float64): (1, 70)}  # cudaDataType, compute
_CTYPES = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20


def matmul(a, b):
    """``a @ b``; on a GPU a new C-contiguous result from one cuBLAS GEMM."""
    if not is_gpu_array(a):
        return a @ b
    if (a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype or a.dtype not in _TYPES
            or not is_gpu_array(b)):
        return a @ b
    return _blas().gemm(a, b)


class CublasError(RuntimeError):
    pass


def _loaded_cublas_path():
    """The libcublas CuPy loaded, read from this process's memory map."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def _library():
    cp = cupy_module()
    cp.cuda.device.get_cublas_handle()  # CuPy loads its libcublas: ours is the same one
    candidates = [p for p in (_loaded_cublas_path(),) if p]
    candidates += ["libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise CublasError("cannot load libcublas (tried " + ", ".join(candidates) + ")")
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    if hasattr(lib, "cublasSetWorkspace_v2"):
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    return lib


def _check(status, what):
    if status != 0:
        raise CublasError(f"cuBLAS {what} failed with status {status}")


class _Blas:
    """One cuBLAS handle per device, bound to the current stream with that stream's
    own workspace."""

    def __init__(self):
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "create")
        self.stream = None
        self.workspaces = {}

    def _bind(self, cp):
        stream = cp.cuda.get_current_stream().ptr
        if stream == self.stream:
            return
        _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "setStream")
        if hasattr(self.lib, "cublasSetWorkspace_v2"):  # setStream resets it
            ws = self.workspaces.get(stream)
            if ws is None:
                ws = self.workspaces[stream] = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
            _check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(ws.data.ptr),
                                                  ws.nbytes), "setWorkspace")
        self.stream = stream

    def gemm(self, a, b):
        cp = cupy_module()
        m, k = a.shape
        n = b.shape[1]
        if b.shape[0] != k:
            raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not "
                             f"align")
        out = cp.empty((m, n), dtype=a.dtype)
        if m == 0 or n == 0:
            return out
        if k == 0:
            out.fill(0)
            return out
        a, lda, a_t = _operand(cp, a)
        b, ldb, b_t = _operand(cp, b)
        self._bind(cp)
        dtype_id, compute = _TYPES[a.dtype]
        one, zero = _CTYPES[a.dtype](1.0), _CTYPES[a.dtype](0.0)
        # row-major C = A B is column-major C^T = B^T A^T: B's memory first
        _check(self.lib.cublasGemmEx(
            self.handle, _OP_T if b_t else _OP_N, _OP_T if a_t else _OP_N, n, m, k,
            ctypes.byref(one), ctypes.c_void_p(b.data.ptr), dtype_id, ldb,
            ctypes.c_void_p(a.data.ptr), dtype_id, lda, ctypes.byref(zero),
            ctypes.c_void_p(out.data.ptr), dtype_id, n, compute, _GEMM_DEFAULT), "GemmEx")
        return out


def _operand(cp, x):
    """``(array, leading dimension, F-ordered?)`` of a 2-D operand, copying it
    contiguous when its strides fit neither order."""
    rows, cols = x.shape
    size = x.itemsize
    if x.flags.c_contiguous:
        return x, max(cols, 1), False
    if x.flags.f_contiguous:
        return x, max(rows, 1), True
    s0, s1 = x.strides
    if s1 == size and s0 % size == 0 and s0 // size >= cols:
        return x, s0 // size, False
    if s0 == size and s1 % size == 0 and s1 // size >= rows:
        return x, s1 // size, True
    return cp.ascontiguousarray(x), max(cols, 1), False


_handles = {}


def _blas():
    cp = cupy_module()
    device = cp.cuda.Device().id
    blas = _handles.get(device)
    if blas is None:
        blas = _handles[device] = _Blas()
    return blas

"""The one place that decides whether arrays are NumPy (CPU) or CuPy (GPU).

Everything else asks this module for the array module (``xp()``) or dispatches on an
array's type (``array_module(a)``); no other module picks NumPy or CuPy on its own.

The device is chosen by ``use("cpu" | "gpu")`` (the CLI's ``--device``) or by the
environment variable ``MPIDL_DEVICE``; CPU is the default. On GPU each rank binds to a
device by its node-local rank, so N ranks on a node with N GPUs use one GPU each.
"""

import os

import numpy as np

from mpidl import env

_DEVICES = ("cpu", "gpu")
_state = {"device": None, "gpu_id": None}


class BackendError(RuntimeError):
    """The requested backend cannot be used here (no CuPy, no GPU, ...)."""


def cupy_module():
    """Return the ``cupy`` module, or None when it is not importable."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency
    except Exception:  # ImportError, or a CUDA runtime that fails to load
        return None
    return cupy


def gpu_count():
    """Number of CUDA devices CuPy sees (0 without CuPy or a driver)."""
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def use(device=None, local_rank=None):
    """Select the backend: "cpu" (NumPy) or "gpu" (CuPy); returns the array module.

    ``device=None`` reads ``MPIDL_DEVICE`` (default "cpu"). On GPU, ``local_rank``
    (the rank's index among the ranks of its node) picks the device
    ``local_rank % gpu_count()``.
    """
    device = (device or env.get("MPIDL_DEVICE") or "cpu").lower()
    if device not in _DEVICES:
        raise BackendError(f"unknown device {device!r}: expected one of {', '.join(_DEVICES)}")
    if device == "gpu":
        cp = cupy_module()
        if cp is None:
            raise BackendError("device 'gpu' needs CuPy: pip install 'mpidl[gpu]' "
                               "(or the cupy-cudaXXx wheel matching your CUDA)")
        n = gpu_count()
        if n == 0:
            raise BackendError("device 'gpu' asked for, but CuPy sees no CUDA device "
                               "(check CUDA_VISIBLE_DEVICES and the driver)")
        gpu_id = (local_rank or 0) % n
        cp.cuda.Device(gpu_id).use()
        _state["gpu_id"] = gpu_id
    _state["device"] = device
    return xp()


def device():
    """The selected device name, "cpu" or "gpu" (selecting the default on first use)."""
    if _state["device"] is None:
        use()
    return _state["device"]


def gpu_id():
    """The CUDA device this rank is bound to, or None on CPU."""
    return _state["gpu_id"] if device() == "gpu" else None


def xp():
    """The array module of the selected backend: numpy or cupy."""
    return cupy_module() if device() == "gpu" else np


def is_gpu_array(a):
    """True for a CuPy array (checked without importing CuPy when it is not loaded)."""
    return type(a).__module__.startswith("cupy")


def array_module(a):
    """numpy or cupy, whichever owns ``a`` (for an array not in memory yet, a lazily built
    parameter: whichever it will be drawn into, its ``on_gpu``)."""
    if type(a) is np.ndarray:
        return np
    return cupy_module() if is_gpu_array(a) or getattr(a, "on_gpu", False) else np


def to_numpy(a):
    """A NumPy copy (or view) of ``a`` on the host."""
    if is_gpu_array(a):
        return a.get()
    return np.asarray(a)


def to_device(a, dtype=None):
    """``a`` as an array of the selected backend (a no-op when it already is one)."""
    mod = xp()
    if dtype is None:
        return mod.asarray(a)
    return mod.asarray(a, dtype=dtype)


def synchronize(a=None):
    """Wait for queued GPU work (on ``a``'s device, or the current one); no-op on CPU."""
    if (a is not None and is_gpu_array(a)) or (a is None and device() == "gpu"):
        cupy_module().cuda.get_current_stream().synchronize()


def loaded_mpi_library():
    """The path of the libmpi this process loaded, or None (not Linux, or linked
    statically)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi.so"):
                    return path
    except OSError:
        pass
    return None


def open_mpi_cuda_support():
    """Open MPI's own answer, ``MPIX_Query_cuda_support()`` (True/False), or None where
    the loaded library has no such call (MPICH, or an Open MPI built without its CUDA
    extension). Looked up in the library itself: mpi4py does not wrap it."""
    import ctypes  # noqa: PLC0415

    path = loaded_mpi_library()
    try:
        query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None) if path else None
    except OSError:
        return None
    if query is None:
        return None
    query.restype = ctypes.c_int
    return bool(query())


def cuda_aware_mpi():
    """Whether the MPI library can take device pointers directly.

    MPICH and Open MPI say so differently; ``MPIDL_CUDA_AWARE=0/1`` overrides the
    detection (useful on sites whose MPI is CUDA-aware but does not advertise it).
    """
    if env.get("MPIDL_CUDA_AWARE") is not None:
        return env.flag("MPIDL_CUDA_AWARE")
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except Exception:
        return False
    answer = open_mpi_cuda_support()
    if answer is not None:
        return answer
    try:  # MPI 4.1 info key (MPICH >= 4.1, Open MPI >= 5)
        info = MPI.INFO_ENV
        value = info.Get("mpi_memory_alloc_kinds") if info != MPI.INFO_NULL else None
        if value and ("cuda" in value or "system" == value):
            return "cuda" in value
    except Exception:
        pass
    return os.environ.get("MPIR_CVAR_ENABLE_GPU", "0") == "1" and os.environ.get(
        "MPIR_CVAR_CH4_GPU", "") != "0"

"""Quantization and sparse-packing kernels (installed as ``mpidl.kernels``).

Each kernel has a NumPy reference, a Numba CPU version and a CuPy GPU version; the
public function dispatches on the array's type.
"""

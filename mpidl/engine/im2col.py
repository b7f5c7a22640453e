"""Window extraction for convolution and pooling, vectorized over every pixel.

Layers keep NCHW as the logical layout but work on channels-last (NHWC) memory inside:
a window then spans ``kw * C`` contiguous floats, so ``im2col`` is one strided copy, the
convolution one GEMM whose result already is NHWC memory, and per-channel reductions
(BatchNorm) run over rows. The arrays layers return are NCHW views of NHWC memory;
NumPy and CuPy handle such views transparently.
"""

from mpidl.backend import array_module, is_gpu_array


def _as_strided(xp_arr, shape, strides):
    if is_gpu_array(xp_arr):
        from cupy.lib.stride_tricks import as_strided  # noqa: PLC0415
    else:
        from numpy.lib.stride_tricks import as_strided  # noqa: PLC0415
    return as_strided(xp_arr, shape=shape, strides=strides)


def output_size(size, kernel, stride, padding):
    return (size + 2 * padding - kernel) // stride + 1


def to_nhwc_padded(x, ph, pw, value=0.0):
    """The NCHW array ``x`` as a C-contiguous NHWC buffer padded by ``(ph, pw)`` with
    ``value``; no copy when ``x`` already is unpadded NHWC memory."""
    xp = array_module(x)
    n, c, h, w = x.shape
    xt = x.transpose(0, 2, 3, 1)
    if ph == 0 and pw == 0:
        return xt if xt.flags.c_contiguous else xp.ascontiguousarray(xt)
    buf = xp.empty((n, h + 2 * ph, w + 2 * pw, c), dtype=x.dtype)
    buf[:, :ph] = value
    buf[:, h + ph:] = value
    buf[:, ph:h + ph, :pw] = value
    buf[:, ph:h + ph, w + pw:] = value
    buf[:, ph:h + ph, pw:w + pw] = xt
    return buf


def windows(buf, kh, kw, sh, sw, ho, wo):
    """A read-only view ``(N, Ho, Wo, kh, kw, C)`` of every window of an NHWC buffer."""
    n, _, _, c = buf.shape
    s_n, s_h, s_w, s_c = buf.strides
    return _as_strided(buf, (n, ho, wo, kh, kw, c), (s_n, sh * s_h, sw * s_w, s_h, s_w, s_c))


def im2col(buf, kh, kw, sh, sw, ho, wo):
    """The windows of an NHWC buffer as a ``(N*Ho*Wo, kh*kw*C)`` matrix (one copy)."""
    n, _, _, c = buf.shape
    return windows(buf, kh, kw, sh, sw, ho, wo).reshape(n * ho * wo, kh * kw * c)


def offset_slice(i, j, sh, sw, ho, wo):
    """Index of the input pixels that kernel offset ``(i, j)`` sees, on an NHWC buffer:
    ``buf[offset_slice(...)]`` has shape ``(N, Ho, Wo, C)``."""
    return (slice(None), slice(i, i + sh * (ho - 1) + 1, sh),
            slice(j, j + sw * (wo - 1) + 1, sw), slice(None))

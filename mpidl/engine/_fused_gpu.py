"""Fused kernels for CuPy arrays: one launch where the NumPy-style sequence takes several.

On a GPU a small training step is mostly kernel launches, so every pass saved is time
saved. Each kernel here performs exactly the float operations of its NumPy sequence in
the same order and precision, compiled without FMA contraction (``--fmad=false``), so the
fused and unfused paths give bitwise the same results, as the CPU's Numba kernels in
``_fused`` do.

The learning rate of the SGD update is read either as a value or from a one-element
device array (``lr_ref``): the second form lets a captured CUDA graph follow a schedule
(``mpidl.engine.cuda_graph``), since values passed to a kernel are frozen into the graph.
"""

import functools

from mpidl.backend import cupy_module

_NO_FMA = ("--fmad=false",)

# False sends BatchNorm back to its array sequence (tests compare the two bit for bit)
enabled = True

_SGD_BODY = """
    T gi = g;
    if (use_wd) gi = gi + wd * p;
    if (use_mu) {
        T vi = mu * v + gi;
        v = vi;
        gi = nesterov ? gi + mu * vi : vi;
    }
    p = p - LR * gi;
"""


@functools.lru_cache(maxsize=None)
def _sgd_kernel(lr_on_device):
    cp = cupy_module()
    lr_param = "raw T lr_ref" if lr_on_device else "T lr"
    body = _SGD_BODY.replace("LR", "lr_ref[0]" if lr_on_device else "lr")
    return cp.ElementwiseKernel(
        f"T g, {lr_param}, T mu, T wd, bool use_wd, bool use_mu, bool nesterov",
        "T p, T v", body, "mpidl_sgd" + ("_lr_ref" if lr_on_device else ""),
        options=_NO_FMA)


def sgd(p, g, v, lr, mu, wd, nesterov, lr_ref=None):
    """In place: ``p`` and the momentum ``v`` (ignored, may be None, when mu == 0).

    The same operations as ``mpidl.engine._fused.sgd`` (PyTorch's formulation)."""
    t = p.dtype.type
    v_arg = v if v is not None else p  # never written when mu == 0
    if lr_ref is not None:
        _sgd_kernel(True)(g, lr_ref, t(mu), t(wd), wd != 0.0, mu != 0.0, bool(nesterov),
                          p, v_arg)
    else:
        _sgd_kernel(False)(g, t(lr), t(mu), t(wd), wd != 0.0, mu != 0.0, bool(nesterov),
                           p, v_arg)


# The SGD update of k tensors in one launch: every address is a kernel parameter (so a
# captured CUDA graph holds them, and no table has to be copied), block row y updates
# tensor y. The same operations, in the same order, as mpidl_sgd.
_SGD_MULTI_TEMPLATE = r"""
extern "C" __global__ void sgd_multi(PARAMS const T* lr_ref, T lr_value, T mu, T wd,
                                     int use_wd, int use_mu, int nesterov) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    T* p;
    const T* g;
    T* v;
    long long n;
    switch (blockIdx.y) {
CASES
        default: return;
    }
    if (i >= n) return;
    T lr = lr_ref ? lr_ref[0] : lr_value;
    T gi = g[i];
    if (use_wd) gi = gi + wd * p[i];
    if (use_mu) {
        T vi = mu * v[i] + gi;
        v[i] = vi;
        gi = nesterov ? gi + mu * vi : vi;
    }
    p[i] = p[i] - lr * gi;
}
"""
MULTI_TENSOR_MAX = 100  # 32 bytes of parameters per tensor: CUDA allows 4 KiB


@functools.lru_cache(maxsize=None)
def _sgd_multi_kernel(k, ctype):
    params = "".join(f"{ctype}* p{j}, const {ctype}* g{j}, {ctype}* v{j}, long long n{j}, "
                     for j in range(k))
    cases = "\n".join(f"        case {j}: p = p{j}; g = g{j}; v = v{j}; n = n{j}; break;"
                      for j in range(k))
    src = (_SGD_MULTI_TEMPLATE.replace("PARAMS", params).replace("CASES", cases)
           .replace("T*", f"{ctype}*").replace("T ", f"{ctype} ").replace("(T)", f"({ctype})"))
    return cupy_module().RawModule(code=src, options=_NO_FMA).get_function("sgd_multi")


def sgd_multi(triples, lr, mu, wd, nesterov, lr_ref=None):
    """In place, one launch: ``(p, g, v)`` flat contiguous arrays of one float dtype (``v``
    ignored when mu == 0), at most ``MULTI_TENSOR_MAX`` of them."""
    cp = cupy_module()
    dtype = triples[0][0].dtype
    t = dtype.type
    args = []
    for p, g, v in triples:
        args += [p, g, v if v is not None else p, cp.int64(p.size)]
    largest = max(p.size for p, _, _ in triples)
    fn = _sgd_multi_kernel(len(triples), "float" if dtype.itemsize == 4 else "double")
    fn(((largest + 255) // 256, len(triples)), (256,),
       tuple(args) + (lr_ref if lr_ref is not None else cp.uint64(0), t(lr), t(mu), t(wd),
                      cp.int32(wd != 0.0), cp.int32(mu != 0.0), cp.int32(bool(nesterov))))


@functools.lru_cache(maxsize=None)
def _adam_kernel():
    cp = cupy_module()
    return cp.ElementwiseKernel(
        "T g, T step_size, T b1, T c1, T b2, T c2, T inv_sqrt_bc2, T eps, T wd, bool use_wd, "
        "T decay, bool use_decay",
        "T p, T m, T v",
        """
        T gi = g;
        T pi = p;
        if (use_wd) gi = gi + wd * pi;
        if (use_decay) pi = pi * decay;
        T mi = b1 * m + gi * c1;
        m = mi;
        T vi = b2 * v + (gi * gi) * c2;
        v = vi;
        T denom = sqrt(vi) * inv_sqrt_bc2 + eps;
        p = pi - (mi / denom) * step_size;
        """, "mpidl_adam", options=_NO_FMA)


@functools.lru_cache(maxsize=None)
def _adam_ref_kernel():
    cp = cupy_module()
    return cp.ElementwiseKernel(
        "T g, raw T s, T b1, T c1, T b2, T c2, T eps, T wd, bool use_wd, bool use_decay",
        "T p, T m, T v",
        """
        T gi = g;
        T pi = p;
        if (use_wd) gi = gi + wd * pi;
        if (use_decay) pi = pi * s[2];
        T mi = b1 * m + gi * c1;
        m = mi;
        T vi = b2 * v + (gi * gi) * c2;
        v = vi;
        T denom = sqrt(vi) * s[1] + eps;
        p = pi - (mi / denom) * s[0];
        """, "mpidl_adam_ref", options=_NO_FMA)


def adam_ref(p, g, m, v, scalars, b1, b2, eps, wd, use_decay):
    """``adam`` with ``(step_size, inv_sqrt_bc2, decay)`` read from the device array
    ``scalars`` (a decay of exactly 1 multiplies by 1: the same bits as skipping it)."""
    t = p.dtype.type
    _adam_ref_kernel()(g, scalars, t(b1), t(1.0 - b1), t(b2), t(1.0 - b2), t(eps), t(wd),
                       wd != 0.0, bool(use_decay), p, m, v)


def adam(p, g, m, v, step_size, b1, b2, inv_sqrt_bc2, eps, wd, decay):
    """In place; the same operations as ``mpidl.engine._fused.adam``."""
    t = p.dtype.type
    _adam_kernel()(g, t(step_size), t(b1), t(1.0 - b1), t(b2), t(1.0 - b2), t(inv_sqrt_bc2),
                   t(eps), t(wd), wd != 0.0, t(decay), decay != 1.0, p, m, v)


def dense_alias(a):
    """A 1-D view of all of ``a``'s memory when ``a`` is a dense array in some axis order
    (such as the NCHW view of NHWC memory the conv layers return), else None.

    Element-wise work on such views is much faster flat: CuPy indexes a strided view
    with a division per axis per element, and gives a C-ordered result (a transposing
    copy the next layer undoes)."""
    if a.flags.c_contiguous:
        return a.reshape(-1)
    expect = a.itemsize
    for stride, n in sorted(zip(a.strides, a.shape)):
        if n == 1:
            continue
        if stride != expect:
            return None
        expect *= n
    return cupy_module().ndarray((a.size,), a.dtype, a.data)


def same_layout(flat, like):
    """``flat`` (a 1-D array of ``like.size``) seen with ``like``'s shape and strides."""
    return cupy_module().ndarray(like.shape, like.dtype, flat.data, strides=like.strides)


def relu_forward(x):
    """``max(x, 0)`` with ``x``'s memory layout (flat when ``x`` is dense)."""
    cp = cupy_module()
    flat = dense_alias(x)
    if flat is None:
        return cp.maximum(x, 0)
    return same_layout(cp.maximum(flat, 0), x)


def relu_inplace(x):
    """``x = max(x, 0)`` in place (flat when ``x`` is dense)."""
    cp = cupy_module()
    flat = dense_alias(x)
    cp.maximum(flat if flat is not None else x, 0, out=flat if flat is not None else x)
    return x


def copy(a):
    """A copy of ``a`` with its memory layout (flat when ``a`` is dense)."""
    flat = dense_alias(a)
    return a.copy() if flat is None else same_layout(flat.copy(), a)


def add(a, b):
    """``a + b`` for two arrays of one shape, keeping their layout when both are dense
    with the same strides (a residual block's two branches)."""
    if a.strides == b.strides and a.shape == b.shape and a.dtype == b.dtype:
        fa, fb = dense_alias(a), dense_alias(b)
        if fa is not None and fb is not None:
            return same_layout(fa + fb, a)
    return a + b


@functools.lru_cache(maxsize=None)
def _relu_backward_kernel():
    cp = cupy_module()
    return cp.ElementwiseKernel("T y", "T dy", "dy = dy * (y > (T)0 ? (T)1 : (T)0);",
                                "mpidl_relu_backward", options=_NO_FMA)


def relu_backward(dy, y):
    """``dy *= (y > 0)`` in one pass, without the boolean temporary (flat when both are
    dense with the same strides)."""
    if dy.strides == y.strides:
        fdy, fy = dense_alias(dy), dense_alias(y)
        if fdy is not None and fy is not None:
            _relu_backward_kernel()(fy, fdy)
            return dy
    _relu_backward_kernel()(y, dy)
    return dy


_COLUMN_SOURCE = r"""
// Per-column sums of a (rows, cols) C-contiguous matrix, or of its products with another:
// block (32, 8) sums 32 columns over one slice of rows, each thread a strided run of rows,
// then the 8 partial sums in a fixed order; one partial row per slice. The order of the
// additions depends only on the shape, so results are reproducible.
template <typename T>
__device__ void column_sums(const T* a, const T* b, int use_b, long long rows, long long cols,
                            long long rows_per_slice, T* out) {
    __shared__ T part[8][32];
    int tx = threadIdx.x, ty = threadIdx.y;
    long long c = (long long)blockIdx.x * 32 + tx;
    long long r0 = (long long)blockIdx.y * rows_per_slice;
    long long r1 = r0 + rows_per_slice < rows ? r0 + rows_per_slice : rows;
    T s = 0;
    if (c < cols) {
        for (long long r = r0 + ty; r < r1; r += 8) {
            T v = a[r * cols + c];
            if (use_b) v = v * b[r * cols + c];
            s += v;
        }
    }
    part[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < cols) {
        T t = part[0][tx];
        for (int k = 1; k < 8; ++k) t += part[k][tx];
        out[(long long)blockIdx.y * cols + c] = t;
    }
}

extern "C" __global__ void column_sums_f32(const float* a, const float* b, int use_b,
                                           long long rows, long long cols,
                                           long long rows_per_slice, float* out) {
    column_sums<float>(a, b, use_b, rows, cols, rows_per_slice, out);
}

extern "C" __global__ void column_sums_f64(const double* a, const double* b, int use_b,
                                           long long rows, long long cols,
                                           long long rows_per_slice, double* out) {
    column_sums<double>(a, b, use_b, rows, cols, rows_per_slice, out);
}
"""

_ROWS_PER_SLICE = 256


@functools.lru_cache(maxsize=None)
def _column_module():
    return cupy_module().RawModule(code=_COLUMN_SOURCE, options=_NO_FMA)


def _column_pass(a, b, rows_per_slice):
    cp = cupy_module()
    rows, cols = a.shape
    slices = max(1, -(-rows // rows_per_slice))
    out = cp.empty((slices, cols), dtype=a.dtype)
    fn = _column_module().get_function("column_sums_" + _suffix(a.dtype))
    fn(((cols + 31) // 32, slices), (32, 8),
       (a, b if b is not None else a, cp.int32(b is not None), cp.int64(rows),
        cp.int64(cols), cp.int64(rows_per_slice), out))
    return out


def column_sums(a2, b2=None):
    """Per column of a C-contiguous ``(rows, C)`` float matrix: the sum of its entries,
    or of their products with ``b2``'s. Two launches (slices of rows, then the slices'
    partial sums), in an order fixed by the shape; CuPy's reductions over axis 0 of such
    a tall matrix are slow, and its einsum calls cuBLAS, which a graph capture refuses."""
    cp = cupy_module()
    a2 = cp.ascontiguousarray(a2)
    if b2 is not None:
        b2 = cp.ascontiguousarray(b2)
    rows, cols = a2.shape
    if rows == 0 or cols == 0:
        return cp.zeros(cols, dtype=a2.dtype)
    partial = _column_pass(a2, b2, _ROWS_PER_SLICE)
    if partial.shape[0] > 1:
        partial = _column_pass(partial, None, partial.shape[0])
    return partial.reshape(cols)


_XENT_SOURCE = r"""
template <typename T>
__device__ void xent_rows(const T* logits, const long long* labels, long long n, int k,
                          T* probs, T* row_loss) {
    // one warp per row: max, sum of exp, then probabilities and the row's loss
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* z = logits + row * k;
    T* q = probs + row * k;
    T m = z[0];
    for (int j = lane; j < k; j += 32) m = z[j] > m ? z[j] : m;
    for (int o = 16; o > 0; o /= 2) {
        T other = __shfl_xor_sync(0xffffffff, m, o);
        m = other > m ? other : m;
    }
    T s = 0;
    for (int j = lane; j < k; j += 32) {
        T e = exp(z[j] - m);
        q[j] = e;
        s += e;
    }
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
    long long label = labels[row];
    if (lane == 0) row_loss[row] = log(s) - (z[label] - m);
    for (int j = lane; j < k; j += 32) q[j] = q[j] / s;
}

extern "C" __global__ void xent_forward_f32(const float* logits, const long long* labels,
                                            long long n, int k, float* probs,
                                            float* row_loss) {
    xent_rows<float>(logits, labels, n, k, probs, row_loss);
}

extern "C" __global__ void xent_forward_f64(const double* logits, const long long* labels,
                                            long long n, int k, double* probs,
                                            double* row_loss) {
    xent_rows<double>(logits, labels, n, k, probs, row_loss);
}

template <typename T>
__device__ void xent_grad(T* probs, const long long* labels, long long n, int k, T scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * k) return;
    long long row = i / k;
    T q = probs[i];
    if (labels[row] == i - row * k) q = q - (T)1;
    probs[i] = q * scale;
}

extern "C" __global__ void xent_backward_f32(float* probs, const long long* labels,
                                             long long n, int k, float scale) {
    xent_grad<float>(probs, labels, n, k, scale);
}

extern "C" __global__ void xent_backward_f64(double* probs, const long long* labels,
                                             long long n, int k, double scale) {
    xent_grad<double>(probs, labels, n, k, scale);
}
"""


@functools.lru_cache(maxsize=None)
def _xent_module():
    return cupy_module().RawModule(code=_XENT_SOURCE, options=_NO_FMA)


def _per_item(fn, count, args):
    """Run the RawKernel ``fn`` with one thread per item of ``count`` (none for 0)."""
    if count > 0:
        fn(((count + 255) // 256,), (256,), args)


def _suffix(dtype):
    return "f32" if dtype.itemsize == 4 else "f64"


def softmax_xent_forward(logits, labels):
    """Softmax probabilities ``(N, K)`` and the per-row losses ``(N,)`` of contiguous
    float logits and int64 labels (already checked to lie in [0, K)), in one launch."""
    cp = cupy_module()
    n, k = logits.shape
    logits = cp.ascontiguousarray(logits)
    probs = cp.empty_like(logits)
    row_loss = cp.empty(n, dtype=logits.dtype)
    rows_per_block = 8
    fn = _xent_module().get_function("xent_forward_" + _suffix(logits.dtype))
    fn(((n + rows_per_block - 1) // rows_per_block,), (32 * rows_per_block,),
       (logits, labels, cp.int64(n), cp.int32(k), probs, row_loss))
    return probs, row_loss


def softmax_xent_backward(probs, labels):
    """In place: ``probs`` becomes ``(probs - onehot(labels)) / N``, in one launch."""
    cp = cupy_module()
    n, k = probs.shape
    _per_item(_xent_module().get_function("xent_backward_" + _suffix(probs.dtype)), n * k,
              (probs, labels, cp.int64(n), cp.int32(k), probs.dtype.type(1.0 / n)))
    return probs


_POOL_SOURCE = r"""
// Max pooling on NHWC memory, one thread per output (forward) or input (backward) value.
// Windows are read in row-major order with padding as -inf; the first maximum wins and
// a NaN propagates, exactly as the array sequence of MaxPool2d does it.
// The coordinates (b, y, z, ch) of flat index t of an NHWC array of height h, width w and
// c channels.
__device__ __forceinline__ void nhwc_at(long long t, int h, int w, int c, long long* b,
                                        int* y, int* z, int* ch) {
    *ch = t % c;
    long long q = t / c;
    *z = q % w;
    q /= w;
    *y = q % h;
    *b = q / h;
}

// The output pixel (oh, ow) whose window lays kernel offset (i, j) on input pixel (y, z);
// false when there is none.
__device__ __forceinline__ bool window_of(int y, int z, int i, int j, int sh, int sw, int ph,
                                          int pw, int ho, int wo, int* oh, int* ow) {
    int ry = y + ph - i, rz = z + pw - j;
    if (ry < 0 || rz < 0 || ry % sh || rz % sw) return false;
    *oh = ry / sh;
    *ow = rz / sw;
    return *oh < ho && *ow < wo;
}

template <typename T>
__device__ void maxpool_fwd(const T* x, long long n, int h, int w, int c, int ho, int wo,
                            int kh, int kw, int sh, int sw, int ph, int pw, T* out,
                            unsigned char* idx) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * ho * wo * c) return;
    long long b;
    int oh, ow, ch;
    nhwc_at(t, ho, wo, c, &b, &oh, &ow, &ch);
    T best = 0;
    int arg = 0;
    for (int i = 0; i < kh; ++i) {
        for (int j = 0; j < kw; ++j) {
            int y = oh * sh + i - ph, z = ow * sw + j - pw;
            T v = (y >= 0 && y < h && z >= 0 && z < w) ? x[((b * h + y) * w + z) * c + ch]
                                                       : (T)__int_as_float(0xff800000);
            int o = i * kw + j;
            if (o == 0) {
                best = v;
            } else {
                if (v > best) arg = o;
                best = (isnan(best) || isnan(v)) ? (isnan(best) ? best : v)
                                                 : (v > best ? v : best);
            }
        }
    }
    out[t] = best;
    idx[t] = (unsigned char)arg;
}

template <typename T>
__device__ void maxpool_bwd(const T* dy, const unsigned char* idx, long long n, int h, int w,
                            int c, int ho, int wo, int kh, int kw, int sh, int sw, int ph,
                            int pw, int disjoint, T* dx) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * h * w * c) return;
    long long b;
    int y, z, ch, oh, ow;
    nhwc_at(t, h, w, c, &b, &y, &z, &ch);
    T acc = 0;
    for (int i = 0; i < kh; ++i) {          // offsets in order, as the array sequence adds
        for (int j = 0; j < kw; ++j) {
            if (!window_of(y, z, i, j, sh, sw, ph, pw, ho, wo, &oh, &ow)) continue;
            long long k = ((b * ho + oh) * wo + ow) * c + ch;
            if (disjoint) acc = dy[k] * (T)(idx[k] == i * kw + j);  // as the array path
            else if (idx[k] == i * kw + j) acc += dy[k];
        }
    }
    dx[t] = acc;
}

// col2im: the input gradient of a convolution from the gradient of its im2col matrix
// (rows N*Ho*Wo, columns (i, j, ch)); each input value sums its windows' entries in
// kernel-offset order.
template <typename T>
__device__ void col2im(const T* dcols, long long n, int h, int w, int c, int ho, int wo,
                       int kh, int kw, int sh, int sw, int ph, int pw, T* dx) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * h * w * c) return;
    long long b;
    int y, z, ch, oh, ow;
    nhwc_at(t, h, w, c, &b, &y, &z, &ch);
    long long width = (long long)kh * kw * c;
    T acc = 0;
    for (int i = 0; i < kh; ++i) {
        for (int j = 0; j < kw; ++j) {
            if (!window_of(y, z, i, j, sh, sw, ph, pw, ho, wo, &oh, &ow)) continue;
            acc += dcols[((b * ho + oh) * wo + ow) * width + (i * kw + j) * c + ch];
        }
    }
    dx[t] = acc;
}

#define POOL_KERNELS(T, S)                                                                  \
extern "C" __global__ void maxpool_forward_##S(const T* x, long long n, int h, int w, int c, \
        int ho, int wo, int kh, int kw, int sh, int sw, int ph, int pw, T* out,             \
        unsigned char* idx) {                                                               \
    maxpool_fwd<T>(x, n, h, w, c, ho, wo, kh, kw, sh, sw, ph, pw, out, idx);                \
}                                                                                           \
extern "C" __global__ void maxpool_backward_##S(const T* dy, const unsigned char* idx,      \
        long long n, int h, int w, int c, int ho, int wo, int kh, int kw, int sh, int sw,   \
        int ph, int pw, int disjoint, T* dx) {                                              \
    maxpool_bwd<T>(dy, idx, n, h, w, c, ho, wo, kh, kw, sh, sw, ph, pw, disjoint, dx);      \
}                                                                                           \
extern "C" __global__ void col2im_##S(const T* dcols, long long n, int h, int w, int c,     \
        int ho, int wo, int kh, int kw, int sh, int sw, int ph, int pw, T* dx) {            \
    col2im<T>(dcols, n, h, w, c, ho, wo, kh, kw, sh, sw, ph, pw, dx);                       \
}
POOL_KERNELS(float, f32)
POOL_KERNELS(double, f64)
"""


@functools.lru_cache(maxsize=None)
def _pool_module():
    return cupy_module().RawModule(code=_POOL_SOURCE, options=_NO_FMA)


def _pool_args(geometry):
    cp = cupy_module()
    return tuple(cp.int32(v) for v in geometry)


def maxpool_forward(x_nhwc, ho, wo, kernel, stride, padding):
    """Max pooling of a C-contiguous NHWC array: ``(out NHWC, idx uint8 NHWC)``, the index
    of each window's first maximum in row-major window order."""
    cp = cupy_module()
    n, h, w, c = x_nhwc.shape
    out = cp.empty((n, ho, wo, c), dtype=x_nhwc.dtype)
    idx = cp.empty((n, ho, wo, c), dtype=cp.uint8)
    _per_item(_pool_module().get_function("maxpool_forward_" + _suffix(x_nhwc.dtype)),
              out.size, (x_nhwc, cp.int64(n))
              + _pool_args((h, w, c, ho, wo) + kernel + stride + padding) + (out, idx))
    return out, idx


def maxpool_backward(dy_nhwc, idx, h, w, kernel, stride, padding):
    """The input gradient (C-contiguous NHWC) of ``maxpool_forward``: each input value
    gathers the gradients of the windows whose maximum it was, in window order (with
    disjoint windows, ``dy * (argmax == offset)``, signed zeros included, as MaxPool2d's
    array path writes it)."""
    cp = cupy_module()
    n, ho, wo, c = idx.shape
    dx = cp.empty((n, h, w, c), dtype=dy_nhwc.dtype)
    _per_item(_pool_module().get_function("maxpool_backward_" + _suffix(dy_nhwc.dtype)),
              dx.size, (cp.ascontiguousarray(dy_nhwc), idx, cp.int64(n))
              + _pool_args((h, w, c, ho, wo) + kernel + stride + padding
                           + (int(kernel == stride),)) + (dx,))
    return dx


def col2im(dcols, n, h, w, c, ho, wo, kernel, stride, padding):
    """The NHWC input gradient ``(n, h, w, c)`` of a convolution from the gradient of its
    C-contiguous im2col matrix ``(n*ho*wo, kh*kw*c)``, in one launch."""
    cp = cupy_module()
    dx = cp.empty((n, h, w, c), dtype=dcols.dtype)
    _per_item(_pool_module().get_function("col2im_" + _suffix(dcols.dtype)), dx.size,
              (dcols, cp.int64(n)) + _pool_args((h, w, c, ho, wo) + kernel + stride + padding)
              + (dx,))
    return dx


# ---------------------------------------------------------------- BatchNorm (training)
# The per-channel arithmetic and the pass over the activations of _BatchNorm, each in one
# launch, with the array sequence's roundings (scalars arrive in the array's dtype, as
# NumPy/CuPy cast Python floats).

@functools.lru_cache(maxsize=None)
def _bn_kernels():
    cp = cupy_module()
    channel_forward = cp.ElementwiseKernel(
        "T var, T mean, T gamma, T eps, T keep, T m, T unbiased_m, bool affine",
        "T inv_std, T scale, T running_mean, T running_var",
        """
        T inv = (T)1 / sqrt(var + eps);
        inv_std = inv;
        scale = affine ? gamma * inv : inv;
        running_mean = running_mean * keep;
        running_mean = running_mean + m * mean;
        running_var = running_var * keep;
        running_var = running_var + unbiased_m * var;
        """, "mpidl_bn_channel_forward", options=_NO_FMA)
    normalize = cp.ElementwiseKernel(
        "T xhat, T scale, T bias, bool has_bias", "T y",
        "T v = xhat * scale; y = has_bias ? v + bias : v;", "mpidl_bn_normalize",
        options=_NO_FMA)
    channel_backward = cp.ElementwiseKernel(
        "T dgamma, T dbeta, T inv_std, T gamma, T s, bool affine", "T k1, T t, T k2",
        "k1 = dgamma * (inv_std * s); t = dbeta * s; k2 = affine ? gamma * inv_std : inv_std;",
        "mpidl_bn_channel_backward", options=_NO_FMA)
    input_grad = cp.ElementwiseKernel(
        "T xhat, T k1, T t, T k2", "T dy",
        "T a = dy - t; T b = xhat * k1; dy = (a - b) * k2;", "mpidl_bn_input_grad",
        options=_NO_FMA)
    return channel_forward, normalize, channel_backward, input_grad


def batchnorm_forward(xhat, mean, var, gamma, bias, running_mean, running_var, eps, momentum,
                      count):
    """``(y, inv_std)`` of a training-mode BatchNorm given the batch statistics, and the
    running statistics moved in place: two launches."""
    cp = cupy_module()
    channel_forward, normalize, _, _ = _bn_kernels()
    t = xhat.dtype.type
    inv_std, scale = cp.empty_like(var), cp.empty_like(var)
    channel_forward(var, mean, gamma if gamma is not None else var, t(eps), t(1.0 - momentum),
                    t(momentum), t(momentum * count / (count - 1)), gamma is not None,
                    inv_std, scale, running_mean, running_var)
    y = normalize(xhat, scale, bias if bias is not None else scale, bias is not None)
    return y, inv_std


def batchnorm_input_grad(dy2, xhat, dgamma, dbeta, inv_std, gamma, count):
    """In place on ``dy2``: ``gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat))``
    in _BatchNorm.backward's roundings; two launches."""
    _, _, channel_backward, input_grad = _bn_kernels()
    t = dy2.dtype.type
    k1, shift, k2 = channel_backward(dgamma, dbeta, inv_std,
                                     gamma if gamma is not None else inv_std, t(1.0 / count),
                                     gamma is not None)
    input_grad(xhat, k1, shift, k2, dy2)
    return dy2

"""2-D convolution (cross-correlation, as in every DL framework) by im2col + GEMM."""

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu
from mpidl.engine._util import as_input, colsum, float_dtype, pair, shape_str
from mpidl.engine.gemm import matmul
from mpidl.engine.im2col import im2col, offset_slice, output_size, to_nhwc_padded
from mpidl.engine.init import initialize
from mpidl.engine.module import Layer, ShapeError


class Conv2d(Layer):
    """``y[n, f] = sum_c x[n, c] * weight[f, c] + bias[f]`` over ``kernel_size`` windows.

    ``weight`` has PyTorch's shape ``(out_channels, in_channels, kh, kw)``. Input and
    output are NCHW (logically; see ``mpidl.engine.im2col`` for the memory layout).
    Forward: im2col through a strided view, then one GEMM. Backward: ``dW`` is one GEMM
    with the cached columns; ``dx`` is one GEMM per kernel offset whose result is added
    into the strided input positions (kh*kw vectorized adds, no per-pixel loop).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 bias=True, init="he_uniform", rng=None, dtype="float32"):
        super().__init__()
        if in_channels < 1 or out_channels < 1:
            raise ValueError(f"Conv2d needs positive channel counts, got in_channels="
                             f"{in_channels}, out_channels={out_channels}")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.padding = pair(padding, "padding")
        if min(self.kernel_size) < 1 or min(self.stride) < 1:
            raise ValueError(f"Conv2d kernel_size and stride must be >= 1, got "
                             f"{self.kernel_size} and {self.stride}")
        self.dtype = float_dtype(dtype)
        kh, kw = self.kernel_size
        fan_in, fan_out = in_channels * kh * kw, out_channels * kh * kw
        self.weight = self.add_param("weight", initialize(
            init, (out_channels, in_channels, kh, kw), fan_in, fan_out, rng, self.dtype))
        self.bias = None
        if bias:
            self.bias = self.add_param("bias", initialize(
                "zeros", (out_channels,), fan_in, fan_out, rng, self.dtype))

    def _out_shape(self, x):
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ShapeError(f"Conv2d expects input (N, {self.in_channels}, H, W), got shape "
                             f"{shape_str(x)}")
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        n, _, h, w = x.shape
        ho, wo = output_size(h, kh, sh, ph), output_size(w, kw, sw, pw)
        if ho < 1 or wo < 1:
            raise ShapeError(f"Conv2d kernel {self.kernel_size} with padding {self.padding} "
                             f"does not fit a {h}x{w} input (input shape {shape_str(x)})")
        return n, ho, wo

    def forward(self, x):
        x, xp = as_input(x, self.dtype, self.weight.data)
        n, ho, wo = self._out_shape(x)
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        f, c = self.out_channels, self.in_channels
        buf = to_nhwc_padded(x, ph, pw)
        wmat = self.weight.data.transpose(2, 3, 1, 0).reshape(kh * kw * c, f)
        if c == 1 and not is_gpu_array(x):
            # One input channel (grey images): a window row is only kw floats, too short
            # for a fast strided copy. Build the transposed matrix instead, one contiguous
            # row per kernel offset; the GEMMs take it transposed at no cost.
            cols_t = xp.empty((kh * kw, n * ho * wo), dtype=x.dtype)
            for o, (i, j) in enumerate((i, j) for i in range(kh) for j in range(kw)):
                cols_t[o].reshape(n, ho, wo)[...] = buf[offset_slice(i, j, sh, sw, ho, wo)][..., 0]
            cols = cols_t.T
        else:
            cols = im2col(buf, kh, kw, sh, sw, ho, wo)  # (N*Ho*Wo, kh*kw*C)
        y = matmul(cols, wmat)
        if self.bias is not None:
            y += self.bias.data
        self.save_for_backward(cols, x.shape, (n, ho, wo))
        return y.reshape(n, ho, wo, f).transpose(0, 3, 1, 2)

    def backward(self, dy):
        cols, xshape, (n, ho, wo) = self.saved_for_backward()
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        f, c = self.out_channels, self.in_channels
        dy2 = dy.transpose(0, 2, 3, 1).reshape(n * ho * wo, f)  # free for NHWC memory
        gw = matmul(cols.T, dy2)  # (kh*kw*C, F)
        gw = gw.reshape(kh, kw, c, f).transpose(3, 2, 0, 1)
        # a first gradient must be contiguous (optimizers and fusion take it flat); a
        # later one is added in place straight from the transposed view
        self.weight.accumulate(gw.copy() if self.weight.grad is None else gw)
        if self.bias is not None:
            self.bias.accumulate(colsum(dy2))
        if not self.needs_input_grad:
            return None
        xp = array_module(dy)
        _, _, h, w = xshape
        if is_gpu_array(dy):
            # one GEMM for every kernel offset, then one gather kernel
            wmat = self.weight.data.transpose(2, 3, 1, 0).reshape(kh * kw * c, f)
            dcols = matmul(dy2, wmat.T)
            dx = _fused_gpu.col2im(dcols, n, h, w, c, ho, wo, self.kernel_size, self.stride,
                                   self.padding)
            return dx.transpose(0, 3, 1, 2)
        dbuf = xp.zeros((n, h + 2 * ph, w + 2 * pw, c), dtype=dy.dtype)
        wk = xp.ascontiguousarray(self.weight.data.transpose(2, 3, 0, 1))  # (kh, kw, F, C)
        for i in range(kh):
            for j in range(kw):
                part = matmul(dy2, wk[i, j]).reshape(n, ho, wo, c)
                dbuf[offset_slice(i, j, sh, sw, ho, wo)] += part
        return dbuf[:, ph:ph + h, pw:pw + w].transpose(0, 3, 1, 2)

    def __repr__(self):
        extra = ""
        if self.stride != (1, 1):
            extra += f", stride={self.stride}"
        if self.padding != (0, 0):
            extra += f", padding={self.padding}"
        if self.bias is None:
            extra += ", bias=False"
        return (f"Conv2d({self.in_channels}, {self.out_channels}, "
                f"kernel_size={self.kernel_size}{extra})")

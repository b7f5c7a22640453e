"""Max and average pooling over 2-D windows, and global average pooling.

Each pooling layer loops over the kh*kw kernel offsets; every step is one vectorized
operation over all pixels of the batch (see ``mpidl.engine.im2col`` for the layout).
"""

from mpidl.backend import array_module, is_gpu_array
from mpidl.engine import _fused_gpu
from mpidl.engine._util import pair, shape_str
from mpidl.engine.im2col import offset_slice, output_size, to_nhwc_padded
from mpidl.engine.module import Layer, ShapeError


class _Pool2d(Layer):
    kind = "Pool2d"

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride if stride is not None else kernel_size, "stride")
        self.padding = pair(padding, "padding")
        if min(self.kernel_size) < 1 or min(self.stride) < 1:
            raise ValueError(f"{self.kind} kernel_size and stride must be >= 1, got "
                             f"{self.kernel_size} and {self.stride}")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"{self.kind} padding {self.padding} must be at most half the "
                             f"kernel size {self.kernel_size}")

    def _geometry(self, x):
        if x.ndim != 4:
            raise ShapeError(f"{self.kind} expects input (N, C, H, W), got shape {shape_str(x)}")
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        h, w = x.shape[2], x.shape[3]
        ho, wo = output_size(h, kh, sh, ph), output_size(w, kw, sw, pw)
        if ho < 1 or wo < 1:
            raise ShapeError(f"{self.kind} kernel {self.kernel_size} does not fit a {h}x{w} "
                             f"input (input shape {shape_str(x)})")
        return ho, wo

    def _offsets(self):
        kh, kw = self.kernel_size
        return [(i, j) for i in range(kh) for j in range(kw)]

    def __repr__(self):
        extra = f", stride={self.stride}" if self.stride != self.kernel_size else ""
        extra += f", padding={self.padding}" if self.padding != (0, 0) else ""
        return f"{self.kind}(kernel_size={self.kernel_size}{extra})"


class MaxPool2d(_Pool2d):
    """Maximum over each window; padding counts as -inf. Ties go to the first maximum
    in row-major window order (its index is kept per output as a uint8)."""

    kind = "MaxPool2d"

    def forward(self, x):
        xp = array_module(x)
        ho, wo = self._geometry(x)
        (sh, sw), (ph, pw) = self.stride, self.padding
        if is_gpu_array(x) and len(self._offsets()) < 256 and x.dtype.kind == "f":
            # one kernel instead of five array operations per window offset
            best, idx = _fused_gpu.maxpool_forward(to_nhwc_padded(x, 0, 0), ho, wo,
                                                   self.kernel_size, self.stride, self.padding)
            self.save_for_backward(idx, None, x.shape)
            return best.transpose(0, 3, 1, 2)
        buf = to_nhwc_padded(x, ph, pw, value=-float("inf"))
        best = idx = None
        for o, (i, j) in enumerate(self._offsets()):
            s = buf[offset_slice(i, j, sh, sw, ho, wo)]
            if best is None:
                best = s.copy()
                idx = xp.zeros(best.shape, dtype=xp.uint8 if len(self._offsets()) < 256
                               else xp.int32)
            else:
                better = s > best
                xp.maximum(best, s, out=best)
                # idx = where(better, o, idx), as two cheap passes: every index stored so
                # far is < o, so the maximum picks o exactly where this offset wins.
                won = better.astype(idx.dtype)
                won *= o
                xp.maximum(idx, won, out=idx)
        self.save_for_backward(idx, buf.shape, x.shape)
        return best.transpose(0, 3, 1, 2)

    def backward(self, dy):
        idx, padded_shape, (_, _, h, w) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        if padded_shape is None:  # the GPU kernel's forward
            dx = _fused_gpu.maxpool_backward(dy.transpose(0, 2, 3, 1), idx, h, w,
                                             self.kernel_size, self.stride, self.padding)
            return dx.transpose(0, 3, 1, 2)
        n, hp, wp, c = padded_shape
        xp = array_module(dy)
        (sh, sw), (ph, pw) = self.stride, self.padding
        ho, wo = idx.shape[1], idx.shape[2]
        dyt = dy.transpose(0, 2, 3, 1)
        dbuf = xp.zeros((n, hp, wp, c), dtype=dy.dtype)
        disjoint = self.stride == self.kernel_size
        for o, (i, j) in enumerate(self._offsets()):
            target = dbuf[offset_slice(i, j, sh, sw, ho, wo)]
            if disjoint:  # windows do not overlap: write, don't accumulate
                xp.multiply(dyt, idx == o, out=target)
            else:
                target += dyt * (idx == o)
        return dbuf[:, ph:ph + h, pw:pw + w].transpose(0, 3, 1, 2)


class AvgPool2d(_Pool2d):
    """Mean over each window; padded zeros count in the mean (PyTorch's default
    ``count_include_pad=True``)."""

    kind = "AvgPool2d"

    def forward(self, x):
        ho, wo = self._geometry(x)
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        buf = to_nhwc_padded(x, ph, pw)
        acc = None
        for i, j in self._offsets():
            s = buf[offset_slice(i, j, sh, sw, ho, wo)]
            if acc is None:
                acc = s.copy()
            else:
                acc += s
        acc *= 1.0 / (kh * kw)
        self.save_for_backward(buf.shape, x.shape)
        return acc.transpose(0, 3, 1, 2)

    def backward(self, dy):
        (n, hp, wp, c), (_, _, h, w) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        xp = array_module(dy)
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        ho, wo = dy.shape[2], dy.shape[3]
        share = dy.transpose(0, 2, 3, 1) * (1.0 / (kh * kw))
        dbuf = xp.zeros((n, hp, wp, c), dtype=dy.dtype)
        for i, j in self._offsets():
            dbuf[offset_slice(i, j, sh, sw, ho, wo)] += share
        return dbuf[:, ph:ph + h, pw:pw + w].transpose(0, 3, 1, 2)


class GlobalAvgPool2d(Layer):
    """Mean over all pixels of each channel: ``(N, C, H, W) -> (N, C)``."""

    def forward(self, x):
        if x.ndim != 4:
            raise ShapeError(f"GlobalAvgPool2d expects input (N, C, H, W), got shape "
                             f"{shape_str(x)}")
        self.save_for_backward(x.shape)
        return x.mean(axis=(2, 3))

    def backward(self, dy):
        ((n, c, h, w),) = self.saved_for_backward()
        if not self.needs_input_grad:
            return None
        xp = array_module(dy)
        dx = xp.empty((n, h, w, c), dtype=dy.dtype)  # NHWC memory, like the conv layers
        dx[...] = (dy * (1.0 / (h * w)))[:, None, None, :]
        return dx.transpose(0, 3, 1, 2)

    def __repr__(self):
        return "GlobalAvgPool2d()"

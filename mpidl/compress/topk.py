"""Top-k sparsification: send the k largest-magnitude entries (indices delta-packed, values
float32), keep the rest in the error-feedback residual."""

from mpidl.kernels import topk_exact

from .sparse import SparseCompressor, check_ratio, density_count


class TopKCompressor(SparseCompressor):
    """``ratio``: the fraction of entries sent (0.001 keeps 0.1 %)."""

    name = "topk"
    default_memory = "residual"

    def __init__(self, ratio=0.01):
        self.ratio = check_ratio(ratio, "topk")

    def sparsify(self, flat, name):
        return topk_exact(flat, density_count(self.ratio, flat.size))

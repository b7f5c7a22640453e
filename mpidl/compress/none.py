"""No compression: the gradient itself is the payload (summable: plain allreduce)."""

from .base import Compressor, check_payload, ctx_of, restore


class NoneCompressor(Compressor):
    """The baseline: sends the gradient as it is."""

    name = "none"
    summable = True
    granularity = "bucket"

    def compress(self, tensor, name):
        return [tensor.reshape(-1)], ctx_of(tensor)

    def decompress(self, payload, ctx):
        check_payload(payload, [ctx.dtype], "none")
        if payload[0].size != ctx.n:
            from mpidl.kernels import PayloadError  # noqa: PLC0415

            raise PayloadError(f"none payload has {payload[0].size} elements, expected "
                               f"{ctx.n}")
        return restore(payload[0], ctx)

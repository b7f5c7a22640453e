"""Where a parameter lives across the processes of a mesh.

A strategy reads ``Parameter.placement`` to know what to do with a tensor: average a
*replicated* one over its axis (data parallelism), leave a *sharded* one's slices where
they are (tensor parallelism: this rank holds slice ``index`` of ``count`` along ``dim``),
or keep an *owned* one on a single rank (pipeline stages, ZeRO's owner of an update). The
layers never read it; it is a label that parallel runtimes agree on, so it is a small
immutable value with a readable repr, checked when made.
"""

from dataclasses import dataclass

KINDS = ("replicated", "sharded", "owned")


def _check_int(what, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Placement {what} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class Placement:
    """``kind`` over mesh axis ``axis``: see ``replicated``, ``sharded`` and ``owned``."""

    kind: str = "replicated"
    axis: str = "dp"
    dim: int = None
    index: int = None
    count: int = None
    rank: int = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Placement kind must be one of {', '.join(KINDS)}, got "
                             f"{self.kind!r}")
        if not isinstance(self.axis, str) or not self.axis:
            raise ValueError(f"Placement axis must be a mesh axis name such as 'dp' or 'tp', "
                             f"got {self.axis!r}")
        given = {k: getattr(self, k) for k in ("dim", "index", "count", "rank")
                 if getattr(self, k) is not None}
        allowed = {"replicated": (), "sharded": ("dim", "index", "count"),
                   "owned": ("rank",)}[self.kind]
        extra = sorted(set(given) - set(allowed))
        if extra:
            raise ValueError(f"a {self.kind} Placement takes no {', '.join(extra)} "
                             f"(got {given}); use Placement.{self.kind}(...)")
        if self.kind == "sharded":
            for what, low in (("dim", 0), ("count", 1), ("index", 0)):
                _check_int(what, getattr(self, what), low)
            if self.index >= self.count:
                raise ValueError(f"Placement shard index must be < count, got index "
                                 f"{self.index} of count {self.count}")
        elif self.kind == "owned":
            _check_int("rank", self.rank, 0)

    @classmethod
    def replicated(cls, axis="dp"):
        """Every rank of ``axis`` holds the whole tensor (its gradient is averaged there)."""
        return cls("replicated", axis)

    @classmethod
    def sharded(cls, axis, dim, index, count):
        """This rank of ``axis`` holds slice ``index`` of ``count`` equal slices along
        array dimension ``dim``."""
        return cls("sharded", axis, dim=dim, index=index, count=count)

    @classmethod
    def owned(cls, rank, axis="world"):
        """Only rank ``rank`` of ``axis`` (a group's rank numbering) holds the tensor."""
        return cls("owned", axis, rank=rank)

    def check_shape(self, shape, name="parameter"):
        """Raise unless a tensor of ``shape`` can carry this placement (a sharded ``dim``
        must exist)."""
        if self.kind == "sharded" and self.dim >= len(shape):
            raise ValueError(f"{name}: {self!r} shards dimension {self.dim}, but the tensor "
                             f"has shape {tuple(shape)}")

    def __repr__(self):
        if self.kind == "replicated":
            return f"Placement.replicated({self.axis!r})"
        if self.kind == "sharded":
            return (f"Placement.sharded({self.axis!r}, dim={self.dim}, index={self.index}, "
                    f"count={self.count})")
        return f"Placement.owned({self.rank}, axis={self.axis!r})"


REPLICATED_DP = Placement.replicated("dp")

"""Compressed gradient exchange: compressors, memories (error feedback), the exchanger.

    from mpidl.compress import make_compressor, Exchanger
    compressor = make_compressor("topk", ratio=0.001)      # error feedback attached
    exchanger = Exchanger(comm, compressor)
    grad = exchanger.exchange(grad, "0.weight")            # the mean over the ranks
    exchanger.bytes_sent                                   # per rank, cumulative

One module per algorithm:

=========  =============================================  ==========  ================
name       what travels                                   summable    default memory
=========  =============================================  ==========  ================
none       the gradient                                   yes         -
fp16       the gradient in float16                        yes         -
onebit     1 sign bit per entry + 2 means per chunk       no          momentum + EF
threshold  entries with |v| > tau, as +-tau (Strom)       no          error feedback
topk       the k largest |v| (indices + values)           no          error feedback
dgc        sampled-threshold top-k (DGC)                  no          momentum + EF,
                                                                      masking
randomk    k values at shared random indices              yes         -
qsgd       stochastic levels per bucket (4 bits at 7)     no          -
terngrad   -s / 0 / +s per entry (2 bits)                 no          -
powersgd   rank-r factors P, Q (two all-reduces)          (own)       its own EF
=========  =============================================  ==========  ================
"""

import inspect

from .base import Compressor, Ctx, Memory
from .dgc import DGCCompressor
from .exchange import Exchanger
from .memory import DGCMemory, MomentumMemory, ResidualMemory
from .fp16 import FP16Compressor
from .none import NoneCompressor
from .onebit import OneBitCompressor
from .powersgd import PowerSGDCompressor
from .qsgd import QSGDCompressor
from .randomk import RandomKCompressor
from .terngrad import TernGradCompressor
from .threshold import ThresholdCompressor
from .topk import TopKCompressor

COMPRESSORS = {c.name: c for c in (
    NoneCompressor, FP16Compressor, OneBitCompressor, ThresholdCompressor, TopKCompressor,
    DGCCompressor, RandomKCompressor, QSGDCompressor, TernGradCompressor, PowerSGDCompressor)}
MEMORIES = ("default", "none", "residual", "momentum", "dgc")


def _params(cls):
    """The keyword parameters a compressor class takes."""
    if cls.__init__ is object.__init__:
        return []
    sig = inspect.signature(cls.__init__)
    return [name for name, p in sig.parameters.items() if name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _value(text):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_spec(spec):
    """``"dgc:momentum=0.9,warmup_steps=200"`` -> ("dgc", {"momentum": 0.9, ...}).

    How a command line passes a compressor's parameters in one string."""
    name, _, rest = str(spec).partition(":")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"compressor spec {spec!r}: expected name:key=value,... "
                             f"(got {item!r})")
        params[key.strip()] = _value(value)
    return name.strip(), params


def make_compressor(name, memory="default", **params):
    """A compressor by name, with its memory attached as ``compressor.memory``.

    Memories that apply momentum ("momentum", "dgc"; see ``memory``) need the optimizer
    without it: ``Exchanger.adopt_momentum(optimizer)`` hands it over.

    ``params`` are the compressor's own (``ratio`` for topk/dgc/randomk, ``chunk`` for
    onebit, ``levels``/``bucket`` for qsgd, ...); the name may carry more of them as
    ``"qsgd:levels=15,bucket=128"`` (keywords given here win); ``momentum`` sets the
    factor of a momentum-correcting memory ("topk:memory=dgc,momentum=0.9"). ``memory``:
    "default"
    (the algorithm's usual one, see the table above), "none", "residual" (error
    feedback), "momentum" (momentum correction + error feedback), "dgc" (the same with
    momentum factor masking), or a Memory instance; also accepted in the spec. Unknown names and
    parameters raise ValueError / TypeError saying what is accepted; bad values raise
    ValueError.
    """
    name, spec_params = parse_spec(name)
    params = {**spec_params, **params}
    if "memory" in spec_params and memory == "default":
        memory = params.pop("memory")
    params.pop("memory", None)
    key = name.lower()
    cls = COMPRESSORS.get(key)
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}: choose one of "
                         f"{', '.join(COMPRESSORS)}")
    allowed = _params(cls)
    # "momentum" configures a momentum-correcting memory for any compressor
    momentum = params.pop("momentum", None) if "momentum" not in allowed else None
    for p in params:
        if p not in allowed:
            takes = f"its parameters are {', '.join(allowed)}" if allowed else \
                "it takes no parameters"
            raise TypeError(f"compressor {key!r} has no parameter {p!r}: {takes}")
    compressor = cls(**params)
    compressor.memory = _make_memory(memory, compressor, momentum)
    if momentum is not None and not isinstance(compressor.memory, MomentumMemory):
        raise TypeError(f"compressor {key!r}: momentum needs memory 'momentum' or 'dgc', "
                        f"not {memory!r}")
    return compressor


def build_compression(spec, ratio=None, optimizer=None):
    """The one place a command line's ``--compression SPEC [--ratio R]`` becomes a
    compressor with its memory, the same under every strategy; None for no compression.

    ``optimizer``: the optimizer that applies the exchanged gradients (on every rank that
    has one: data-parallel ranks, parameter servers). A memory that applies momentum
    before compressing (onebit, dgc: momentum correction) takes the optimizer's momentum
    over, and the optimizer's is set to 0, so momentum is applied exactly once whoever
    runs the optimizer. Bad names, parameters or ratios raise ``ValueError`` saying what
    is accepted (the command line turns it into one line).
    """
    if spec in (None, "", "none") and ratio is None:
        return None
    if spec in (None, ""):
        raise ValueError("--ratio is a compression setting: give --compression too "
                         "(e.g. --compression topk --ratio 0.01)")
    kw = {} if ratio is None else {"ratio": ratio}
    try:
        compressor = make_compressor(spec, **kw)
    except TypeError as e:
        raise ValueError(str(e)) from None
    memory = compressor.memory
    if optimizer is not None and memory is not None:
        memory.adopt_momentum(optimizer)
    return compressor


def _make_memory(memory, compressor, momentum=None):
    if isinstance(memory, Memory) or memory is None:
        return memory
    if memory not in MEMORIES:
        raise ValueError(f"unknown memory {memory!r}: choose one of {', '.join(MEMORIES)} "
                         f"(or pass a Memory)")
    if memory == "default":
        memory = getattr(compressor, "default_memory", "none")
    if memory == "none":
        return None
    if memory == "residual":
        return ResidualMemory()
    if momentum is None:
        momentum = getattr(compressor, "momentum", None)
    clip = getattr(compressor, "clip", None) if isinstance(compressor, DGCCompressor) else None
    if memory == "momentum":
        return MomentumMemory(momentum=momentum, clip=clip)
    return DGCMemory(momentum=momentum, clip=clip)


__all__ = ["COMPRESSORS", "Compressor", "Ctx", "DGCCompressor", "DGCMemory", "Exchanger",
           "FP16Compressor", "MEMORIES", "Memory", "MomentumMemory", "NoneCompressor", "OneBitCompressor",
           "PowerSGDCompressor", "QSGDCompressor", "RandomKCompressor", "ResidualMemory",
           "TernGradCompressor", "ThresholdCompressor", "TopKCompressor", "build_compression",
           "make_compressor",
           "parse_spec"]

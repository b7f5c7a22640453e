"""The parameter server: sharded servers hold the parameters and the optimizer, workers
push gradients and pull parameters (sync, async/Downpour, SSP, backup workers).

``sharding`` decides which server holds which tensor, ``protocol`` is the wire format and
the non-spinning wait, ``modes`` decides when a push is applied and answered, ``server``
and ``worker`` are the two sides. ``mpidl.runtime`` plugs them into
the trainer as ``--strategy ps`` (``runtime.sync.pushpull``, ``runtime.server``).
"""

from mpidl.ps.modes import MODES, ModeConfig
from mpidl.ps.protocol import PSError
from mpidl.ps.server import ParameterServer, ServerStats
from mpidl.ps.sharding import ShardLayout, shard_parameters
from mpidl.ps.worker import PSWorker

__all__ = ["MODES", "ModeConfig", "PSError", "ParameterServer", "ServerStats",
           "ShardLayout", "shard_parameters", "PSWorker"]

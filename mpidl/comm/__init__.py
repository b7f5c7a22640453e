"""The communicator layer: collectives over mpi4py with selectable algorithms.

``Communicator`` (communicator.py) is the entry point. One module per idea:
ring.py, tree.py, recursive_doubling.py, native.py (the algorithms), auto.py (choosing
one by size and p, tuning file), progress.py (handles, progress thread), consistency.py
(ranks agree on what they reduce), timeline.py (Chrome trace), buffers.py and
transport.py (persistent scratch, pinned staging, how GPU memory meets MPI),
layout.py (how a buffer is split into chunks), ops.py (reduction operators).
"""

from .communicator import ALGORITHMS, CHECK_MODES, Communicator
from .consistency import CollectiveMismatchError
from .layout import even_split
from .ops import OPS
from .progress import Handle

__all__ = ["ALGORITHMS", "CHECK_MODES", "OPS", "CollectiveMismatchError", "Communicator",
           "Handle", "even_split"]

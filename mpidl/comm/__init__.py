"""The communicator layer: collectives, point-to-point and process groups over mpi4py.

``Communicator`` (communicator.py) is the entry point: collectives with selectable
algorithms, tagged point-to-point messages (p2p.py) and traffic counters (counters.py).
``Mesh`` (mesh.py) splits the world into named groups (dp, pp, tp axes and roles such
as parameter servers), each a full ``Communicator``.

One module per idea: ring.py, tree.py, recursive_doubling.py, hierarchical.py, shared.py
(memory the ranks of a node share), native.py (the algorithms,
one signature per collective kind, registered in algorithms.py: adding one is a module
plus a registry line), auto.py (choosing one by size and p, tuning file), progress.py
(handles, lazily started progress thread), consistency.py (ranks agree on what they
reduce), timeline.py (Chrome trace), buffers.py and transport.py (persistent scratch,
pinned staging, how GPU memory meets MPI, send counting), layout.py (how a buffer is
split into chunks), ops.py (reduction operators).
"""

from . import algorithms
from .communicator import ALGORITHMS, CHECK_MODES, Communicator
from .consistency import CollectiveMismatchError
from .layout import even_split
from .mesh import Mesh
from .ops import OPS
from .p2p import Request
from .progress import Handle
from .transport import ANY_SOURCE, ANY_TAG

__all__ = ["ALGORITHMS", "ANY_SOURCE", "ANY_TAG", "CHECK_MODES", "OPS",
           "CollectiveMismatchError", "Communicator", "Handle", "Mesh", "Request",
           "algorithms", "even_split"]

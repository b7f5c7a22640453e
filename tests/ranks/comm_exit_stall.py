"""Rank 0 issues a non-blocking allreduce no other rank joins, then every rank exits
without closing the communicator: the exit must not hang (MPIDL_EXIT_TIMEOUT)."""

import numpy as np

from mpidl.comm import Communicator

comm = Communicator()
if comm.rank == 0:
    comm.iallreduce(np.ones(4), name="orphan")
print(f"rank {comm.rank} exiting", flush=True)

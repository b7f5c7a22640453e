"""A correct program with a straggler: rank 2 computes 4 s before the last reduce, while
rank 1 (not the root) leaves that reduce at once and waits in close()'s signature check.
The stall inspector (1 s warning) must name rank 2 as not arrived and rank 1 as past
the call — and must not take the two for a mismatch: the run finishes."""

import sys
import time

import numpy as np

from mpidl.comm import Communicator

alg = sys.argv[1]
comm = Communicator()
x = np.ones(8)
for i in range(1, 257):
    if i == 256 and comm.rank == 2:
        time.sleep(4)
    comm.reduce(x, root=0, name="metrics", algorithm=alg)
comm.close()
print(f"rank {comm.rank} done", flush=True)

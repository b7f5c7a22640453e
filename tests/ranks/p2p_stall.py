"""Rank 0 waits in a point-to-point receive from rank 1, which stops itself (SIGSTOP)
before sending: rank 0's stall inspector must name rank 1 and the message."""

import os
import signal

import numpy as np

from mpidl.comm import Communicator

comm = Communicator()
comm.barrier()
if comm.rank == 1:
    print("rank 1 stops itself", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    comm.send(np.ones(3), dest=0, tag=3)
else:
    buf = np.empty(3)
    comm.recv(buf, source=1, tag=3)
    print(f"rank 0 received {buf}", flush=True)
comm.close()

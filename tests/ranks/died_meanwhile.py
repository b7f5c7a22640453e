"""ft.died_meanwhile on real ranks (tests/test_elastic.py): before a death it waits its
time and says no; after rank 2 is SIGKILLed the others learn of it and say yes."""

import os
import signal

from mpi4py import MPI

from mpidl.comm import ft

world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
rank = world.Get_rank()
before = ft.died_meanwhile(wait=0.2)
world.Barrier()
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
after = ft.died_meanwhile(wait=30.0)
print(f"rank {rank}: before {before} after {after}", flush=True)
ft.exit_survivor(0 if (not before and after) else 1)

"""close() with point-to-point requests in flight (2 ranks): rank 0 starts two 8 MiB
sends to rank 1, keeps the first request and drops the second together with its array
(the request held the only reference to it), fills memory with other data and closes;
rank 1 posts both receives and closes before waiting for them. The requests outlive the
communicator, as MPI's free lets them: both arrays arrive whole (the dropped send's
buffer was not given back while MPI still read from it), and the kept requests complete
after close.
"""

import numpy as np

from mpidl.comm import Communicator

N = 1 << 20  # 8 MiB of float64: past every MPI's eager limit
comm = Communicator()
expected = np.arange(N, dtype=np.float64)
if comm.rank == 0:
    kept = comm.isend(expected.copy(), 1, tag=7)
    comm.isend(expected * 2, 1, tag=8)  # request and array dropped
    junk = [np.full(N, -1.0) for _ in range(4)]  # would reuse memory given back
    comm.close()
    kept.wait()
    print(f"rank 0: kept send done after close: {kept.done}", flush=True)
else:
    first, second = np.zeros(N), np.zeros(N)
    requests = [comm.irecv(first, 0, tag=7), comm.irecv(second, 0, tag=8)]
    comm.close()
    for req in requests:
        req.wait()
    print(f"rank 1: first whole: {np.array_equal(first, expected)}, second whole: "
          f"{np.array_equal(second, expected * 2)}", flush=True)
fresh = Communicator()  # MPI still works for the next communicator
print(f"rank {fresh.rank}: fresh allreduce {fresh.allreduce(np.ones(1))[0]:g}", flush=True)
fresh.close()

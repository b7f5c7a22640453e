"""Timeline: every collective as a span in a Chrome-trace JSON (chrome://tracing, Perfetto).

Each event records the collective, tensor name, algorithm, bytes, start and end. In the
file a rank is a process (``pid`` = rank in the communicator that owns the timeline) and
the thread that ran the collective is a thread (``tid`` 0: the caller's thread, 1: the
progress thread of non-blocking calls; waits on handles appear on the caller's thread).

One file for all ranks: ``close()``/``flush_timeline()`` are collective, rank 0 gathers
every rank's events and writes the file. Clocks are aligned at a barrier when the
communicator is created (good to a few microseconds on one node). A path containing
``{rank}`` instead makes each rank write its own file, with no gathering.
"""

import json
import os
import threading
import time

TID_CALLER = 0
TID_PROGRESS = 1
# lanes of a staged GPU exchange's chunks (transport.StagedTransport._pipelined_sendrecv)
TID_TO_HOST, TID_WIRE, TID_TO_DEVICE = 2, 3, 4


class Timeline:
    """Collects events of one communicator (and of communicators split from it)."""

    def __init__(self, path, comm):
        self.path = str(path)
        self.rank = comm.Get_rank()
        comm.Barrier()
        self.t0 = time.perf_counter()
        self._events = []
        self._lock = threading.Lock()

    def clock(self):
        return time.perf_counter()

    def record(self, kind, name, algorithm, nbytes, start, end, tid, **extra):
        """Add a span: ``start``/``end`` from ``clock()`` (``time.perf_counter``), ``tid``
        0 for the caller's thread, 1 for the progress thread; ``extra`` goes to args.
        Thread-safe; other layers (e.g. a strategy's compute phases) may record too."""
        ev = (kind, name, algorithm, nbytes, start, end, tid, extra)
        with self._lock:
            self._events.append(ev)

    def _trace_events(self, rank, events):
        out = []
        for kind, name, algorithm, nbytes, start, end, tid, extra in events:
            args = {"collective": kind, "algorithm": algorithm, "bytes": int(nbytes)}
            args.update(extra)
            out.append({
                "name": f"{kind} {name}" if name else kind,
                "cat": kind,
                "ph": "X",
                "ts": round((start - self.t0) * 1e6, 3),
                "dur": round((end - start) * 1e6, 3),
                "pid": rank,
                "tid": tid,
                "args": args,
            })
        return out

    def _meta(self, rank):
        return [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_CALLER,
             "args": {"name": "caller"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_PROGRESS,
             "args": {"name": "progress"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_TO_HOST,
             "args": {"name": "copies to host (GPU)"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_WIRE,
             "args": {"name": "transfers (MPI)"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_TO_DEVICE,
             "args": {"name": "copies to device (GPU)"}},
        ]

    def flush(self, comm):
        """Write the file (collective unless the path has ``{rank}``); returns the path
        written on this rank, or None."""
        with self._lock:
            mine = self._trace_events(self.rank, self._events)
        if "{rank}" in self.path:
            path = self.path.format(rank=self.rank)
            _write(path, self._meta(self.rank) + mine)
            return path
        gathered = comm.gather(mine, root=0)
        if comm.Get_rank() != 0:
            return None
        events = []
        for r, evs in enumerate(gathered):
            events += self._meta(r) + evs
        _write(self.path, events)
        return self.path


def _write(path, events):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)

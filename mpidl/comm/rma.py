"""A vector other ranks read and add to while its owners compute: MPI one-sided calls.

``SharedVector`` holds n elements in MPI windows, split over *owner* ranks with
``layout.even_split`` (owner i holds chunk i). Any rank of the communicator reads
elements (``read``) and adds to them (``add``) without the owners taking part: this is
Hogwild! (Niu et al. 2011) across processes, the parameter vector living in the owners'
memory. Each owner also holds a version counter that ``add`` increments, so a reader
knows how many updates landed between its read and its write (its staleness).

Atomicity, as MPI defines it and nothing more: a read is ``MPI_Get_accumulate`` with
``MPI_NO_OP`` and a write ``MPI_Accumulate`` with ``MPI_SUM``, so each *element* is read
or updated atomically (two concurrent adds never lose one, a read never sees half an
element); nothing holds across elements, which is exactly Hogwild's lock-free contract.
``locks=True`` instead gives ``exclusive()``: an exclusive lock on every owner (taken in
rank order, so two lockers cannot deadlock) for a whole read-compute-write, the locked
comparison.

Progress: MPICH (and others) complete a passive-target accumulate only when the target
process enters MPI, so a target that computes without MPI calls would hold every writer
up until its next call (a measured 3 s wait for a 3 s compute loop). An owner therefore
runs a small progress thread that calls ``MPI_Iprobe`` every ``poll_s`` seconds (mpidl's
own remedy; it needs ``MPI_THREAD_MULTIPLE``); MPICH's ``MPIR_CVAR_ASYNC_PROGRESS=1``
is the library's own alternative, with a thread that spins.
"""

import threading
import time

import numpy as np
from mpi4py import MPI

from mpidl.comm.layout import even_split
from mpidl.comm.ops import mpi_datatype
from mpidl.errors import ConfigError


def check_rma(comm):
    """Raise a ``ConfigError`` (one line) unless this MPI can create a window and run an
    accumulate on it; collective over ``comm``."""
    def refuse(what, e):
        return ConfigError(f"this MPI library {what} ({e.Get_error_string().strip()}): "
                           "Hogwild needs MPI-3 one-sided communication (RMA); use "
                           "--strategy ps --mode async instead")

    try:
        win = MPI.Win.Allocate(8, 8, comm=comm)
    except MPI.Exception as e:
        raise refuse("cannot allocate one-sided windows", e) from None
    try:
        win.Lock_all()
        win.Accumulate(np.ones(1), comm.rank, op=MPI.SUM)
        win.Flush(comm.rank)
        win.Unlock_all()
    except MPI.Exception as e:
        raise refuse("fails a one-sided accumulate", e) from None
    finally:
        win.Free()


class SharedVector:
    """``n`` elements of ``dtype`` split over ``owners`` (ranks of ``comm``); module doc.

    Collective to make and to ``close``; ``read``, ``add`` and ``versions`` are one-sided
    (only the caller takes part). ``local`` is an owner's own chunk (a NumPy view of the
    window's memory, which the owner may read at any time). ``count``: where the traffic
    is counted (``counters.py``: a call per read, add or versions, a message per one-sided
    operation, the bytes it moves)."""

    def __init__(self, comm, owners, n, dtype, locks=False, poll_s=2e-4, count=None):
        self.comm = comm
        # [calls, messages, bytes, native_calls]: a Communicator's counter("rma"), or own
        self.count = count if count is not None else [0, 0, 0, 0]
        self.owners = list(owners)
        if not self.owners or len(set(self.owners)) != len(self.owners) or not all(
                0 <= o < comm.size for o in self.owners):
            raise ValueError(f"owners must be distinct ranks of a communicator of "
                             f"{comm.size}, got {owners}")
        self.n = int(n)
        self.dtype = np.dtype(dtype)
        self.mpi_type = mpi_datatype(self.dtype)
        self.counts, self.displs = even_split(self.n, len(self.owners))
        self.locks = bool(locks)
        rank = comm.rank
        mine = self.counts[self.owners.index(rank)] if rank in self.owners else 0
        item = self.dtype.itemsize
        self.win = MPI.Win.Allocate(mine * item, item, comm=comm)
        self.version_win = MPI.Win.Allocate(8 if rank in self.owners else 0, 8, comm=comm)
        self.local = None
        if rank in self.owners:
            self.local = np.frombuffer(self.win.tomemory(), dtype=self.dtype, count=mine)
            self.local[...] = 0
            np.frombuffer(self.version_win.tomemory(), dtype=np.int64, count=1)[0] = 0
        self._one = np.ones(1, dtype=np.int64)
        self._old = np.zeros(1, dtype=np.int64)
        self._held = False
        self._exclusive = False
        comm.Barrier()  # every owner's memory is initialised before anyone reads it
        if not self.locks:
            self.win.Lock_all()
            self.version_win.Lock_all()
            self._held = True
        self._stop = None
        self._thread = None
        self._probe = comm.Dup()  # (collective) probing a private communicator disturbs nobody
        if rank in self.owners and poll_s is not None:
            self._start_progress(poll_s)

    # -- progress on an owner
    def _start_progress(self, poll_s):
        self._stop = threading.Event()

        def poll():
            probe, stop = self._probe, self._stop
            while not stop.is_set():
                probe.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                time.sleep(poll_s)

        self._thread = threading.Thread(target=poll, name="mpidl-rma-progress", daemon=True)
        self._thread.start()

    # -- where an element lives
    def _pieces(self, lo=0, hi=None):
        """(owner index, start in the owner's chunk, start in [lo, hi), count) for each
        owner that holds part of the range."""
        hi = self.n if hi is None else hi
        out = []
        for i, (c, d) in enumerate(zip(self.counts, self.displs)):
            a, b = max(lo, d), min(hi, d + c)
            if a < b:
                out.append((i, a - d, a - lo, b - a))
        return out

    def _split(self, idx):
        """Sorted global indices -> [(owner index, positions in idx, offsets in chunk)]."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"SharedVector of {self.n} elements: index out of range "
                             f"({int(idx.min())}..{int(idx.max())})")
        owner = np.searchsorted(np.asarray(self.displs[1:]), idx, side="right")
        out = []
        for i in np.unique(owner):
            where = np.nonzero(owner == i)[0]
            out.append((int(i), where, (idx[where] - self.displs[i]).astype(np.int32)))
        return out

    # -- one-sided operations
    def read(self, out=None, idx=None):
        """Elements ``idx`` (default: all) into ``out``; each element read atomically."""
        with self._epoch():
            return self._read(out, idx)

    def add(self, values, idx=None):
        """Add ``values`` to elements ``idx`` (default: all; idx without repeats) and
        count one update at every owner touched; returns the number of updates each of
        those owners had counted before this one (a list, in owner order)."""
        with self._epoch():
            return self._add(values, idx)

    def versions(self):
        """Every owner's update count (one-sided, atomic per owner)."""
        with self._epoch():
            return self._versions()

    def _epoch(self):
        """Lock-free: the epoch opened at construction; locked and outside
        ``exclusive()``: shared locks for this one call."""
        if self._held or self._exclusive:
            return _NO_EPOCH
        return _Shared(self)

    def _counted(self, nbytes):
        c = self.count
        c[1] += 1
        c[2] += int(nbytes)

    def _read(self, out, idx):
        self.count[0] += 1
        item = self.dtype.itemsize
        if idx is None:
            if out is None:
                out = np.empty(self.n, dtype=self.dtype)
            for i, at, pos, count in self._pieces():
                o = self.owners[i]
                self._counted(count * item)
                self.win.Get_accumulate([out[pos:pos + count], self.mpi_type],
                                        [out[pos:pos + count], self.mpi_type], o,
                                        target=(at, count, self.mpi_type), op=MPI.NO_OP)
            self._flush_all()
            return out
        if out is None:
            out = np.empty(len(idx), dtype=self.dtype)
        pending = []
        for i, where, offsets in self._split(idx):
            o = self.owners[i]
            dt = self.mpi_type.Create_indexed_block(1, offsets.tolist()).Commit()
            part = np.empty(len(where), dtype=self.dtype)
            self._counted(part.nbytes)
            self.win.Get_accumulate([part, self.mpi_type], [part, self.mpi_type], o,
                                    target=(0, 1, dt), op=MPI.NO_OP)
            pending.append((dt, where, part))
        self._flush_all()
        for dt, where, part in pending:
            out[where] = part
            dt.Free()
        return out

    def _add(self, values, idx):
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.count[0] += 1
        before = []
        if idx is None:
            for i, at, pos, count in self._pieces():
                o = self.owners[i]
                self._counted(count * self.dtype.itemsize)
                self.win.Accumulate([values[pos:pos + count], self.mpi_type], o,
                                    target=(at, count, self.mpi_type), op=MPI.SUM)
                before.append(self._bump(o))
            self._flush_all()
            return before
        types = []
        for i, where, offsets in self._split(idx):
            o = self.owners[i]
            dt = self.mpi_type.Create_indexed_block(1, offsets.tolist()).Commit()
            part = np.ascontiguousarray(values[where])
            self._counted(part.nbytes)
            self.win.Accumulate([part, self.mpi_type], o, target=(0, 1, dt), op=MPI.SUM)
            types.append((dt, part))
            before.append(self._bump(o))
        self._flush_all()
        for dt, _ in types:
            dt.Free()
        return before

    def _bump(self, owner):
        self._counted(8)
        self.version_win.Fetch_and_op(self._one, self._old, owner, 0, MPI.SUM)
        self.version_win.Flush(owner)
        return int(self._old[0])

    def _versions(self):
        out = np.zeros(len(self.owners), dtype=np.int64)
        one = np.zeros(1, dtype=np.int64)
        self.count[0] += 1
        for i, o in enumerate(self.owners):
            self._counted(8)
            self.version_win.Fetch_and_op(one, out[i:i + 1], o, 0, MPI.NO_OP)
        for o in self.owners:
            self.version_win.Flush(o)
        return out

    def _flush_all(self):
        for o in self.owners:
            self.win.Flush(o)

    # -- the locked comparison
    def exclusive(self):
        """Context: every owner locked exclusively (``locks=True`` only)."""
        if not self.locks:
            raise RuntimeError("SharedVector(locks=False) is lock-free: exclusive() needs "
                               "locks=True")
        return _Exclusive(self)

    def close(self):
        """Collective: stop the progress thread, free the windows."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._probe is not None:
            self._probe.Free()
            self._probe = None
        if self._held:
            self.win.Unlock_all()
            self.version_win.Unlock_all()
            self._held = False
        self.comm.Barrier()
        self.local = None
        self.win.Free()
        self.version_win.Free()


class _Locks:
    """Every owner locked (``kind``) in rank order, released in reverse."""

    kind = MPI.LOCK_SHARED

    def __init__(self, sv):
        self.sv = sv

    def __enter__(self):
        for o in sorted(self.sv.owners):
            self.sv.win.Lock(o, self.kind)
            self.sv.version_win.Lock(o, self.kind)
        return self.sv

    def __exit__(self, *exc):
        for o in sorted(self.sv.owners, reverse=True):
            self.sv.version_win.Unlock(o)
            self.sv.win.Unlock(o)


class _Shared(_Locks):
    pass


class _Exclusive(_Locks):
    kind = MPI.LOCK_EXCLUSIVE

    def __enter__(self):
        super().__enter__()
        self.sv._exclusive = True
        return self.sv

    def __exit__(self, *exc):
        self.sv._exclusive = False
        super().__exit__(*exc)


class _NoEpoch:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_EPOCH = _NoEpoch()

"""``Communicator``: an mpi4py communicator with home-made collectives beside MPI's own.

Every collective takes ``algorithm=``: ``"ring"``, ``"tree"``, ``"recursive_doubling"``,
``"mpi"`` (MPI's own call) or ``"auto"`` (see ``auto.py``), and works on NumPy or CuPy
arrays of any shape; the data is treated as the flat C-order sequence of its elements.
Non-contiguous inputs and outputs are handled (copied to contiguous scratch and back).

Buffer rules:

- ``out=None``: a new array; ``out=x``: in place; any other ``out`` must have the
  result's size and dtype.
- ``reduce_scatter`` returns chunk ``rank`` of the flattened reduction; counts are split
  as evenly as possible, the first ``n % p`` ranks getting one element more
  (``layout.even_split``).
- ``reduce`` returns the result on ``root`` and None elsewhere, where ``x`` is untouched.
- ``allgather`` returns the ``(p * n,)`` concatenation in rank order; ``allgatherv``
  returns ``(concatenation, counts)`` after exchanging the counts (zero is allowed).
- float16 sums round to float16 at each addition (see ``ops.py``); integer sums wrap like
  MPI's; ``op="mean"`` needs floats. float16 and bfloat16 words (``mpidl.bfloat16``) are
  always reduced by mpidl's own algorithms, never by MPI (``algorithm="mpi"`` runs the
  ring for them): MPI may lack a float16 datatype and has no bfloat16.

Algorithms come from one registry (``algorithms.py``): every collective runs the same
generic path (consistency check, counters, timeline span, dispatch to the algorithm
module, ``op="mean"`` division, copy-back of non-contiguous results); only the buffer
rules (``_prep_*``) and a few lines per kind (``_body_*``) differ.

Threads: blocking collectives run on the caller's thread over one duplicate of the MPI
communicator, non-blocking ones on a progress thread over another (``progress.py``), so
the two never mix. Each has its own persistent scratch buffers (``buffers.py``). The
progress thread starts at the first non-blocking call, so a rank that belongs to many
groups (``Mesh``) runs threads only for the groups that use non-blocking collectives.

Point-to-point (``p2p.py``): ``send``/``recv``/``isend``/``irecv``/``sendrecv`` of arrays
with tags, through the same transports, and ``send_obj``/``recv_obj``/``iprobe`` of
pickled objects, on a third duplicate communicator, so user tags never meet the
collectives' messages.

Counters (``counters.py``): ``counters()`` gives calls, messages and payload bytes this
rank sent, per collective kind and for point-to-point; MPI's own collectives count calls
only (``native_calls``); consistency checks and count exchanges are not payload.

Groups: ``split(color)`` or a ``Mesh`` (``mesh.py``) make sub-communicators, each a full
``Communicator`` sharing the parent's timeline and ``auto`` tables.

``close()`` is collective (it may write the gathered timeline); a communicator not closed
by the program is closed when the interpreter exits, before MPI finalizes.

Environment: ``MPIDL_TUNING`` (tuning file for ``auto``), ``MPIDL_RING_SEGMENT`` (bytes
per ring pipeline segment, default 1 MiB; also ``comm.segment_bytes``), ``MPIDL_DEBUG=1``
(check every call), ``MPIDL_PROGRESS=eager`` (no progress thread),
``MPIDL_PROGRESS_WAIT=poll`` (the progress thread polls and sleeps instead of spinning
in MPI: leaves the core to the caller's computation, at some latency),
``MPIDL_CUDA_AWARE=0/1`` (override the detection), ``MPIDL_STALL_WARNING`` (seconds
before a rank waiting in a consistency check says so), ``MPIDL_EXIT_TIMEOUT``.
"""

import atexit
import sys
import threading
import weakref

import numpy as np
from mpi4py import MPI

from .. import backend
from .. import env
from . import algorithms, auto, counters, stall
from .consistency import DESC_BYTES, compare_windows, describe, digest, encode, raise_mismatch
from .consistency import check as _consistency_check
from .ft import RankFailure, reports_failure
from .layout import displacements, even_split
from .ops import check_op, mpi_datatype, own_reduction, reduction
from .p2p import PointToPoint
from .progress import EagerProgress, Handle, ProgressThread
from .timeline import TID_CALLER, TID_PROGRESS, Timeline
from .transport import DeviceTransport, HostTransport, PoliteHostTransport, StagedTransport

ALGORITHMS = ("auto",) + algorithms.names()
_REGISTRY = algorithms.REGISTRY  # live: algorithms registered later are found too
_NP_SUM = reduction(np, "sum")
_F16 = np.dtype(np.float16)
_REDUCTIONS = ("allreduce", "reduce_scatter", "reduce")
IN_PLACE, SUM = MPI.IN_PLACE, MPI.SUM
CHECK_MODES = ("digest", "first", "always", "off")
_OFF, _FIRST, _ALWAYS, _DIGEST = 0, 1, 2, 3
_MODES = {"off": _OFF, "first": _FIRST, "always": _ALWAYS, "digest": _DIGEST}
DIGEST_PERIOD = 4096  # most calls between two digest comparisons (check="digest")
FIRST_PERIOD = 64  # the first comparison's; each next window is twice as long, up to it
DEFAULT_SEGMENT_BYTES = 1024 * 1024

_live = weakref.WeakSet()
_SERIALS = {}  # (label, world ranks) -> communicators made so far (for their names)


def _close_all():
    """At exit: close what the program left open (queued collectives finish first, but a
    collective other ranks never joined is not waited for forever)."""
    stall.INSPECTOR.stop()
    for comm in list(_live):
        try:
            comm.close(_exit_timeout=env.number("MPIDL_EXIT_TIMEOUT"))
        except Exception:  # exiting anyway; MPI may be unusable
            pass


atexit.register(_close_all)


class _Channel:
    """One duplicate communicator, used by one thread: transports, scratch, check memory."""

    def __init__(self, comm, tid, role, staging, cuda_aware, polite=False):
        self.comm = comm
        self.cuda_aware = cuda_aware
        self.tid = tid
        self.role = role  # "main", "progress" or "p2p": how the stall inspector names it
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.seen = set()
        self.seen_allreduce = set()
        self.native_nbytes = {}  # tensor name -> byte counts passed to MPI's own calls
        # What this channel waits for now (a signature key or a stall.Wait), how many
        # calls it has started, and the inspector's memory of it (stall.py).
        self.busy = None
        self.seq = 0
        self.track = None
        self.pending = {}  # point-to-point requests in flight, in start order (p2p.py)
        # Digests of the calls since the last comparison (check="digest"), and the digest
        # of each signature key seen (consistency.digest). Per channel: each channel's
        # calls are in the same order on every rank, the two channels' are not. The
        # window is a list of ``period`` slots, call ``seq``'s at ``seq - window_start``:
        # one store per call, and the store past its end is the call that compares.
        self.window = []
        self.window_start = 1  # the call number of the window's first call
        self.period = self.due = None  # calls per window now; the call that compares
        self.digests = {}
        self.last_allreduce = {}  # tensor name -> (its last all-reduce key, its digest)
        self.stats = counters.new_table()
        self.allreduce_stats = self.stats["allreduce"]
        self._staging = staging
        self.timeline = None  # the communicator's Timeline, set once it has one
        if staging == "host":
            self.host = StagedTransport(comm, np, pinned=False)
        elif polite:
            self.host = PoliteHostTransport(comm, np)
        else:
            self.host = HostTransport(comm, np)
        self._device = None

    def transport(self, gpu):
        if not gpu:
            return self.host
        if self._device is None:
            cp = backend.cupy_module()
            if self.cuda_aware:
                self._device = DeviceTransport(self.comm, cp)
            else:
                self._device = StagedTransport(self.comm, cp, pinned=True)
                self._device.timeline = self.timeline
        return self._device

    def transports(self):
        return [self.host] + ([self._device] if self._device is not None else [])

    def free_buffers(self):
        self.host.free()
        if self._device is not None:
            self._device.free()

    def close(self):
        for t in self.transports():
            t.close()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _module(x):
    """numpy or cupy for an array argument, or a clear TypeError."""
    if isinstance(x, np.ndarray):
        return np, False
    if backend.is_gpu_array(x):
        return backend.cupy_module(), True
    raise TypeError(f"expected a NumPy or CuPy array, got {type(x).__name__}: "
                    "wrap Python data with numpy.asarray first")


def _flat(a, xp):
    """(flat contiguous view or copy of ``a``, whether it is a copy)."""
    if a.flags.c_contiguous:
        return a.reshape(-1), False
    return xp.ascontiguousarray(a).reshape(-1), True


class Communicator(PointToPoint):
    """Collectives and point-to-point messages over an mpi4py communicator
    (``MPI.COMM_WORLD`` when ``mpi_comm`` is None).

    ``check``: when to run the consistency check (``"first"`` call of each tensor name,
    ``"always"``, or ``"off"``; ``MPIDL_DEBUG=1`` forces ``"always"``). ``timeline``: path
    of a Chrome-trace JSON written by ``close()``/``flush_timeline()`` (rank 0's path, or
    the first rank's that gave one, is used by all). ``label``: a name for this group
    (``Mesh`` passes the axis or role), shown in timeline spans. The constructor is
    collective.
    """

    def __init__(self, mpi_comm=None, check="digest", timeline=None, *, label=None,
                 check_period=DIGEST_PERIOD, _staging=None, _owns=False, _tables=None):
        comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if check not in CHECK_MODES:
            raise ValueError(f"check={check!r}: expected one of {', '.join(CHECK_MODES)}")
        if env.flag("MPIDL_DEBUG"):
            check = "always"
        self.mpi = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.check = check
        self._check = _MODES[check]
        if not int(check_period) >= 1:
            raise ValueError(f"check_period={check_period!r}: expected calls >= 1")
        self._owns = _owns
        self._closed = False

        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        local.Free()

        # GPU arrays: device pointers straight to MPI if it is CUDA-aware (decided once,
        # here), else staged through pinned host buffers.
        self.cuda_aware = backend.cuda_aware_mpi()
        try:
            dups = [comm.Dup() for _ in range(4)]
        except MPI.Exception as e:
            raise RuntimeError(
                f"rank {self.rank}: MPI cannot make another communicator ("
                f"{e.Get_error_string().splitlines()[0]}); each mpidl Communicator holds 4 "
                "duplicates: close() the communicators you no longer use") from None
        self._main = _Channel(dups[0], TID_CALLER, "main", _staging, self.cuda_aware)
        polite = env.get("MPIDL_PROGRESS_WAIT").lower() == "poll"
        self._bg = _Channel(dups[1], TID_PROGRESS, "progress", _staging, self.cuda_aware,
                            polite)
        # Point-to-point gets its own duplicate: user tags can never match a collective's.
        self._p2p = _Channel(dups[2], TID_CALLER, "p2p", _staging, self.cuda_aware)
        self._channels = (self._main, self._bg, self._p2p)
        # The stall inspector's questions and answers (stall.py) get one more.
        self._inspect = dups[3]
        world = MPI.COMM_WORLD.Get_group()
        mine = comm.Get_group()
        self.world_ranks = [int(r) for r in MPI.Group.Translate_ranks(
            mine, list(range(self.size)), world)]
        mine.Free()
        world.Free()
        self.world_rank = self.world_ranks[self.rank]
        # The constructor is collective, so every rank numbers its communicators alike.
        key = (label, tuple(self.world_ranks))
        _SERIALS[key] = self._serial = _SERIALS.get(key, 0) + 1
        self.check_period = int(check_period)
        for ch in self._channels:
            _open_window(ch, ch.seq + 1, min(FIRST_PERIOD, self.check_period))
        self._staging = _staging
        self.label = label

        # One exchange at start-up: everyone must resolve "auto" alike, so rank 0 reads
        # the tuning file for all; and a timeline path given on some ranks only still
        # gives every rank the same one (its writing is collective).
        if _tables is None or not isinstance(timeline, (Timeline, type(None))):
            mine = (auto.load() if self.rank == 0 and _tables is None else None,
                    None if timeline is None or isinstance(timeline, Timeline)
                    else str(timeline))
            everyone = comm.allgather(mine)
            if _tables is None:
                _tables = everyone[0][0]
            paths = [path for _, path in everyone if path is not None]
            if paths:
                timeline = paths[0]
        self._tables = _tables
        self.selector = auto.Selector(self.size, _tables)
        seg = env.number("MPIDL_RING_SEGMENT", int)
        self._ctx = algorithms.Context(max(seg, 64))

        # Timeline: a path (this communicator owns and writes it) or a parent's recorder.
        if isinstance(timeline, Timeline):
            self._timeline, self._owns_timeline = timeline, False
        elif timeline is not None:
            self._timeline, self._owns_timeline = Timeline(timeline, comm), True
        else:
            self._timeline, self._owns_timeline = None, False

        for ch in (self._main, self._bg, self._p2p):
            ch.timeline = self._timeline  # staged GPU exchanges record their chunks
        # allreduce's fast path skips what only a timeline or forced staging needs
        self._fast = self._timeline is None and not _staging

        # The progress thread starts at the first non-blocking call (see _submit).
        mode = env.get("MPIDL_PROGRESS").lower()
        if mode != "eager" and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self._progress = None
            self._progress_lock = threading.Lock()
        else:
            self._progress = EagerProgress()
        _live.add(self)
        if stall.available():
            stall.INSPECTOR.register(self)

    # ------------------------------------------------------------------ basics
    @property
    def timeline(self):
        """The Chrome-trace recorder (``timeline.Timeline``) or None. Other layers may add
        spans to it: ``timeline.record(kind, name, "", 0, start, end, tid)`` with
        ``time.perf_counter()`` times (``timeline.clock()``)."""
        return self._timeline

    @property
    def progress_mode(self):
        """"thread" (a progress thread runs non-blocking collectives; it starts at the
        first one) or "eager"."""
        return "thread" if self._progress is None else self._progress.mode

    @property
    def progress_started(self):
        """Whether this communicator runs a progress thread now (started lazily)."""
        return self._progress is not None and self._progress.mode == "thread"

    @property
    def segment_bytes(self):
        """Bytes per ring pipeline segment (``MPIDL_RING_SEGMENT``, default 1 MiB)."""
        return self._ctx.segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value):
        self._ctx.segment_bytes = int(value)

    def counter(self, kind):
        """The counter list (``[calls, messages, bytes, native_calls]``) of ``kind`` on the
        point-to-point channel, for traffic that does not go through the communicator's
        own calls: one-sided windows over its ranks count there (``rma.SharedVector``)."""
        return self._p2p.stats[kind]

    def counters(self):
        """Traffic this rank sent on this communicator: ``{kind: {"calls", "messages",
        "bytes", "native_calls"}}`` for every collective kind, ``"p2p"`` and ``"rma"``
        (one-sided), plus ``"total"``. ``messages``/``bytes`` are payload sends through mpidl's transports
        (a sendrecv is one message); MPI's own collectives (``algorithm="mpi"``) count in
        ``calls`` and ``native_calls`` only, because what MPI sends inside them cannot be
        observed; consistency checks and count exchanges are control traffic, not
        counted. See ``counters.py``."""
        return counters.summarize([ch.stats for ch in self._channels])

    def reset_counters(self):
        """Set every counter of this communicator back to 0 (local, not collective)."""
        counters.reset([ch.stats for ch in self._channels])

    def __repr__(self):
        label = f" {self.label}" if self.label is not None else ""
        return (f"<mpidl Communicator{label} rank {self.rank}/{self.size} "
                f"local {self.local_rank}/{self.local_size} progress={self.progress_mode}>")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def split(self, color, key=0, label=None):
        """A new Communicator over the ranks that pass the same ``color`` (ordered by
        ``key``, then rank). Collective. ``color=None`` (MPI.UNDEFINED) joins no group and
        returns None. The group shares this communicator's timeline, ``auto`` tables,
        check mode and ring segment size."""
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        group = Communicator(sub, check=self.check, timeline=self._timeline, label=label,
                             check_period=self.check_period, _staging=self._staging,
                             _owns=True, _tables=self._tables)
        group.segment_bytes = self.segment_bytes
        return group

    @property
    def group_text(self):
        """How messages name this group: its label (or "world"), a number when this
        process made several of that name (``world#2``: the second), its world ranks."""
        name = self.label or ("world" if self.size == MPI.COMM_WORLD.Get_size() else "group")
        if self._serial > 1:
            name += f"#{self._serial}"
        return f"{name} [{stall.ranks_text(self.world_ranks)}]"

    def barrier(self):
        ch = self._main
        key = ("barrier", None, None, None, None, None, None)
        ch.seq += 1
        ch.busy = key
        try:
            if self._check == _DIGEST:
                self._digest(ch, key)
            ch.comm.Barrier()
        finally:
            ch.busy = None

    def waiting(self, text, peers=None):
        """A context in which this rank waits for ``text`` (a str, or a function that makes
        it when a stall report needs it) from ``peers`` (ranks of this group; None: any)
        outside mpidl's own calls, e.g. a protocol's polling loop: the stall inspector
        (stall.py) names the peers that have not answered when it lasts."""
        return _Waiting(self._p2p, stall.Wait(text, peers))

    def set_check(self, mode):
        """Change the check mode between calls. Collective: every rank switches at the same
        point (leaving "digest" compares the calls not compared yet)."""
        if mode not in CHECK_MODES:
            raise ValueError(f"check={mode!r}: expected one of {', '.join(CHECK_MODES)}")
        if self._check == _DIGEST and mode != "digest":
            self.check_signatures()
        if mode == "digest" and self._check != _DIGEST:
            for ch in (self._main, self._bg):  # windows as long as they had grown
                _open_window(ch, ch.seq + 1, ch.period)
        self.check = mode
        self._check = _MODES[mode]

    def check_signatures(self):
        """Compare the signatures of the calls since the last comparison now
        (check="digest"; collective). ``close()`` does this too."""
        if self._check == _DIGEST:
            for ch in (self._main, self._bg):
                if ch is self._bg and self._progress is not None \
                        and self._progress.mode == "thread":
                    self._submit("digest", None, False, self._compare, ch, False).wait()
                else:
                    self._compare(ch, before_call=False)

    def buffer_nbytes(self):
        """Bytes of the persistent scratch the algorithms keep (ring chunks, reduce-scatter
        work memory), over this communicator's channels: the memory ledger's mem_comm."""
        return sum(t.scratch.nbytes() + (t.node_memory.nbytes if t.node_memory else 0)
                   for ch in self._channels for t in ch.transports())

    def free_buffers(self):
        """Give the persistent scratch and staging memory back (they regrow on demand;
        not collective, so the "shared" algorithm's node memory stays until close)."""
        for ch in self._channels:
            ch.free_buffers()

    def flush_timeline(self):
        """Write the timeline file now (collective); returns the path written here or None."""
        if self._timeline is None or not self._owns_timeline:
            return None
        return self._timeline.flush(self._main.comm)

    def close(self, _exit_timeout=None):
        """Compare the signatures not compared yet (check="digest"), finish queued
        non-blocking collectives, write the timeline, free the duplicate communicators
        (point-to-point requests still in flight complete afterwards, as MPI's free lets
        them: ``p2p.py``).
        Collective and synchronizing: every rank closes its communicators in the same
        order. Idempotent."""
        if self._closed:
            return
        if _exit_timeout is None and not MPI.Is_finalized():
            self.check_signatures()
        self._closed = True
        _live.discard(self)
        stall.INSPECTOR.unregister(self)
        if self._progress is not None and not self._progress.close(_exit_timeout):
            print(f"mpidl: rank {self.rank}: non-blocking collectives still running at exit "
                  f"after {_exit_timeout:.0f} s (other ranks never joined them); not waiting",
                  file=sys.stderr, flush=True)
            return
        if MPI.Is_finalized():
            return
        self._orphan_p2p()
        if self._owns_timeline:
            self._timeline.flush(self._main.comm)
        for ch in self._channels:
            ch.close()
        self._inspect.Free()
        if self._owns:
            self.mpi.Free()

    # ------------------------------------------------------------------ helpers
    def _resolve(self, kind, algorithm, nbytes, dtype=None, staged=False):
        """The algorithm to run (``auto`` chosen by size, and for device arrays staged
        through the host, by that too); a clear error if it is unknown or does not
        implement ``kind``. Reductions of float16 and bfloat16 words never go to MPI
        (``ops.own_reduction``): "mpi" becomes the ring for them."""
        alg = (self.selector.choose(kind, nbytes, staged) if algorithm == "auto"
               else algorithm)
        if alg == "mpi" and dtype is not None and kind in _REDUCTIONS \
                and own_reduction(dtype):
            alg = "ring"
        algorithms.get(alg, kind)
        return alg

    def _check_root(self, kind, root):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{kind}: root {root} is not a rank of this communicator "
                             f"(size {self.size})")

    @staticmethod
    def _module(x):
        return _module(x)

    def _verify(self, ch, kind, name, shape, dtype, op=None, alg=None, root=None):
        """Run the consistency check if this call needs one (see consistency.py): named
        tensors on their first call, unnamed ones on each new signature."""
        key = (kind, name) if name is not None else (kind, shape, dtype, op, alg, root)
        if self._check == _ALWAYS or key not in ch.seen:
            _consistency_check(ch.comm, kind, name,
                               describe(kind, name, shape, dtype, op, alg, root),
                               blocking=ch is self._main)
            ch.seen.add(key)
            if kind == "allreduce" and name is not None:
                ch.seen_allreduce.add(name)  # the allreduce fast path's lookup

    def _check_new_size(self, ch, kind, name, nbytes, shape, dtype, op, alg, root=None):
        """Compare a named tensor's call in full before MPI's own collective gets a byte
        count this tensor has not had: given different sizes on different ranks, MPI can
        end the job inside the call (MPICH aborts, whatever the error handler) before any
        digest comparison could name it. The comparison runs on the stall inspector's
        duplicate: if every rank changed the size alike they meet there at once; if some
        did not, those wait in MPI's call, and the stall inspector finds the two
        signatures at the same call number within ``stall.MISMATCH_AFTER`` seconds and
        ends the job naming both. Blocking calls only (the caller's thread); without an
        inspector MPI's own error stands."""
        if name is None or ch is not self._main:
            return
        sizes = ch.native_nbytes.setdefault(name, set())
        if nbytes not in sizes:
            if sizes and self.size > 1 and stall.available():
                _consistency_check(self._inspect, kind, name,
                                   describe(kind, name, shape, dtype, op, alg, root),
                                   blocking=True)
            sizes.add(nbytes)

    def _digest(self, ch, key):
        """Remember the signature of the call about to run (as its digest: an int, which
        the garbage collector does not track; keeping the key tuples would make it run);
        before it, compare the window's digests if this call is the one due."""
        if ch.seq >= ch.due:
            self._compare(ch)
        ch.window[ch.seq - ch.window_start] = digest(key, ch.digests)

    def _compare(self, ch, before_call=True):
        """Digest comparison of ``ch``'s calls since the last one (consistency.py);
        raises CollectiveMismatchError on every rank naming the first call that differs.
        ``before_call``: run at the start of call ``ch.seq`` (the window ends before it),
        else after the channel's last call (close). Every rank compares at the same call
        number: the first window is 64 calls, each next one twice as long up to
        ``check_period``, so a mismatch early in a run is found early and a long run
        compares rarely."""
        first = ch.window_start
        last = ch.seq - 1 if before_call else ch.seq
        window = ch.window if last - first + 1 == len(ch.window) else \
            ch.window[:last - first + 1]
        _open_window(ch, last + 1, min(ch.period * 2, self.check_period))
        busy = ch.busy
        calls = f"calls {first}-{last}" if last >= first else f"no calls since call {last}"
        ch.busy = stall.Wait(f"in the signature check of {calls}")
        try:
            compare_windows(ch.comm, window, ch.digests, first, self.group_text,
                            blocking=ch is self._main)
        finally:
            ch.busy = busy

    def _submit(self, kind, name, gpu, fn, *args):
        """Queue ``fn(*args)`` on the progress thread; returns its Handle."""
        if self._closed:
            raise RuntimeError("communicator is closed")
        progress = self._progress
        if progress is None:
            with self._progress_lock:
                if self._progress is None:
                    self._progress = ProgressThread(
                        "mpidl-progress" + (f"-{self.label}" if self.label else ""))
            progress = self._progress
        handle = Handle(kind, name, self._timeline)
        if gpu:
            # The progress thread has its own CUDA device and stream state: make it use
            # this thread's device and wait for the kernels that produced the input.
            cp = backend.cupy_module()
            event = cp.cuda.Event(block=True, disable_timing=True)
            event.record()
            return progress.submit(handle, _on_device, cp.cuda.Device().id, event, fn,
                                   args)
        return progress.submit(handle, fn, *args)

    # ------------------------------------------------------------------ the generic path
    def _run(self, ch, c):
        """Run prepared call ``c`` on channel ``ch``: the one skeleton every collective
        shares (consistency check, counters, timeline span, dispatch through the
        registry, ``op="mean"`` division, copy-back of a non-contiguous result)."""
        t = ch.transport(True) if c.gpu else ch.host
        kind = c.kind
        key = (kind, c.name, None if kind == "allgatherv" else
               c.x.size if kind == "allreduce" else c.x.shape, c.x.dtype, c.op, c.alg, c.root)
        ch.seq += 1
        ch.busy = key
        try:
            if c.verify and self._check:
                self._verify(ch, kind, c.name, c.x.shape, c.x.dtype, c.op, c.alg, c.root)
            if c.alg == "mpi" and self._check == _DIGEST and kind != "allgatherv" \
                    and key not in ch.digests:
                self._check_new_size(ch, kind, c.name, c.x.nbytes, c.x.shape, c.x.dtype,
                                     c.op, c.alg, c.root)
            if self._check == _DIGEST and ch.seq >= ch.due:
                self._compare(ch)
            tl = self._timeline
            start = tl.clock() if tl is not None else 0.0
            stats = ch.stats[kind]
            stats[0] += 1
            t.count = stats
            result = c.body(self, t, c, stats)
        except MPI.Exception as e:
            raise _mpi_error(self, key, e) from None
        finally:
            ch.busy = None
        if self._check == _DIGEST:
            # after the call: one that raised (a mismatch found by its own exchange, as
            # allgatherv's, raises on every rank) leaves its slot 0
            ch.window[ch.seq - ch.window_start] = digest(key, ch.digests)
        if c.op == "mean" and c.dst is not None:
            c.xp.divide(c.dst, self.size, out=c.dst)
        if c.back is not None:
            c.back[...] = c.dst.reshape(c.back.shape)
        if tl is not None:
            extra = self._label_extra()
            if c.op is not None:
                extra["op"] = c.op
            if kind == "bcast":
                extra["root"] = c.root
            tl.record(kind, c.name, c.alg, c.nbytes, start, tl.clock(), ch.tid, **extra)
        return result

    def _label_extra(self):
        return {"group": self.label} if self.label is not None else {}

    def _fn(self, alg, kind, stats):
        """The registry's function for ``alg``; counts a call of MPI's own collective."""
        if alg == "mpi":
            stats[3] += 1
        return algorithms.get(alg, kind)

    def _blocking(self, c, name):
        c.name = name
        return self._run(self._main, c)

    def _nonblocking(self, c, name):
        c.name = name
        return self._submit(c.kind, name, c.gpu, self._run, self._bg, c)

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, x, out=None, op="sum", algorithm="auto", name=None):
        """Reduce ``x`` over all ranks with ``op``; every rank gets the result (bitwise
        identical on all ranks). ``out=None``: new array; ``out=x``: in place."""
        # Fast path for the common small-message case (a contiguous NumPy sum into a
        # given buffer, no timeline): the same steps as the generic path with fewer
        # calls, because at a few microseconds per collective Python's call overhead is
        # the cost.
        if (type(x) is np.ndarray and op == "sum" and self._fast
                and (out is x or (type(out) is np.ndarray and out.shape == x.shape
                                  and out.dtype == x.dtype and out.flags.c_contiguous))
                and x.flags.c_contiguous and x.dtype.kind in "iuf"):
            ch = self._main
            alg = algorithm
            if alg not in _REGISTRY or (alg == "mpi" and x.dtype == _F16):
                alg = self._resolve("allreduce", algorithm, x.nbytes, x.dtype)
            check = self._check
            size, num = x.size, x.dtype.num
            d = None
            if check == _DIGEST:
                # A training loop repeats each name's signature: the last key of a name
                # and its digest come back from one lookup by name (a string keeps its
                # hash), with no key to build or hash.
                last = ch.last_allreduce.get(name)
                if last is not None:
                    key, d = last
                    if key[1] != size or key[2] != num or key[3] != alg:
                        d = None
            if d is None:
                key = (name, size, num, alg)  # short form of a sum's signature key
            seq = ch.seq + 1
            ch.seq = seq
            ch.busy = key
            try:
                if check == _DIGEST:
                    # A known key means a known name: no full check, one store per call
                    # (try: free in Python 3.11+ when nothing is raised).
                    if d is None:
                        try:
                            d = ch.digests[key]
                        except KeyError:
                            if name is None or name not in ch.seen_allreduce:
                                self._verify(ch, "allreduce", name, x.shape, x.dtype, op,
                                             alg)
                            if alg == "mpi":
                                self._check_new_size(ch, "allreduce", name, x.nbytes,
                                                     x.shape, x.dtype, op, alg)
                            d = digest(key, ch.digests)
                        ch.last_allreduce[name] = (key, d)
                    try:
                        ch.window[seq - ch.window_start] = d
                    except IndexError:  # the window is full: this call compares it
                        self._compare(ch)
                        ch.window[0] = d
                elif check and (name is None or check == _ALWAYS
                                or name not in ch.seen_allreduce):
                    self._verify(ch, "allreduce", name, x.shape, x.dtype, op, alg)
                src = x if x.ndim == 1 else x.reshape(-1)
                dst = src if out is x else (out if out.ndim == 1 else out.reshape(-1))
                stats = ch.allreduce_stats
                stats[0] += 1
                if self.size == 1 or not src.size:
                    if dst is not src:
                        dst[...] = src
                elif alg == "mpi":
                    stats[3] += 1
                    dt = mpi_datatype(x.dtype)
                    ch.comm.Allreduce(IN_PLACE if src is dst else [src, dt], [dst, dt], SUM)
                else:
                    t = ch.host
                    t.count = stats
                    try:
                        fn = _REGISTRY[alg].allreduce
                    except (KeyError, AttributeError):
                        fn = algorithms.get(alg, "allreduce")  # raises the clear error
                    fn(t, src, dst, _NP_SUM, self._ctx)
            except MPI.Exception as e:
                raise _mpi_error(self, key, e) from None
            finally:
                ch.busy = None
            return out
        return self._blocking(self._prep_allreduce(x, out, op, algorithm), name)

    def iallreduce(self, x, out=None, op="sum", algorithm="auto", name=None):
        """Non-blocking ``allreduce``: returns a Handle; ``wait()`` gives the result.
        ``x`` (and ``out``) must not change until then."""
        return self._nonblocking(self._prep_allreduce(x, out, op, algorithm), name)

    def _prep_allreduce(self, x, out, op, algorithm):
        if type(x) is np.ndarray:
            xp, gpu = np, False
        else:
            xp, gpu = _module(x)
        dtype = x.dtype
        if op != "sum" or dtype.kind not in "iuf":
            check_op(op, dtype)
        alg = self._resolve("allreduce", algorithm, x.nbytes, dtype,
                            staged=gpu and not self.cuda_aware)
        back = None
        if x.flags.c_contiguous:
            src = x if x.ndim == 1 else x.reshape(-1)
        else:
            src = xp.ascontiguousarray(x).reshape(-1)
            if out is x:
                back = x
        if out is x:
            dst = src
        else:
            if out is None:
                out = xp.empty(x.shape, dtype=dtype)
            elif out.shape != x.shape or out.dtype != dtype or type(out) is not type(x):
                raise ValueError(f"allreduce: out has shape {out.shape} {out.dtype}, "
                                 f"expected {x.shape} {dtype} ({type(x).__name__})")
            if out.flags.c_contiguous:
                dst = out if out.ndim == 1 else out.reshape(-1)
            else:
                dst = xp.empty(out.size, dtype=dtype)
                back = out
        return _Call("allreduce", _body_allreduce, x, alg, op, xp, gpu, src=src, dst=dst,
                     back=back, result=out, nbytes=src.nbytes)

    # ------------------------------------------------------------------ reduce_scatter
    def reduce_scatter(self, x, out=None, op="sum", algorithm="auto", name=None,
                       counts=None):
        """Reduce ``x`` (flattened, n elements) over all ranks; return this rank's chunk:
        ``counts[rank]`` elements at ``displs[rank]`` of ``layout.even_split(n, p)`` (the
        first ``n % p`` ranks get one element more), or of ``counts`` when given (one
        count per rank, summing to n: chunks on other boundaries, such as whole samples)."""
        return self._blocking(self._prep_rs(x, out, op, algorithm, counts), name)

    def ireduce_scatter(self, x, out=None, op="sum", algorithm="auto", name=None,
                        counts=None):
        return self._nonblocking(self._prep_rs(x, out, op, algorithm, counts), name)

    def _prep_rs(self, x, out, op, algorithm, counts=None):
        xp, gpu = _module(x)
        check_op(op, x.dtype)
        alg = self._resolve("reduce_scatter", algorithm, x.nbytes, x.dtype)
        if counts is None:
            counts, displs = even_split(x.size, self.size)
        else:
            counts = tuple(int(c) for c in counts)
            if len(counts) != self.size or min(counts) < 0 or sum(counts) != x.size:
                raise ValueError(f"reduce_scatter: counts {counts} must give each of the "
                                 f"{self.size} ranks a count >= 0, summing to the {x.size} "
                                 "elements of x")
            displs = displacements(counts)
        mine = counts[self.rank]
        if out is None:
            out = xp.empty(mine, dtype=x.dtype)
        elif out is x or out.size != mine or out.dtype != x.dtype or type(out) is not type(x):
            raise ValueError(f"reduce_scatter: out must be a separate {type(x).__name__} of "
                             f"{mine} {x.dtype} elements (this rank's chunk), got "
                             f"{out.size} {out.dtype}")
        src = _flat(x, xp)[0]
        dst, copied = _flat(out, xp)
        return _Call("reduce_scatter", _body_reduce_scatter, x, alg, op, xp, gpu, src=src,
                     dst=dst, back=out if copied else None, result=out, counts=counts,
                     displs=displs, nbytes=src.nbytes)

    # ------------------------------------------------------------------ reduce
    def reduce(self, x, root=0, out=None, op="sum", algorithm="auto", name=None):
        """Reduce ``x`` over all ranks to ``root``: returns the result there (``out=x``: in
        place), None on other ranks (whose ``x`` and ``out`` are left untouched)."""
        return self._blocking(self._prep_reduce(x, root, out, op, algorithm), name)

    def ireduce(self, x, root=0, out=None, op="sum", algorithm="auto", name=None):
        return self._nonblocking(self._prep_reduce(x, root, out, op, algorithm), name)

    def _prep_reduce(self, x, root, out, op, algorithm):
        xp, gpu = _module(x)
        check_op(op, x.dtype)
        self._check_root("reduce", root)
        alg = self._resolve("reduce", algorithm, x.nbytes, x.dtype)
        src, _ = _flat(x, xp)
        back = dst = result = None
        if self.rank == root:
            if out is x:
                dst = src
                back = x if not x.flags.c_contiguous else None
            else:
                if out is None:
                    out = xp.empty(x.shape, dtype=x.dtype)
                elif out.size != x.size or out.dtype != x.dtype or type(out) is not type(x):
                    raise ValueError(f"reduce: out has {out.size} {out.dtype}, expected "
                                     f"{x.size} {x.dtype}")
                dst, copied = _flat(out, xp)
                back = out if copied else None
            result = out if out is not None else x
        return _Call("reduce", _body_reduce, x, alg, op, xp, gpu, root=root, src=src,
                     dst=dst, back=back, result=result, nbytes=src.nbytes)

    # ------------------------------------------------------------------ bcast
    def bcast(self, x, root=0, algorithm="auto", name=None):
        """Broadcast ``x`` from ``root`` into ``x`` on every rank (in place); returns ``x``."""
        return self._blocking(self._prep_bcast(x, root, algorithm), name)

    def ibcast(self, x, root=0, algorithm="auto", name=None):
        return self._nonblocking(self._prep_bcast(x, root, algorithm), name)

    def _prep_bcast(self, x, root, algorithm):
        xp, gpu = _module(x)
        self._check_root("bcast", root)
        alg = self._resolve("bcast", algorithm, x.nbytes)
        buf, copied = _flat(x, xp)
        return _Call("bcast", _body_bcast, x, alg, None, xp, gpu, root=root, dst=buf,
                     back=x if copied else None, result=x, nbytes=buf.nbytes)

    # ------------------------------------------------------------------ allgather(v)
    def allgather(self, x, out=None, algorithm="auto", name=None):
        """Concatenate every rank's ``x`` (same size everywhere) in rank order: ``(p*n,)``."""
        return self._blocking(self._prep_allgather(x, out, algorithm), name)

    def iallgather(self, x, out=None, algorithm="auto", name=None):
        return self._nonblocking(self._prep_allgather(x, out, algorithm), name)

    def _prep_allgather(self, x, out, algorithm):
        xp, gpu = _module(x)
        n, p = x.size, self.size
        alg = self._resolve("allgather", algorithm, x.nbytes)
        if out is None:
            out = xp.empty(p * n, dtype=x.dtype)
        elif (out.size != p * n or out.dtype != x.dtype or type(out) is not type(x)
              or not out.flags.c_contiguous):
            raise ValueError(f"allgather: out must be a contiguous {type(x).__name__} of "
                             f"{p * n} {x.dtype} elements, got {out.size} {out.dtype}")
        return _Call("allgather", _body_allgather, x, alg, None, xp, gpu, result=out,
                     nbytes=x.nbytes)

    def allgatherv(self, x, algorithm="auto", name=None):
        """Concatenate every rank's ``x`` (flattened; sizes may differ, zero included) in
        rank order. Returns ``(concatenation, counts)``; the counts are exchanged first
        (together with the consistency check's description, so checking costs nothing)."""
        return self._blocking(self._prep_allgatherv(x, algorithm), name)

    def iallgatherv(self, x, algorithm="auto", name=None):
        """Non-blocking ``allgatherv``: ``wait()`` returns ``(concatenation, counts)``."""
        return self._nonblocking(self._prep_allgatherv(x, algorithm), name)

    def _prep_allgatherv(self, x, algorithm):
        xp, gpu = _module(x)
        if algorithm != "auto":
            self._resolve("allgatherv", algorithm, 0)
        # "auto" is resolved once the total size is known (after the counts exchange);
        # the consistency check rides on that exchange (verify=False here).
        return _Call("allgatherv", _body_allgatherv, x, algorithm, None, xp, gpu,
                     verify=False, nbytes=0)


    # ------------------------------------------------------------------ allgather of shards
    def allgather_shards(self, buf, algorithm="auto", name=None):
        """The inverse of ``reduce_scatter``, in place: ``buf`` (flat, contiguous, n
        elements) holds this rank's chunk of ``layout.even_split(n, p)`` at its offset;
        every other rank's chunk is filled in. No count exchange (the layout is known)
        and no padding: a ring moves exactly the other ranks' chunks. Returns ``buf``."""
        return self._blocking(self._prep_allgather_shards(buf, algorithm), name)

    def iallgather_shards(self, buf, algorithm="auto", name=None):
        return self._nonblocking(self._prep_allgather_shards(buf, algorithm), name)

    def _prep_allgather_shards(self, buf, algorithm):
        xp, gpu = _module(buf)
        if buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError(f"allgather_shards: buf must be a flat contiguous array, got "
                             f"shape {buf.shape}")
        counts, displs = even_split(buf.size, self.size)
        alg = self._resolve("allgather", algorithm, buf.nbytes // self.size)
        return _Call("allgather", _body_allgather_shards, buf, alg, None, xp, gpu, dst=buf,
                     result=buf, counts=counts, displs=displs, nbytes=buf.nbytes)


class _Waiting:
    """``Communicator.waiting``: marks a channel busy with a ``stall.Wait`` meanwhile."""

    __slots__ = ("ch", "wait", "prev")

    def __init__(self, ch, wait):
        self.ch, self.wait, self.prev = ch, wait, None

    def __enter__(self):
        ch = self.ch
        self.prev = ch.busy
        ch.seq += 1
        ch.busy = self.wait
        return self

    def __exit__(self, *exc):
        self.ch.busy = self.prev


class _Call:
    """One prepared collective: what the caller's thread validated and resolved, handed to
    ``Communicator._run`` on the caller's thread or the progress thread."""

    __slots__ = ("kind", "body", "x", "alg", "op", "xp", "gpu", "root", "src", "dst", "back",
                 "result", "counts", "displs", "nbytes", "verify", "name")

    def __init__(self, kind, body, x, alg, op, xp, gpu, root=None, src=None, dst=None,
                 back=None, result=None, counts=None, displs=None, nbytes=0, verify=True):
        self.kind, self.body, self.x, self.alg, self.op = kind, body, x, alg, op
        self.xp, self.gpu, self.root = xp, gpu, root
        self.src, self.dst, self.back, self.result = src, dst, back, result
        self.counts, self.displs, self.nbytes, self.verify = counts, displs, nbytes, verify
        self.name = None


# The per-kind bodies: the only code that differs between collectives. Each runs the
# registry's function for the resolved algorithm (or the trivial p = 1 / empty case) and
# returns the collective's result; the generic path does everything around it.
def _body_allreduce(comm, t, c, stats):
    src, dst = c.src, c.dst
    if comm.size > 1 and src.size:
        comm._fn(c.alg, "allreduce", stats)(t, src, dst, reduction(c.xp, c.op, src.dtype),
                                            comm._ctx)
    elif dst is not src:
        t.copy(dst, src)
    return c.result


def _body_reduce_scatter(comm, t, c, stats):
    src, dst = c.src, c.dst
    if comm.size == 1 or src.size == 0:
        if dst.size:
            t.copy(dst, src)
    else:
        comm._fn(c.alg, "reduce_scatter", stats)(
            t, src, dst, reduction(c.xp, c.op, src.dtype), c.counts, c.displs, comm._ctx)
    return c.result


def _body_reduce(comm, t, c, stats):
    src, dst = c.src, c.dst
    if comm.size == 1 or src.size == 0:
        if dst is not None and dst is not src:
            t.copy(dst, src)
    else:
        comm._fn(c.alg, "reduce", stats)(t, src, dst, c.root,
                                         reduction(c.xp, c.op, src.dtype), comm._ctx)
    return c.result


def _body_bcast(comm, t, c, stats):
    buf = c.dst
    if comm.size > 1 and buf.size:
        comm._fn(c.alg, "bcast", stats)(t, buf, c.root, comm._ctx)
    return c.result


def _body_allgather(comm, t, c, stats):
    x, out = c.x, c.result
    n, p = x.size, comm.size
    flat = out.reshape(-1)
    flat[comm.rank * n:(comm.rank + 1) * n] = x.reshape(-1)
    if p > 1 and n:
        comm._fn(c.alg, "allgather", stats)(t, flat, (n,) * p, tuple(range(0, p * n, n)),
                                            comm._ctx)
    return out


def _body_allgather_shards(comm, t, c, stats):
    buf = c.dst
    if comm.size > 1 and buf.size:
        comm._fn(c.alg, "allgather", stats)(t, buf, c.counts, c.displs, comm._ctx)
    return c.result


def _body_allgatherv(comm, t, c, stats):
    x, p = c.x, comm.size
    # One exchange carries the counts and (when checking) the call's description.
    desc = None
    if comm._check:
        desc = describe("allgatherv", c.name, None, x.dtype, None, c.alg)
    counts = _exchange_counts(t.comm, x.size, desc, "allgatherv", c.name)
    displs = [0] * p
    for i in range(1, p):
        displs[i] = displs[i - 1] + counts[i - 1]
    total = displs[-1] + counts[-1]
    c.alg = comm._resolve("allgatherv", c.alg, total * x.itemsize // max(p, 1))
    c.nbytes = total * x.itemsize
    out = c.xp.empty(total, dtype=x.dtype)
    lo = displs[comm.rank]
    out[lo:lo + x.size] = x.reshape(-1)
    if p > 1 and total:
        comm._fn(c.alg, "allgatherv", stats)(t, out, tuple(counts), tuple(displs),
                                             comm._ctx)
    return out, counts


def _exchange_counts(comm, n, desc, kind, name):
    """All-gather one count per rank; with ``desc``, also check that ranks agree."""
    p = comm.Get_size()
    if desc is None:
        counts = np.empty(p, dtype=np.int64)
        comm.Allgather(np.array([n], dtype=np.int64), counts)
        return [int(c) for c in counts]
    mine = np.zeros(8 + DESC_BYTES, dtype=np.uint8)
    mine[:8] = np.frombuffer(np.int64(n).tobytes(), dtype=np.uint8)
    mine[8:] = encode(desc)
    table = np.empty((p, 8 + DESC_BYTES), dtype=np.uint8)
    comm.Allgather(mine, table)
    descs = table[:, 8:]
    if not (descs == descs[0]).all():
        raise_mismatch(descs, kind, name)
    return [int(c) for c in np.ascontiguousarray(table[:, :8]).view(np.int64).reshape(-1)]


def _open_window(ch, start, period):
    """A digest window from call ``start``, compared before call ``start + period``."""
    ch.window = [0] * period
    ch.window_start = start
    ch.period = period
    ch.due = start + period


def _mpi_error(comm, key, error):
    """An MPI error inside a collective, as an error that says which call and why."""
    from .consistency import CollectiveMismatchError  # noqa: PLC0415
    what = stall.describe_busy(key)
    # MPI's error string is a stack of lines; the last one says what happened.
    lines = [ln.split(":", 1)[-1].strip() for ln in error.Get_error_string().splitlines()]
    detail = next((ln for ln in reversed(lines) if ln), "")
    if reports_failure(error):
        return RankFailure(f"rank {comm.world_rank}: {what} on group {comm.group_text} "
                           f"failed: a rank of the group died (MPI: {detail})")
    if error.Get_error_class() == MPI.ERR_TRUNCATE:
        return CollectiveMismatchError(
            f"rank {comm.world_rank}: {what} on group {comm.group_text}: another rank sent "
            f"more data than this call expects (MPI: {detail}; ranks as numbered in this "
            "group): the ranks disagree on this call's shape or dtype, or on which call "
            "this is")
    return RuntimeError(f"rank {comm.world_rank}: {what} on group {comm.group_text} "
                        f"failed in MPI: {detail}")


def _on_device(device_id, event, fn, args):
    """Run ``fn`` on the progress thread with the issuing thread's CUDA device, after the
    kernels that produced its input (``event``); finish the device work before returning."""
    cp = backend.cupy_module()
    with cp.cuda.Device(device_id):
        event.synchronize()
        result = fn(*args)
        cp.cuda.get_current_stream().synchronize()
    return result


"""The stall inspector: a rank that waits too long says what for, and who has not come.

Every wait that can block marks its channel busy while it waits: a collective on any
group (its signature: kind, tensor, shape, dtype, op, algorithm), a point-to-point send,
receive or probe, and the parameter server's protocol (``Communicator.waiting``). One
daemon thread per process (the inspector, started with the first ``Communicator`` when
MPI gives ``MPI_THREAD_MULTIPLE``) wakes every ``warning / 10`` seconds (between 50 ms
and 1 s) and looks at every live communicator:

- It answers the questions other ranks' inspectors sent to this rank: what each channel
  of that communicator is doing now (its call number and what it waits for), and what
  this rank waits for on its other communicators.
- A channel busy with the same call for longer than the stall warning
  (``--stall-warning``, ``MPIDL_STALL_WARNING``, default 60 s) makes it ask the ranks the
  call waits for (every other rank of the group for a collective, the peer for a
  point-to-point call) and print one line: which ranks have not arrived and why (no
  answer: stopped, dead, or never releasing Python's GIL; or what they do instead), which
  wait in the same call. After the stall timeout (``--stall-timeout``,
  ``MPIDL_STALL_TIMEOUT``, 0 = never) it prints that line again and, a second later
  (time for the launcher to forward it), aborts the job (``MPI_Abort``, exit status 1):
  a stopped rank never turns into a silent hang.
- Two ranks found in the same call number of a collective channel with different
  signatures have called different collectives: MPI cannot finish that call, so after
  ``MISMATCH_AFTER`` seconds of waiting the job is aborted with both signatures.

The questions travel on a duplicate communicator of their own (made by the collective
``Communicator`` constructor), so they never meet anybody's data. Waiting costs nothing
extra: the marks are two attribute writes per call, and nobody sends anything unless a
wait has already lasted seconds.

Without ``MPI_THREAD_MULTIPLE`` there is no inspector thread (one line says so when a
communicator is made with a stall warning set); waits then stay silent.
"""

import os
import sys
import threading
import time
import weakref

from mpi4py import MPI

from .. import env
from .ft import is_failure

QUERY, REPLY = 1, 2
MISMATCH_AFTER = 2.0  # seconds in a call before asking whether the peers are in another
STALL_EXIT = 1
ABORT_GRACE_S = 1.0  # seconds for the launcher to forward the last line before
#                      MPI_Abort (as in mpidl/cli/errors.py's World.abort)

_settings = {}


def configure(warning=None, timeout=None):
    """Set the stall warning and timeout (seconds; None keeps the current value, a
    timeout of 0 means never). The command line calls this with ``--stall-warning`` and
    ``--stall-timeout``; defaults come from ``MPIDL_STALL_WARNING``/``MPIDL_STALL_TIMEOUT``."""
    _load()
    if warning is not None:
        if not warning > 0:
            raise ValueError(f"stall warning {warning!r}: expected seconds > 0")
        _settings["warning"] = float(warning)
    if timeout is not None:
        if not timeout >= 0:
            raise ValueError(f"stall timeout {timeout!r}: expected seconds >= 0 (0 = never)")
        _settings["timeout"] = float(timeout)


def settings():
    """``(warning, timeout)`` in seconds (timeout 0: never)."""
    _load()
    return _settings["warning"], _settings["timeout"]


def _interval():
    """Seconds between the inspector's visits (and between its answers to questions)."""
    warning, _ = settings()
    return min(1.0, max(0.05, warning / 10))


def _load():
    if not _settings:
        _settings["warning"] = env.number("MPIDL_STALL_WARNING")
        _settings["timeout"] = env.number("MPIDL_STALL_TIMEOUT")


class Wait:
    """What a channel waits for, when it is not a collective: ``text`` for people, read
    after "has waited 10 s" (so it starts with "in" or "for"), and ``peers`` (group ranks
    it waits for; None: every other rank of the group)."""

    __slots__ = ("_text", "peers")

    def __init__(self, text, peers=None):
        self._text = text  # a str, or a function that makes it: only a stall reads it
        self.peers = peers

    @property
    def text(self):
        text = self._text
        if not isinstance(text, str):
            text = self._text = text()
        return text

    def __repr__(self):
        return self.text


def describe_busy(busy):
    """Text of what a channel is busy with (a collective's signature key or a Wait),
    starting with "in" or "for"."""
    if isinstance(busy, Wait):
        return busy.text
    from .consistency import describe, full_key  # noqa: PLC0415 (imports nothing of us)
    return "in " + describe(*full_key(busy))


def ranks_text(ranks):
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class _Track:
    """What the inspector remembers of one channel between its visits."""

    __slots__ = ("seq", "since", "warned", "mismatch_checked")

    def __init__(self, seq, since):
        self.seq, self.since = seq, since
        self.warned = self.mismatch_checked = False


class Inspector:
    """The per-process inspector thread (see the module doc)."""

    def __init__(self):
        self.lock = threading.Lock()  # held while visiting a communicator; close() takes it
        self._comms = weakref.WeakSet()
        self._stop = threading.Event()
        self._thread = None
        self._sends = []
        self._query_id = 0

    # -- registration (called by Communicator)
    def register(self, comm):
        with self.lock:
            self._comms.add(comm)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpidl-stall",
                                                daemon=True)
                self._thread.start()

    def unregister(self, comm):
        with self.lock:
            self._comms.discard(comm)

    def stop(self, timeout=3.0):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop
    def _run(self):
        while not self._stop.is_set():
            self._stop.wait(_interval())
            if self._stop.is_set() or MPI.Is_finalized():
                return
            try:
                with self.lock:
                    for comm in list(self._comms):
                        if not comm._closed:
                            self._visit_alive(comm)
                    self._sends = [r for r in self._sends if not _done(r)]
            except Exception as e:  # the inspector must never take the job down itself
                print(f"mpidl: stall inspector stopped: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
                return

    def _visit_alive(self, comm):
        """Visit ``comm``, unless a rank of it died (ULFM reports it): the group is then
        the elastic run's to mend (``mpidl.comm.ft``), not a stall; it is forgotten."""
        try:
            self._visit(comm)
        except Exception as e:
            if not is_failure(e):
                raise
            self._comms.discard(comm)

    def _visit(self, comm):
        self.answer(comm)
        now = time.monotonic()
        warning, timeout = settings()
        for ch in comm._channels:
            busy, seq = ch.busy, ch.seq
            track = ch.track
            if busy is None:
                ch.track = None
                continue
            if track is None or track.seq != seq:
                ch.track = _Track(seq, now)
                continue
            waited = now - track.since
            collective = not isinstance(busy, Wait)
            mismatch = collective and not track.mismatch_checked and waited > MISMATCH_AFTER
            expired = timeout and waited > timeout
            warn = not track.warned and waited > warning
            if not (mismatch or expired or warn):
                continue
            # one inquiry serves all three: every answer is checked for a mismatch
            report = self.inquire(comm, ch, busy, seq, waited)
            if report is None:  # the wait ended meanwhile
                continue
            track.mismatch_checked = True
            if report.mismatch:
                self._abort(f"mpidl: rank {comm.world_rank}: {report.mismatch}")
            if expired:
                self._abort(f"mpidl: stall timeout ({timeout:g} s, --stall-timeout): "
                            f"{report.text} Ending the job.")
            if warn:
                track.warned = True
                print(f"mpidl: stall: {report.text}", file=sys.stderr, flush=True)

    def _abort(self, message):
        """Print ``message`` and end the job (MPI_Abort) ``ABORT_GRACE_S`` later: MPICH's
        hydra kills the ranks without draining their output pipes, so a line written just
        before MPI_Abort was sometimes lost (the job ended with status 1 and no line saying
        why). Every rank that times out prints first and then waits as long, so when the
        ranks of a stall time out together, their lines come out before the first abort."""
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        if MPI.Is_finalized():  # the main thread finished MPI meanwhile: end this rank
            os._exit(STALL_EXIT)
        MPI.COMM_WORLD.Abort(STALL_EXIT)

    # -- questions and answers
    def state(self, comm):
        """This rank's answer about ``comm``: per channel (calls started, what it waits
        for or None, whether that is a collective), and what it waits for on its other
        communicators."""
        channels = {}
        for ch in comm._channels:
            seq, busy = ch.seq, ch.busy  # read once: the caller's thread changes them
            channels[ch.role] = (seq, None if busy is None else describe_busy(busy),
                                 busy is not None and not isinstance(busy, Wait))
        elsewhere = []
        for other in list(self._comms):
            if other is comm or other._closed:
                continue
            for ch in other._channels:
                busy = ch.busy
                if busy is not None:
                    elsewhere.append(f"{describe_busy(busy)} on group {other.group_text}")
        return {"channels": channels, "elsewhere": elsewhere}

    def answer(self, comm):
        """Answer every question waiting on ``comm``'s inspection communicator."""
        icomm = comm._inspect
        status = MPI.Status()
        while icomm.Iprobe(MPI.ANY_SOURCE, QUERY, status):
            source = status.Get_source()
            query = icomm.recv(source=source, tag=QUERY)
            reply = dict(self.state(comm), id=query)
            self._sends.append(icomm.isend(reply, dest=source, tag=REPLY))

    def inquire(self, comm, ch, busy, seq, waited):
        """Ask the ranks ``busy`` waits for what they do; None if the wait ended meanwhile."""
        icomm = comm._inspect
        if isinstance(busy, Wait) and busy.peers is not None:
            peers = [r for r in busy.peers if r != comm.rank]
        else:
            peers = [r for r in range(comm.size) if r != comm.rank]
        self._query_id += 1
        qid = self._query_id
        for r in peers:
            self._sends.append(icomm.isend(qid, dest=r, tag=QUERY))
        deadline = time.monotonic() + 2 * _interval() + 0.5
        replies = {}
        status = MPI.Status()
        while len(replies) < len(peers) and time.monotonic() < deadline:
            self.answer(comm)  # a peer may be asking us at the same moment
            while icomm.Iprobe(MPI.ANY_SOURCE, REPLY, status):
                source = status.Get_source()
                reply = icomm.recv(source=source, tag=REPLY)
                if reply.get("id") == qid:
                    replies[source] = reply
            time.sleep(0.01)
        if ch.busy is not busy or ch.seq != seq:
            return None
        return _Report(comm, ch, busy, seq, waited, peers, replies)


class _Report:
    """The line a stall prints, built from the peers' answers.

    For a collective, each peer has either arrived (it waits in the same call, with the
    same signature), is past it (it started this call and left it, or a later one: a
    reduce's non-root, or a rank now in the signature check), or has not arrived (no
    answer, or fewer calls started). A peer in the same call number with another
    collective signature is a mismatch: MPI cannot finish that call."""

    def __init__(self, comm, ch, busy, seq, waited, peers, replies):
        me = describe_busy(busy)
        collective = not isinstance(busy, Wait)
        world = comm.world_ranks
        absent, past, same, other = [], [], [], []
        self.mismatch = None
        for r in peers:
            name = f"rank {world[r]}"
            reply = replies.get(r)
            if reply is None:
                absent.append(f"{name} (no answer: stopped, exited, or holding Python's GIL)")
                continue
            their_seq, their_busy, their_collective = reply["channels"].get(
                ch.role, (None, None, False))
            if their_busy is not None:
                doing = f"waiting {their_busy}"
            else:
                elsewhere = reply.get("elsewhere") or []
                doing = ("waiting " + " and ".join(elsewhere) if elsewhere
                         else "not waiting in mpidl (computing, or between calls)")
            if not collective:
                other.append(f"{name} is {doing}")
                continue
            if their_seq == seq and their_collective:
                if their_busy == me:
                    same.append(world[r])
                    continue
                self.mismatch = (f"ranks disagree on call {seq} of group {comm.group_text}: "
                                 f"rank {comm.world_rank} is {me}, {name} is {their_busy}; "
                                 "every rank must make the same collective calls in the "
                                 "same order, with the same name, shape, dtype, op and "
                                 "algorithm")
                absent.append(f"{name} (in another call: {their_busy})")
            elif their_seq is not None and their_seq >= seq:
                past.append(f"{name} ({doing})")
            else:
                absent.append(f"{name} (at call {their_seq}, {doing})")
        thread = " (non-blocking, on the progress thread)" if ch.role == "progress" else ""
        where = f" (call {seq} on group {comm.group_text}){thread}" if collective else \
            f" on group {comm.group_text}"
        parts = [f"rank {comm.world_rank} has waited {waited:.0f} s {me}{where}."]
        if collective:
            parts.append(("Not arrived: " + "; ".join(absent) + ".") if absent
                         else "Every rank has arrived.")
            if same:
                parts.append(f"Waiting in the same call: {ranks_text(same)}.")
            if past:
                parts.append("Past this call: " + "; ".join(past) + ".")
        else:
            parts.append("; ".join(other + absent) + ".")
        self.text = " ".join(parts)


INSPECTOR = Inspector()


def _done(request):
    """Whether a reply's send is over (a send to a rank that died is over too)."""
    try:
        return request.Test()
    except MPI.Exception as e:
        if is_failure(e):
            return True
        raise


def available():
    """True when the inspector can run (MPI_THREAD_MULTIPLE)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE

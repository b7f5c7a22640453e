"""Non-blocking collectives: handles, and the thread that makes progress on them.

How progress is made: each communicator owns one progress thread and a duplicate of the
MPI communicator for it. The thread starts at the communicator's first non-blocking call,
not in its constructor: a rank in many groups (a ``Mesh`` with dp, pp and tp axes) then
runs a thread only for the groups that actually use non-blocking collectives, typically
the data-parallel one, instead of one per group. (The duplicate communicator is still
made up front, because ``Dup`` is collective and the constructor already is.) ``iallreduce`` & co. validate their arguments on the caller's
thread, put the call on a FIFO queue and return a ``Handle`` at once (a few
microseconds). The progress thread runs the queued collectives one after the other, in
issue order, which is the same order on every rank, so they match up. It spends its time
inside MPI calls and NumPy/CuPy reductions, which release the GIL, so the caller's
thread keeps computing (e.g. the backward pass) meanwhile; nobody has to spin on
``test()``. ``wait()`` blocks on a lock until the collective is done and returns its
result (or raises its error); ``test()`` only looks. (Between its NumPy calls the caller
holds the GIL; Python hands it to the progress thread at least every switch interval,
5 ms by default — ``sys.setswitchinterval`` shortens that for long pure-Python loops.)

Blocking collectives issued meanwhile run on the caller's thread on another duplicate
communicator, so they never mix with queued ones.

The progress thread waits inside MPI like any caller (MPICH busy-polls). Where it shares
a core with the computation it should overlap, ``MPIDL_PROGRESS_WAIT=poll`` makes it poll
with ``MPI_Test`` and sleep between polls instead (``transport.PoliteHostTransport``).

This needs ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default). When the MPI library
gives less, or ``MPIDL_PROGRESS=eager`` is set, each non-blocking call runs to completion
when it is issued and returns a finished handle: still correct and deadlock-free (same
order on all ranks), just without overlap.
"""

import queue
import threading


class Handle:
    """A collective in flight: ``wait()`` returns its result, ``test()`` says if it is done."""

    __slots__ = ("_lock", "_done", "_result", "_error", "kind", "name", "_timeline")

    def __init__(self, kind, name=None, timeline=None):
        self.kind = kind
        self.name = name
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result = None
        self._error = None
        self._timeline = timeline

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done = True
        self._lock.release()

    def test(self):
        """True once the collective has finished (never blocks, never raises)."""
        return self._done

    @property
    def done(self):
        return self._done

    def wait(self, timeout=None):
        """Block until done; return the result or raise the collective's error.

        ``timeout`` (seconds) raises TimeoutError if the collective is still running.
        """
        if not self._done:
            tl = self._timeline
            start = tl.clock() if tl is not None else 0.0
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"{self.kind} {self.name or ''} still running after "
                                   f"{timeout} s")
            self._lock.release()
            if tl is not None:
                tl.record("wait", f"{self.kind} {self.name or ''}".strip(), "", 0,
                          start, tl.clock(), 0)
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self):
        state = "done" if self._done else "pending"
        return f"<Handle {self.kind} {self.name or ''} {state}>"


def _run(handle, fn, args):
    try:
        result = fn(*args)
    except BaseException as exc:  # delivered to whoever waits
        handle._finish(error=exc)
    else:
        handle._finish(result=result)


class ProgressThread:
    """Runs queued collectives in issue order on a daemon thread."""

    mode = "thread"

    def __init__(self, name="mpidl-progress"):
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def _loop(self):
        get = self._queue.get
        while True:
            job = get()
            if job is None:
                return
            _run(*job)

    def submit(self, handle, fn, *args):
        if self._closed:
            raise RuntimeError("communicator is closed")
        self._queue.put((handle, fn, args))
        return handle

    def close(self, timeout=None):
        """Finish everything queued, then stop the thread. Returns False if the thread is
        still running after ``timeout`` seconds (a collective other ranks never joined)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


class EagerProgress:
    """No thread: each non-blocking call completes when issued."""

    mode = "eager"

    def submit(self, handle, fn, *args):
        _run(handle, fn, args)
        return handle

    def close(self, timeout=None):
        return True

"""Preemption: SIGTERM, SIGINT and SIGUSR1 stop training at a step boundary, resumable.

Schedulers and people stop jobs with a signal: Slurm sends SIGTERM at the time limit and
on ``scancel`` (and any signal asked for with ``--signal``), Hydra's ``mpiexec`` forwards
SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 to every rank. ``StopSignals`` catches those three;
its handler only records which one came (a handler must not communicate or write files:
it runs between two bytecodes of whatever the main thread was doing). The trainer asks the
ranks at every step boundary whether any of them was signalled (one tiny all-reduce,
``Runtime.agree_max``; at the end of every epoch instead for a parameter server, whose
checkpoints exist only there), so every rank stops after the same step, a checkpoint of
that exact position is written, and ``mpidl train`` exits with ``STOPPED_STATUS``.
``mpidl train --resume`` (or ``--resume auto``) then ends bitwise equal to a run that was
never stopped.

A repeated signal changes nothing (Slurm, srun and the batch script may each deliver
one), except a second SIGINT more than a second after the first: that raises
KeyboardInterrupt at once, without a checkpoint, for someone at a terminal who does not
want to wait.
"""

import signal
import threading
import time

#: ``mpidl train``'s exit status after a signal stopped it with a checkpoint written:
#: EX_TEMPFAIL of sysexits.h ("temporary failure; the user is invited to retry"). Distinct
#: from 0 (done), 1 (crash), 2 (user error) and 128+N (killed by signal N).
STOPPED_STATUS = 75

#: the signals that stop training with a checkpoint
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")

#: a second SIGINT later than this (seconds) after the first interrupts at once
FORCE_AFTER_S = 1.0


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Handlers for ``signals`` that record the first one received (see the module doc).

    ``install()`` (main thread only, as Python requires) and ``uninstall()`` put the
    previous handlers back; it is also a context manager. ``received`` is the first
    signal's number (0: none yet); ``request(signum)`` does what a delivered signal does,
    for code that wants to stop training the same way.
    """

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = [getattr(signal, s) if isinstance(s, str) else signal.Signals(s)
                        for s in signals]
        self.received = 0
        self.received_at = None
        self._previous = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals.install() must run in the main thread (Python "
                               "delivers signals there only)")
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self):
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
        return False

    def request(self, signum=signal.SIGTERM):
        if not self.received:
            self.received, self.received_at = int(signum), time.monotonic()

    def _handle(self, signum, frame):
        if (self.received == signal.SIGINT and signum == signal.SIGINT
                and time.monotonic() - self.received_at > FORCE_AFTER_S):
            raise KeyboardInterrupt
        self.request(signum)

    @property
    def name(self):
        """The first signal's name ("SIGTERM"), or None."""
        return signal_name(self.received) if self.received else None

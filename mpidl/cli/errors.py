"""How the ``mpidl`` command ends when something goes wrong, on one rank or many.

* A user error (``mpidl.errors.UserError``: bad flag or config key, negative lr, missing
  data, corrupt file, model that does not fit the data) prints ONE line,
  ``mpidl: error: ...``, and exits with status 2, no traceback. The set-up phase runs
  inside ``Agreement``: at its end the ranks exchange their errors, so a mistake found on
  any rank (even one rank only, say a data folder missing on one node) makes every rank
  exit 2 together, rank 0 printing it once — nobody is left waiting in a collective.
* Anything else is a bug or a crash: the rank prints its traceback with every line
  prefixed ``[rank R]`` and, when there are several ranks, calls
  ``MPI.COMM_WORLD.Abort(1)`` so every rank ends promptly with a non-zero status. One
  rank alone exits 1. ``install_excepthook`` applies the same rule to exceptions that
  escape elsewhere (threads included), so it never depends on ``python -m mpi4py``.
"""

import os
import sys
import threading
import time
import traceback

from mpidl.errors import AgreedUserError, UserError

USER_ERROR_STATUS = 2
CRASH_STATUS = 1
ABORT_GRACE_S = 1.0


class World:
    """This process's place in MPI_COMM_WORLD (rank 0 of 1 when mpi4py is missing)."""

    def __init__(self):
        self.mpi = None
        self.rank, self.size = 0, 1
        try:
            from mpi4py import MPI  # noqa: PLC0415
        except ImportError:
            return
        self.MPI = MPI
        self.mpi = MPI.COMM_WORLD
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()

    @classmethod
    def over(cls, mpi_comm):
        """This process's place in ``mpi_comm`` (an elastic run's survivors)."""
        world = cls.__new__(cls)
        from mpi4py import MPI  # noqa: PLC0415

        world.MPI, world.mpi = MPI, mpi_comm
        world.rank, world.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        return world

    def abort(self, status):
        """End every rank now (MPI_Abort), or just this process when alone.

        Before MPI_Abort the launcher gets ``ABORT_GRACE_S`` to forward what this rank
        just printed: MPICH's hydra kills the ranks without draining their output pipes,
        and on a busy node the traceback saying why was sometimes lost.
        """
        sys.stdout.flush()
        sys.stderr.flush()
        if self.mpi is not None and self.size > 1:
            time.sleep(ABORT_GRACE_S)
            self.mpi.Abort(status)
        os._exit(status)


def format_user_error(message):
    return "mpidl: error: " + " ".join(str(message).split("\n")).strip()


def format_traceback(exc, rank):
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


class Agreement:
    """Context manager for the local set-up phase; see the module docstring.

    Only ``UserError`` takes part (the ranks then all raise ``AgreedUserError``); any other
    exception passes straight through to the crash handler, which aborts every rank.
    Code inside must not communicate: a failing rank would never reach the agreement.
    """

    def __init__(self, world):
        self.world = world

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not issubclass(exc_type, UserError):
            return False
        mine = str(exc) if exc is not None else None
        if self.world.size > 1:
            everyone = self.world.mpi.allgather(mine)
        else:
            everyone = [mine]
        failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
        if not failed:
            return False
        messages = {m for _, m in failed}
        if len(messages) == 1 and len(failed) == len(everyone):
            text = failed[0][1]
        else:  # not every rank saw the same problem: say where
            r, m = failed[0]
            others = len(failed) - 1
            text = f"[rank {r}] {m}" + (f" (and {others} other rank(s))" if others else "")
        raise AgreedUserError(text) from None


def handle(world, fn):
    """Run ``fn()`` and turn what escapes into the exit rules above; returns the status."""
    try:
        status = fn()
        return 0 if status is None else int(status)
    except AgreedUserError as e:
        if e.report if e.report is not None else world.rank == 0:
            print(format_user_error(e), file=sys.stderr, flush=True)
        return USER_ERROR_STATUS
    except UserError as e:  # raised by some ranks only, outside an agreement
        if world.size == 1:
            print(format_user_error(e), file=sys.stderr, flush=True)
            return USER_ERROR_STATUS
        print(f"[rank {world.rank}] {format_user_error(e)}", file=sys.stderr, flush=True)
        world.abort(USER_ERROR_STATUS)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"[rank {world.rank}] interrupted", file=sys.stderr, flush=True)
        if world.size > 1:
            world.abort(130)
        return 130
    except BaseException as e:  # noqa: BLE001 - the whole point
        sys.stderr.write(format_traceback(e, world.rank))
        sys.stderr.flush()
        if world.size > 1:
            world.abort(CRASH_STATUS)
        return CRASH_STATUS


def install_excepthook(world):
    """Make an uncaught exception anywhere (main thread or another) end every rank."""
    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt) and world.size == 1:
            return sys.__excepthook__(exc_type, exc, tb)
        sys.stderr.write(format_traceback(exc.with_traceback(tb), world.rank))
        world.abort(CRASH_STATUS)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook

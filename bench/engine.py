"""Engine speed: one training step of the MLP 784-1024-1024-10 (ReLU, softmax
cross-entropy, SGD with momentum 0.9) at batch 128, mpidl against PyTorch in the same run.

    python bench/engine.py                      # 1 thread, writes results/engine.json
    python bench/engine.py --out bench/results/engine.json --plot bench/results/engine.png
    python bench/engine.py --device gpu --out bench/results/engine_gpu.json \
        --plot bench/results/engine_gpu.png    # mlp, cnn, resnet-tiny at batch 128, 1024

With ``--device cpu|gpu`` it times each of ``--models`` at each of ``--batches`` on that
device: mpidl's eager step, on a GPU also the step captured as a CUDA graph and replayed
(``mpidl.engine.cuda_graph``), and PyTorch's eager step on the same model with the same
weights (``mpidl.benchmarks.torch_twin``; TF32 off on both, cuDNN autotuning on). Neither
side reads the loss back to the host inside a step; a round of steps ends with one
synchronization and its time divided by its steps is the step time. The first step's
losses of the two frameworks are compared, so both compute the same thing. Each mpidl
step is also broken down per top-level layer (a synchronization around each: only the
shares mean something, the sum is slower than a step).

Thread counts are pinned (OMP/OpenBLAS/MKL environment variables before NumPy is
imported, ``torch.set_num_threads``). The two frameworks are timed in alternating rounds
so drift on a shared machine hits both alike; each figure is the median over all timed
steps, and the step is also split into forward / backward / update. The ratio
mpidl / PyTorch is the figure to quote: absolute times move with the machine's load. The
per-process CPU time of a step is recorded too: on a busy machine it is the steadier
figure, since time slices lost to other processes do not count in it.
"""

import argparse
import json
import os
import platform
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP/torch threads (1)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per framework (60)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (6)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (10)")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch even if installed")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "engine.json"),
                    help="JSON output path (default: bench/results/engine.json)")
    ap.add_argument("--plot", default=None, help="PNG bar chart path (needs matplotlib)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default=None,
                    help="time --models at --batches on this device (default: the CPU MLP "
                         "benchmark)")
    ap.add_argument("--models", default="mlp,cnn,resnet-tiny",
                    help="with --device: comma-separated models (mlp,cnn,resnet-tiny)")
    ap.add_argument("--batches", default="128,1024",
                    help="with --device: comma-separated batch sizes (128,1024)")
    ap.add_argument("--no-graph", action="store_true",
                    help="with --device gpu: skip the CUDA-graph replay")
    ap.add_argument("--layer-steps", type=int, default=10,
                    help="with --device: steps of the per-layer breakdown (10)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # must happen before NumPy (and its BLAS) is imported
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpidl.benchmarks.machine import cpu_model  # noqa: E402
from mpidl.engine import SGD, SoftmaxCrossEntropy, build_model  # noqa: E402

PHASES = ("forward", "backward", "update")
LR, MOMENTUM = 0.01, 0.9


def blas_info():
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        return {"name": blas.get("name"), "version": blas.get("version"),
                "config": blas.get("openblas configuration")}
    except Exception:  # older NumPy
        return {"name": "unknown"}


def make_data(batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((batch, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    return x, y


class MpidlStep:
    def __init__(self, x, y, fused=None):
        self.model = build_model("mlp", seed=0)
        self.opt = SGD(self.model.named_parameters(), lr=LR, momentum=MOMENTUM, fused=fused)
        self.loss = SoftmaxCrossEntropy()
        self.x, self.y = x, y

    def __call__(self, times=None):
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad()
        self.loss.forward(self.model.forward(self.x), self.y)
        t1 = time.perf_counter()
        self.model.backward(self.loss.backward())
        t2 = time.perf_counter()
        self.opt.step()
        t3, c3 = time.perf_counter(), time.process_time()
        if times is not None:
            times.append((t1 - t0, t2 - t1, t3 - t2, c3 - c0))


class TorchStep:
    def __init__(self, torch, x, y):
        nn = torch.nn
        torch.manual_seed(0)
        self.torch = torch
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(),
                                   nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.loss = nn.CrossEntropyLoss()
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __call__(self, times=None):
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad()
        loss = self.loss(self.model(self.x), self.y)
        loss.item()  # what mpidl's loss.forward returns
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3, c3 = time.perf_counter(), time.process_time()
        if times is not None:
            times.append((t1 - t0, t2 - t1, t3 - t2, c3 - c0))


def summarize(times):
    arr = np.asarray(times) * 1e3
    total = arr[:, :3].sum(axis=1)
    out = {"step_ms_median": float(np.median(total)), "step_ms_min": float(total.min()),
           "step_ms_p90": float(np.percentile(total, 90)), "steps": int(len(total)),
           "step_cpu_ms_median": float(np.median(arr[:, 3]))}
    for k, phase in enumerate(PHASES):
        out[f"{phase}_ms_median"] = float(np.median(arr[:, k]))
    return out


def run(args):
    x, y = make_data(args.batch)
    runners = {"mpidl": MpidlStep(x, y), "mpidl_numpy_update": MpidlStep(x, y, fused=False)}
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import numba  # noqa: PLC0415

        versions["numba"] = numba.__version__
    except ImportError:
        pass
    if not args.no_torch:
        try:
            import torch  # noqa: PLC0415

            torch.set_num_threads(args.threads)
            runners["torch"] = TorchStep(torch, x, y)
            versions["torch"] = torch.__version__
        except ImportError:
            print("PyTorch not installed: timing mpidl alone", file=sys.stderr)
    times = {name: [] for name in runners}
    for name, step in runners.items():
        for _ in range(args.warmup):
            step()
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for name, step in runners.items():
            for _ in range(per_round):
                step(times[name])
    results = {name: summarize(t) for name, t in times.items()}
    report = {
        "benchmark": "engine_mlp_step",
        "model": "MLP 784-1024-1024-10, ReLU, softmax cross-entropy, SGD momentum 0.9",
        "batch": args.batch, "threads": args.threads,
        "results": results,
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count(),
                    "platform": platform.platform(), "blas": blas_info()},
        "versions": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if "torch" in results:
        report["ratio_mpidl_over_torch"] = (results["mpidl"]["step_ms_median"]
                                            / results["torch"]["step_ms_median"])
        report["ratio_mpidl_over_torch_cpu_time"] = (results["mpidl"]["step_cpu_ms_median"]
                                                     / results["torch"]["step_cpu_ms_median"])
    report["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return report


def print_report(report):
    print(f"{report['model']}, batch {report['batch']}, {report['threads']} thread(s)")
    print(f"{'':22s} {'step ms':>8s} {'fwd':>7s} {'bwd':>7s} {'update':>7s} {'cpu ms':>7s}")
    for name, r in report["results"].items():
        print(f"{name:22s} {r['step_ms_median']:8.2f} {r['forward_ms_median']:7.2f} "
              f"{r['backward_ms_median']:7.2f} {r['update_ms_median']:7.2f} "
              f"{r['step_cpu_ms_median']:7.2f}")
    if "ratio_mpidl_over_torch" in report:
        print(f"mpidl / PyTorch step time: {report['ratio_mpidl_over_torch']:.3f} wall, "
              f"{report['ratio_mpidl_over_torch_cpu_time']:.3f} CPU time "
              f"(load average {report['load_average'][0]:.1f})")


def plot(report, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    names = list(report["results"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    left = np.zeros(len(names))
    for phase in PHASES:
        vals = np.array([report["results"][n][f"{phase}_ms_median"] for n in names])
        ax.barh(names, vals, left=left, label=phase)
        left += vals
    ax.set_xlabel("ms per step (median)")
    ax.set_title(f"MLP 784-1024-1024-10 step, batch {report['batch']}, "
                 f"{report['threads']} thread(s)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    if ARGS.device is not None:
        import engine_device  # noqa: PLC0415 - bench/engine_device.py, beside this file

        report = engine_device.run(ARGS)
        engine_device.print_report(report)
    else:
        report = run(ARGS)
        print_report(report)
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"results: {ARGS.out}")
    if ARGS.plot:
        (engine_device.plot if ARGS.device is not None else plot)(report, ARGS.plot)


if __name__ == "__main__":
    main()

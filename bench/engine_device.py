"""``bench/engine.py --device cpu|gpu``: the training step of several models at several
batch sizes, mpidl (eager, and on a GPU replayed as a CUDA graph) against PyTorch on the
same device with the same weights. See ``bench/engine.py``'s docstring for the method."""

import os
import platform
import time

import numpy as np

from mpidl import backend
from mpidl.benchmarks.machine import cpu_model
from mpidl.benchmarks.torch_twin import torch_twin
from mpidl.engine import SGD, SoftmaxCrossEntropy, build_model
from mpidl.engine.cuda_graph import GraphedStep

LR, MOMENTUM = 0.01, 0.9


def make_batch(batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((batch, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    return x, y


class MpidlStep:
    """One eager step; the loss stays on the device (as PyTorch's does)."""

    def __init__(self, name, x, y):
        self.model = build_model(name, seed=0)
        self.opt = SGD(self.model.named_parameters(), lr=LR, momentum=MOMENTUM)
        self.loss = SoftmaxCrossEntropy()
        self.x, self.y = backend.to_device(x), backend.to_device(y)

    def __call__(self):
        self.opt.zero_grad()
        value = self.loss.forward_array(self.model.forward(self.x), self.y, check_labels=False)
        self.model.backward(self.loss.backward())
        self.opt.step()
        return value


class GraphStep(MpidlStep):
    def __init__(self, name, x, y):
        super().__init__(name, x, y)
        self.graphed = GraphedStep(self.model, self.loss, self.opt)

    def __call__(self):
        return self.graphed(self.x, self.y)


class TorchStep:
    def __init__(self, torch, name, x, y, device):
        self.torch = torch
        self.model = torch_twin(build_model(name, seed=0), torch, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.loss = torch.nn.CrossEntropyLoss()
        self.x = torch.from_numpy(x).to(device)
        self.y = torch.from_numpy(y).to(device)

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        value = self.loss(self.model(self.x), self.y)
        value.backward()
        self.opt.step()
        return value


def _sync(device, torch):
    if device == "gpu":
        backend.synchronize()
        if torch is not None:
            torch.cuda.synchronize()


def time_rounds(runners, steps, rounds, warmup, device, torch):
    """Median and min step time (ms) of each runner over alternating rounds."""
    for step in runners.values():
        for _ in range(warmup):
            step()
    _sync(device, torch)
    per_round = max(1, steps // rounds)
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, step in runners.items():
            _sync(device, torch)
            t0 = time.perf_counter()
            for _ in range(per_round):
                step()
            _sync(device, torch)
            times[name].append((time.perf_counter() - t0) / per_round * 1e3)
    return {name: {"step_ms_median": float(np.median(t)), "step_ms_min": float(np.min(t)),
                   "rounds": len(t), "steps_per_round": per_round}
            for name, t in times.items()}


def layer_breakdown(step, steps, device):
    """Median ms per top-level layer's forward and backward, the loss and the update,
    with a synchronization at each boundary (pre-hooks on the top-level layers)."""
    marks = []

    def mark(label):
        _sync(device, None)
        marks.append((label, time.perf_counter()))

    def hook(layer, phase):
        mark(f"{phase} {layer_names[id(layer)]}")

    layers = step.model.layers
    layer_names = {id(layer): f"{i}:{type(layer).__name__}" for i, layer in enumerate(layers)}
    for layer in layers:
        layer.add_pre_hook(hook)
    samples = {}
    try:
        for _ in range(steps):
            marks.clear()
            mark("zero_grad")
            step.opt.zero_grad()
            out = step.model.forward(step.x)
            mark("loss")
            step.loss.forward_array(out, step.y, check_labels=False)
            dy = step.loss.backward()
            step.model.backward(dy)
            mark("optimizer step")
            step.opt.step()
            mark("end")
            for (label, t0), (_, t1) in zip(marks, marks[1:]):
                samples.setdefault(label, []).append((t1 - t0) * 1e3)
    finally:
        for layer in layers:
            layer.remove_pre_hook(hook)
    return {label: float(np.median(v)) for label, v in samples.items()}


def first_losses(name, x, y, torch, device):
    """The first step's loss of mpidl and of its PyTorch twin, as float64 numbers."""
    step = MpidlStep(name, x, y)
    ours = float(step())
    theirs = None
    if torch is not None:
        theirs = float(TorchStep(torch, name, x, y, _torch_device(device))().detach())
    return ours, theirs


def _torch_device(device):
    return "cuda" if device == "gpu" else "cpu"


def _import_torch(args):
    if args.no_torch:
        return None
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        print("PyTorch not installed: timing mpidl alone")
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    return torch


def run(args):
    device = args.device
    backend.use(device)
    torch = _import_torch(args)
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    results = {}
    for name in models:
        for batch in batches:
            x, y = make_batch(batch)
            runners = {"mpidl": MpidlStep(name, x, y)}
            graph_reason = None
            if device == "gpu" and not args.no_graph:
                runners["mpidl_graph"] = GraphStep(name, x, y)
            if torch is not None:
                runners["torch"] = TorchStep(torch, name, x, y, _torch_device(device))
            timed = time_rounds(runners, args.steps, args.rounds, args.warmup, device, torch)
            if "mpidl_graph" in runners:
                graphed = runners["mpidl_graph"].graphed
                graph_reason = None if graphed.captured else graphed.reason
                timed["mpidl_graph"]["replays"] = graphed.replays
            ours, theirs = first_losses(name, x, y, torch, device)
            entry = {"model": name, "batch": batch, "results": timed,
                     "first_loss": {"mpidl": ours, "torch": theirs},
                     "graph_captured": graph_reason is None and "mpidl_graph" in runners,
                     "graph_reason": graph_reason,
                     "layers_ms": layer_breakdown(MpidlStep(name, x, y), args.layer_steps,
                                                  device)}
            if "torch" in timed:
                t = timed["torch"]["step_ms_median"]
                entry["ratio_mpidl_over_torch"] = timed["mpidl"]["step_ms_median"] / t
                if "mpidl_graph" in timed:
                    entry["ratio_graph_over_torch"] = timed["mpidl_graph"]["step_ms_median"] / t
            results[f"{name}@{batch}"] = entry
            print_entry(entry, flush=True)
    return {"benchmark": "engine_step_by_model", "device": device_info(device, torch),
            "lr": LR, "momentum": MOMENTUM, "results": results,
            "versions": versions(torch), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def device_info(device, torch):
    info = {"kind": device, "cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "platform": platform.platform()}
    if device == "gpu":
        cp = backend.cupy_module()
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        info["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        info["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
    return info


def versions(torch):
    out = {"python": platform.python_version(), "numpy": np.__version__}
    cp = backend.cupy_module()
    if cp is not None:
        out["cupy"] = cp.__version__
    if torch is not None:
        out["torch"] = torch.__version__
    return out


def print_entry(entry, flush=False):
    r = entry["results"]
    parts = [f"{name} {v['step_ms_median']:.3f} ms" for name, v in r.items()]
    line = f"{entry['model']:12s} batch {entry['batch']:5d}: " + ", ".join(parts)
    if "ratio_mpidl_over_torch" in entry:
        line += f"; mpidl/torch {entry['ratio_mpidl_over_torch']:.2f}"
    if "ratio_graph_over_torch" in entry:
        line += f", graph/torch {entry['ratio_graph_over_torch']:.2f}"
    if entry.get("graph_reason"):
        line += f" (not captured: {entry['graph_reason']})"
    fl = entry["first_loss"]
    if fl["torch"] is not None:
        line += f"; first loss {fl['mpidl']:.6f} vs {fl['torch']:.6f}"
    print(line, flush=flush)


def print_report(report):
    print(f"device: {report['device'].get('gpu', report['device']['cpu'])}")
    for entry in report["results"].values():
        top = sorted(entry["layers_ms"].items(), key=lambda kv: -kv[1])[:4]
        print(f"  {entry['model']}@{entry['batch']} slowest parts: " +
              ", ".join(f"{k} {v:.3f} ms" for k, v in top))


def plot(report, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    keys = list(report["results"])
    names = ["mpidl", "mpidl_graph", "torch"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    for k, name in enumerate(names):
        vals = [report["results"][key]["results"].get(name, {}).get("step_ms_median", 0.0)
                for key in keys]
        ax.bar(np.arange(len(keys)) + (k - 1) * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(keys)))
    ax.set_xticklabels(keys, fontsize=8, rotation=20)
    ax.set_ylabel("ms per training step (median)")
    dev = report["device"].get("gpu", report["device"]["cpu"])
    ax.set_title(f"training step, mpidl vs PyTorch on {dev}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")

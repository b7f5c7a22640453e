"""Sandblaster L-BFGS: what it computes, against SciPy, and what its coordinator exchanges.

    python bench/lbfgs.py        # -> bench/results/lbfgs.json + lbfgs.png

1. The anchor is SciPy: float64 multinomial logistic regression on the first
   ``--scipy-samples`` Fashion-MNIST images, 20 iterations of ``--optimizer lbfgs``'s
   algorithm on one process and of ``scipy.optimize.minimize(method="L-BFGS-B")`` with
   its defaults (memory 10, the same line search): ``max |x - x_scipy|`` per iteration
   (SciPy's iterates from its callback), and both evaluation counts.
2. The mlp on the first ``--samples`` (10 000) images, ``--iterations`` iterations
   (float32, the training set in 16 portions): one process, 1 server + 3 workers, and 2
   servers + 3 workers with the last worker 4x slower (``mpidl train --optimizer lbfgs
   --strategy ps``). Per layout: iterations, evaluations (and every rank's count), final
   loss and test accuracy, whether every iterate's CRC and the final parameters are the
   one-process run's, and the bytes the coordinator exchanged with the other shard
   against the formula (``mpidl.ps.lbfgs.exchange_size``), per iteration.

Wall times are what the runs took on this shared 2-core machine (4 and 5 ranks
oversubscribe it): they are listed, not compared; nothing here is a speed goal.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402
from mpidl.benchmarks.machine import launch_env, mpiexec  # noqa: E402
from mpidl.benchmarks.plotting import pyplot  # noqa: E402


def against_scipy(samples, iterations=20):
    import scipy
    import scipy.optimize as so

    from mpidl.data import load_dataset
    from mpidl.engine import Flatten, Linear, Sequential, SoftmaxCrossEntropy
    from mpidl.engine.lbfgs import LbfgsSettings, minimize
    from mpidl.runtime.dealing import sum_of_portions
    from mpidl.runtime.lbfgs import default_portion_size

    data = load_dataset("fashion-mnist").limit(samples, 1)
    x, y = data.train_x.astype(np.float64), data.train_y
    loss, size = SoftmaxCrossEntropy(), default_portion_size(samples)

    def build():
        return Sequential(Flatten(), Linear(784, 10, init="glorot_uniform", rng=0,
                                            dtype="float64"))

    model = build()
    params = model.named_parameters()

    def flat(ps):
        return np.concatenate([p.data.ravel() for _, p in ps])

    ours = []
    t = time.perf_counter()
    lbfgs = minimize(params, lambda: sum_of_portions(model, loss, x, y, size),
                     LbfgsSettings(iterations=iterations),
                     on_iteration=lambda r: ours.append(flat(params)))
    ours_s = time.perf_counter() - t
    ref = build()
    ref_params = ref.named_parameters()

    def fun(v):
        at = 0
        for _, p in ref_params:
            p.data[...] = v[at:at + p.data.size].reshape(p.data.shape)
            at += p.data.size
        f, g = sum_of_portions(ref, loss, x, y, size)
        return f, np.concatenate([g[n].ravel() for n, _ in ref_params])

    theirs = []
    t = time.perf_counter()
    res = so.minimize(fun, flat(ref_params), jac=True, method="L-BFGS-B",
                      callback=lambda xk: theirs.append(np.array(xk)),
                      options={"maxiter": iterations})
    scipy_s = time.perf_counter() - t
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(ours[1:], theirs)]
    return {"samples": samples, "scipy": scipy.__version__, "iterations": len(diffs),
            "max_abs_diff_per_iteration": diffs, "max_abs_diff": max(diffs),
            "max_abs_x": float(np.max(np.abs(theirs[-1]))),
            "evaluations": lbfgs.evaluations, "scipy_evaluations": int(res.nfev),
            "seconds": ours_s, "scipy_seconds": scipy_s}


LAYOUTS = [("one process", 1, []), ("1 server + 3 workers", 4, ["--strategy", "ps"]),
           ("2 servers + 3 workers, last worker 4x slower", 5,
            ["--strategy", "ps", "--servers", "2", "--straggler", "4:4"])]


def train(a, key, n, extra):
    out = os.path.join(a.work, key)
    shutil.rmtree(out, ignore_errors=True)  # (metrics files are appended to)
    cmd = ([mpiexec(), "-n", str(n)] if n > 1 else []) + [
        sys.executable, "-m", "mpidl.cli.main", "train", "--model", "mlp", "--optimizer",
        "lbfgs", "--limit-train", str(a.samples), "--lbfgs-iterations", str(a.iterations),
        "--no-progress", "--out-dir", out, *extra]
    t = time.time()
    with open(out + ".log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout,
                              check=False, env=launch_env(ROOT))
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {out}.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    with np.load(os.path.join(out, "model.npz")) as f:
        params = {k: f[k] for k in f.files if not k.startswith("__")}
    return lines[:-1], lines[-1], params, time.time() - t


def mlp_layouts(a):
    from mpidl.engine import build_model
    from mpidl.ps.lbfgs import exchange_size
    from mpidl.ps.sharding import shard_parameters

    runs, ref = {}, None
    for key, n, extra in LAYOUTS:
        records, final, params, wall = train(a, key.split(",")[0].replace(" ", "-"), n,
                                             extra)
        ref = ref or (records, params)
        servers = final.get("servers", 0)
        r = {"ranks": n, "wall_s": wall, "iterations": final["iterations"],
             "evaluations": final["evaluations"],
             "evaluations_per_rank": final["evaluations_per_rank"],
             "loss": final["loss"], "grad_max": final["grad_max"],
             "test_loss": final["test_loss"], "test_acc": final["test_acc"],
             "stop": final["stop"], "portions": final["portions"],
             "portion_size": final["portion_size"],
             "loss_per_iteration": [rec["loss"] for rec in records],
             "iterates_equal_one_process": [rec["x_crc"] for rec in records]
             == [rec["x_crc"] for rec in ref[0]],
             "params_equal_one_process": all(np.array_equal(params[k], ref[1][k])
                                             for k in ref[1])}
        if servers:
            tensors = [len(names) for names in shard_parameters(
                build_model("mlp").named_parameters(), servers).names]
            want_bytes, want_messages = exchange_size(records, tensors)
            r.update(servers=servers, tensors_per_shard=tensors,
                     coordinator_bytes=final["coordinator_bytes"],
                     coordinator_messages=final["coordinator_messages"],
                     formula_bytes=want_bytes, formula_messages=want_messages,
                     coordinator_bytes_per_iteration=final["coordinator_bytes"]
                     / max(final["iterations"], 1),
                     portions_dealt=final["portions_dealt"],
                     backup_copies=final["portions_dealt"]
                     - final["evaluations"] * final["portions"])
        runs[key] = r
        print(json.dumps({key: {k: v for k, v in r.items() if "per_iteration" not in k}}),
              flush=True)
    return runs


def plot(results, path):
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    s = results["scipy"]
    left.semilogy(range(1, len(s["max_abs_diff_per_iteration"]) + 1),
                  [max(d, 1e-17) for d in s["max_abs_diff_per_iteration"]], "o-")
    left.axhline(1e-10, color="gray", ls="--", label="1e-10")
    left.set(xlabel="iteration", ylabel="max |x - x_scipy|",
             title=f"logistic regression, float64, {s['samples']} images")
    left.legend()
    for key, r in results["mlp"].items():
        right.plot(r["loss_per_iteration"], label=f"{key} (test acc {r['test_acc']:.3f})")
    right.set(xlabel="iteration", ylabel="training loss (full batch)",
              title=f"mlp, {results['settings']['samples']} images: the curves coincide")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--scipy-samples", type=int, default=10000)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--work", default="/tmp/mpidl-bench-lbfgs")
    p.add_argument("--out", default=os.path.join(HERE, "results", "lbfgs.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "results", "lbfgs.png"))
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    results = {"machine": describe_machine(), "settings": vars(a)}
    results["scipy"] = against_scipy(a.scipy_samples)
    print(json.dumps({k: v for k, v in results["scipy"].items()
                      if k != "max_abs_diff_per_iteration"}), flush=True)
    results["mlp"] = mlp_layouts(a)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, a.plot)
    print(f"wrote {a.out} and {a.plot}")


if __name__ == "__main__":
    main()

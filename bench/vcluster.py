"""All-reduce across a virtual multi-node cluster: node-aware against the flat ring and MPI.

    python bench/vcluster.py            # 2 nodes x 2 ranks, 1gbit links -> bench/results/vcluster.json + .png
    python bench/vcluster.py --nodes 2 --ppn 2 --rate 1gbit --sizes 1MiB,4MiB,16MiB,64MiB --iters 7

The cluster is ``slurm/vcluster.sh``'s: each node a network namespace with its own host
name, the nodes joined by a bridge whose links are rate-limited with ``tbf`` in both
directions, MPI (the venv's MPICH) between nodes over TCP and inside a node over shared
memory. The script brings the cluster up if it is down (and takes it down at the end), or
uses one that is up with the same nodes and rate.

For each size (float32) the ranks run ``allreduce`` with the node-aware algorithm
(``hierarchical``: reduce inside each node to its leader, ring among the leaders,
broadcast inside), the flat ring over all ranks and MPI's own ``Allreduce``, in turn
(round-robin, a barrier before each call, so a change of load falls on all alike); a
call's time is the slowest rank's; the figure is the median over ``--iters`` rounds after
one warm-up round. The wire alone needs ``bytes x 8 / rate`` per crossing; the
node-aware algorithm sends 2 (n - 1) / n of the buffer over each node's link (n nodes), the
flat ring, with r ranks per node laid out node by node, as much per rank and r times as
much over each link (``model`` in the JSON).

The ranks oversubscribe nothing at 2 x 2 on 2 cores only if the ranks mostly wait on the
link; the JSON keeps the load averages.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpidl.benchmarks.machine import describe as describe_machine  # noqa: E402

VCLUSTER = os.path.join(ROOT, "slurm", "vcluster.sh")
ALGORITHMS = ("hierarchical", "ring", "mpi")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text):
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def rate_bits(rate):
    """tbf's rate ('1gbit', '100mbit', '500kbit') in bits per second."""
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(suffix):
            return float(rate[:-len(suffix)]) * scale
    raise ValueError(f"--rate {rate!r}: expected a tbf rate such as 1gbit or 100mbit")


# -- the ranks' part --------------------------------------------------------------------
def run_rank(a):
    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    from mpidl.comm import Communicator  # noqa: PLC0415
    from mpidl.comm.hierarchical import node_layout  # noqa: PLC0415

    comm = Communicator()
    mpi = comm.mpi
    out = {"p": comm.size, "nodes": node_layout(mpi), "sizes": {}}
    clock = time.perf_counter
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        x = np.ones(size // 4, np.float32)
        dst = np.empty_like(x)
        times = {alg: [] for alg in ALGORITHMS}
        for it in range(a.iters + 1):
            for alg in ALGORITHMS:
                mpi.Barrier()
                t = clock()
                comm.allreduce(x, out=dst, algorithm=alg, name=f"bench {size}")
                dt = mpi.allreduce(clock() - t, op=MPI.MAX)
                if it:  # the first round warms up buffers and connections
                    times[alg].append(dt)
        out["sizes"][size] = times
        if comm.rank == 0:
            print(f"{size} bytes: " + ", ".join(
                f"{alg} {1e3 * statistics.median(v):.1f} ms" for alg, v in times.items()),
                flush=True)
    if comm.rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    comm.close()


# -- the launcher -----------------------------------------------------------------------
def _state():
    st = "/run/mpidl-vcluster"
    if not os.path.exists(os.path.join(st, "nodes")):
        return None
    with open(os.path.join(st, "nodes")) as f:
        nodes = len(f.read().split())
    with open(os.path.join(st, "rate")) as f:
        return nodes, f.read().strip()


def model(size, nodes, ppn, rate):
    """Seconds the link alone needs (each node's link carries this many bytes each way)."""
    p = nodes * ppn
    hier = 2 * (nodes - 1) / nodes * size
    ring = 2 * (p - 1) / p * size if nodes > 1 else 0.0  # one ring edge leaves each node
    return {"hierarchical_link_bytes": hier, "ring_link_bytes": ring,
            "hierarchical_wire_s": hier * 8 / rate, "ring_wire_s": ring * 8 / rate}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("_run", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ppn", type=int, default=2, help="ranks per node")
    p.add_argument("--rate", default="1gbit", help="link rate (tbf), both directions")
    p.add_argument("--sizes", default="64KiB,1MiB,4MiB,16MiB,64MiB")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", default=os.path.join(HERE, "results", "vcluster.json"))
    a = p.parse_args()
    if a._run == "_run":
        return run_rank(a)
    state = _state()
    made = False
    if state is None:
        subprocess.run(["bash", VCLUSTER, "up", str(a.nodes), a.rate], check=True)
        made = True
    elif state != (a.nodes, a.rate):
        raise SystemExit(f"a virtual cluster with {state[0]} nodes and rate {state[1]!r} is "
                         f"up; take it down (bash {VCLUSTER} down) or ask for those")
    load_before = os.getloadavg()
    fd, ranks_out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    t0 = time.time()
    try:
        cmd = ["bash", VCLUSTER, "mpiexec", "-n", str(a.nodes * a.ppn), "-ppn", str(a.ppn),
               sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "_run",
               "--sizes", a.sizes, "--iters", str(a.iters), "--out", ranks_out]
        subprocess.run(cmd, check=True, timeout=3600)
        with open(ranks_out) as f:
            got = json.load(f)
    finally:
        os.unlink(ranks_out)
        if made:
            subprocess.run(["bash", VCLUSTER, "down"], check=True)
    bits = rate_bits(a.rate)
    rows = []
    for size, times in got["sizes"].items():
        size = int(size)
        med = {alg: statistics.median(v) for alg, v in times.items()}
        rows.append({"bytes": size, "median_s": med,
                     "min_s": {alg: min(v) for alg, v in times.items()},
                     "max_s": {alg: max(v) for alg, v in times.items()},
                     "hierarchical_speedup_over_ring": med["ring"] / med["hierarchical"],
                     "hierarchical_speedup_over_mpi": med["mpi"] / med["hierarchical"],
                     "model": model(size, a.nodes, a.ppn, bits)})
    res = {"benchmark": "all-reduce (float32) across a virtual multi-node cluster",
           "command": " ".join([sys.executable, *sys.argv]),
           "cluster": {"nodes": a.nodes, "ranks_per_node": a.ppn, "link_rate": a.rate,
                       "node_of_rank": got["nodes"], "mpi": "the venv's MPICH, TCP between "
                       "nodes (UCX_TLS=tcp,self), shared memory inside"},
           "iters": a.iters, "rows": rows, "wall_s": time.time() - t0,
           "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "machine": describe_machine()}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    print()
    print(f"{'size':>10} {'hierarchical':>13} {'ring':>9} {'mpi':>9}  {'x ring':>7} "
          f"{'x mpi':>6}  {'wire, node-aware':>16}")
    for r in rows:
        m = r["median_s"]
        print(f"{r['bytes']:>10} {1e3 * m['hierarchical']:>10.1f} ms {1e3 * m['ring']:>6.1f} ms "
              f"{1e3 * m['mpi']:>6.1f} ms  {r['hierarchical_speedup_over_ring']:>6.2f}x "
              f"{r['hierarchical_speedup_over_mpi']:>5.2f}x  "
              f"{1e3 * r['model']['hierarchical_wire_s']:>13.1f} ms")
    print(f"wrote {a.out}")


def plot(res, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sizes = [r["bytes"] for r in res["rows"]]
    for alg, style in zip(ALGORITHMS, ("o-", "s-", "^-")):
        ax.plot(sizes, [1e3 * r["median_s"][alg] for r in res["rows"]], style, label=alg)
    ax.plot(sizes, [1e3 * r["model"]["hierarchical_wire_s"] for r in res["rows"]], ":",
            color="gray", label="wire time, node-aware (2(n-1)/n x bytes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("ms per all-reduce (median, slowest rank)")
    c = res["cluster"]
    ax.set_title(f"{c['nodes']} nodes x {c['ranks_per_node']} ranks, links {c['link_rate']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

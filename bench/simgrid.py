"""The cost model's network part (``mpidl simulate``) against SimGrid SMPI, to 1024 ranks.

    python bench/simgrid.py                  # 256 and 1024 ranks, 8 per node, every algorithm
    python bench/simgrid.py --ranks 256 --sizes 1KiB,16MiB --algorithms ring,mpi

Needs SimGrid (Debian: ``apt-get install libsimgrid-dev``, which brings ``smpicc`` and
``smpirun``). Writes bench/results/simgrid.json + .png.

For each rank count, a SimGrid platform is described from the same machine file the
model reads (default ``bench/machines/gpu_cluster.json``): nodes of ``ranks_per_node``
hosts, each host on a private full-duplex link of half ``alpha_intra`` and bandwidth
1/``beta_intra`` (two hosts of a node: ``alpha_intra``, 1/``beta_intra``), each node on
one full-duplex link to the others (its share of ``alpha_inter``, bandwidth
1/``beta_inter``, shared by the node's flows). SMPI's corrections for real networks are
switched off (bandwidth and latency factors of 1, no cross traffic), computation is not
simulated, and ``bench/simgrid_allreduce.c`` sends exactly the messages of each mpidl
all-reduce algorithm (``mpi``: SMPI's port of MPICH's algorithm, recursive doubling up
to 2 KiB and Rabenseifner's above). The model is asked the same question with
``gamma = 0`` (no reductions): the seconds of one all-reduce of the size on that
machine.

A row is latency-bound when the model's alpha terms are at least half its time; the
issue's goals: within 10 % for bandwidth-bound rows, 25 % for latency-bound ones. What
this checks is the model's schedule of every algorithm (rounds, which link each round
takes, flows sharing a node's link, pipelined pieces) against an independent simulator
of the same network; not the network itself, nor the compute, nor Python's cost per
message (measured in bench/simulate.py).
"""

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mpidl.benchmarks.collectives import parse_sizes  # noqa: E402
from mpidl.simulate import machine as machines  # noqa: E402
from mpidl.simulate.collectives import Links, Topology, time_allreduce  # noqa: E402

STUB = os.path.join(ROOT, "bench", "simgrid_allreduce.c")
ALGORITHMS = ("ring", "tree", "recursive_doubling", "hierarchical", "mpi")
SEGMENT = 1 << 20  # mpidl's default ring segment (MPIDL_RING_SEGMENT)
SMPI_CFG = ["--cfg=smpi/simulate-computation:no", "--cfg=smpi/bw-factor:0:1",
            "--cfg=smpi/lat-factor:0:1", "--cfg=network/crosstraffic:0"]
GOALS = {"bandwidth": 0.10, "latency": 0.25}


def platform(nodes, per_node, m):
    """SimGrid platform XML for ``nodes`` nodes of ``per_node`` hosts (module doc)."""
    host_lat = m.alpha_intra / 2
    nic_lat = max(0.0, m.alpha_inter - m.alpha_intra) / 2
    out = ["<?xml version='1.0'?>",
           '<!DOCTYPE platform SYSTEM "https://simgrid.org/simgrid.dtd">',
           '<platform version="4.1">', '<zone id="world" routing="Full">']
    for i in range(nodes):
        out.append(f'<cluster id="c{i}" prefix="n{i}-h" suffix="" radical="0-{per_node - 1}" '
                   f'speed="1Gf" bw="{1 / m.beta_intra:.9g}Bps" lat="{host_lat:.9g}s" '
                   'bb_bw="1e15Bps" bb_lat="0s" sharing_policy="SPLITDUPLEX" '
                   f'bb_sharing_policy="FATPIPE" router_id="r{i}"/>')
    for i in range(nodes):
        out.append(f'<link id="nic{i}" bandwidth="{1 / m.beta_inter:.9g}Bps" '
                   f'latency="{nic_lat:.9g}s" sharing_policy="SPLITDUPLEX"/>')
    for i in range(nodes):
        for j in range(nodes):
            if i != j:
                out.append(f'<zoneRoute src="c{i}" dst="c{j}" gw_src="r{i}" gw_dst="r{j}" '
                           f'symmetrical="NO"><link_ctn id="nic{i}" direction="UP"/>'
                           f'<link_ctn id="nic{j}" direction="DOWN"/></zoneRoute>')
    out += ["</zone>", "</platform>"]
    return "\n".join(out) + "\n"


def write_platform(work, p, per_node, m):
    """The platform and host files of ``p`` ranks, ``per_node`` per node, in ``work``
    (the names ``simulate`` reads)."""
    nodes = -(-p // per_node)
    with open(os.path.join(work, f"platform_{nodes}x{per_node}.xml"), "w") as f:
        f.write(platform(nodes, per_node, m))
    with open(os.path.join(work, f"hosts_{nodes}x{per_node}.txt"), "w") as f:
        f.writelines(f"n{i}-h{k}\n" for i in range(nodes) for k in range(per_node))
    return nodes


def predict(m, p, per_node, algorithm, nbytes):
    """(model seconds with gamma = 0, share of them that is alpha terms)."""
    net = copy.copy(m)
    net.gamma = 0.0
    total = time_allreduce(algorithm, Links(net, Topology(p, per_node)), nbytes // 4, 4,
                           SEGMENT)
    net.beta_intra = net.beta_inter = 0.0
    alphas = time_allreduce(algorithm, Links(net, Topology(p, per_node)), nbytes // 4, 4,
                            SEGMENT)
    return total, alphas / total if total else 0.0


def simulate(work, binary, p, per_node, algorithm, nbytes, repeats):
    """SMPI's seconds per call."""
    nodes = -(-p // per_node)
    plat = os.path.join(work, f"platform_{nodes}x{per_node}.xml")
    hosts = os.path.join(work, f"hosts_{nodes}x{per_node}.txt")
    # SMPI_SHARED_MALLOC maps its folded memory block by block: 1 MiB blocks would take
    # more mappings than Linux allows a process (vm.max_map_count) at 1024 ranks x 64 MiB
    block = 1 << max(20, (nbytes - 1).bit_length())
    cfg = SMPI_CFG + [f"--cfg=smpi/shared-malloc-blocksize:{block}"]
    if algorithm == "mpi":
        cfg.append(f"--cfg=smpi/allreduce:{'rdb' if nbytes <= 2048 else 'rab_rdb'}")
    cmd = ["smpirun", "-np", str(p), "-platform", plat, "-hostfile", hosts, *cfg, binary,
           algorithm, str(nbytes), str(repeats), str(per_node)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    found = re.search(r"^TIME (\S+)", run.stdout, re.M)
    if run.returncode != 0 or not found:
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"smpirun {algorithm} {nbytes} B on {p} ranks failed "
                           f"(exit {run.returncode}): " + " | ".join(tail))
    return float(found.group(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", default=os.path.join(ROOT, "bench", "machines",
                                                      "gpu_cluster.json"))
    ap.add_argument("--ranks", default="256,1024", help="rank counts (default 256,1024)")
    ap.add_argument("--sizes", default="1KiB,64KiB,1MiB,16MiB,64MiB")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--repeats", type=int, default=1, help="calls per simulation")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "simgrid.json"))
    a = ap.parse_args(argv)
    missing = [tool for tool in ("smpicc", "smpirun") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench/simgrid.py: {' and '.join(missing)} not found: install SimGrid "
                 "(Debian: apt-get install libsimgrid-dev)")
    m = machines.load(a.machine)
    per_node = m.ranks_per_node
    ranks = [int(r) for r in a.ranks.split(",")]
    sizes = parse_sizes(a.sizes)
    algorithms = a.algorithms.split(",")
    unknown = [x for x in algorithms if x not in ALGORITHMS]
    if unknown:
        sys.exit(f"bench/simgrid.py: --algorithms {','.join(unknown)}: expected some of "
                 f"{', '.join(ALGORITHMS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpidl-simgrid-") as work:
        binary = os.path.join(work, "simgrid_allreduce")
        subprocess.run(["smpicc", "-O2", "-o", binary, STUB], check=True, cwd=work)
        version = subprocess.run(["smpirun", "-version"], capture_output=True, text=True,
                                 cwd=work).stdout.strip().splitlines()
        for p in ranks:
            nodes = write_platform(work, p, per_node, m)
            for algorithm in algorithms:
                for nbytes in sizes:
                    t0 = time.perf_counter()
                    sim = simulate(work, binary, p, per_node, algorithm, nbytes, a.repeats)
                    model, alpha_share = predict(m, p, per_node, algorithm, nbytes)
                    bound = "latency" if alpha_share >= 0.5 else "bandwidth"
                    error = (model - sim) / sim
                    rows.append({"ranks": p, "nodes": nodes, "algorithm": algorithm,
                                 "bytes": nbytes, "simgrid_s": sim, "model_s": model,
                                 "error": error, "alpha_share": alpha_share, "bound": bound,
                                 "within_goal": abs(error) <= GOALS[bound],
                                 "simulation_wall_s": time.perf_counter() - t0})
                    print(f"p={p:5d} {algorithm:18s} {nbytes:>10d} B  SimGrid "
                          f"{1e3 * sim:10.4f} ms  model {1e3 * model:10.4f} ms  "
                          f"{100 * error:+7.2f} %  ({bound}-bound)", flush=True)
    for bound, goal in GOALS.items():
        errs = [abs(r["error"]) for r in rows if r["bound"] == bound]
        if errs:
            ok = all(e <= goal for e in errs)
            print(f"goal {'met   ' if ok else 'MISSED'} {bound}-bound rows within "
                  f"{100 * goal:.0f} %: worst {100 * max(errs):.2f} % over {len(errs)} rows")
    result = {"benchmark": "simgrid", "machine": m.to_dict() | {"compute": "(not used)"},
              "machine_file": os.path.relpath(a.machine, ROOT), "smpi_config": SMPI_CFG,
              "simgrid": version[:1], "repeats": a.repeats, "goals": GOALS, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(a.out)[0] + ".png")
    print(f"wrote {a.out}")


def plot(result, path):
    from mpidl.benchmarks.plotting import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5.5 * len(ranks), 4), squeeze=False)
    for ax, p in zip(axes[0], ranks):
        for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
            mine = [r for r in rows if r["ranks"] == p and r["algorithm"] == algorithm]
            ax.plot([r["bytes"] for r in mine], [100 * r["error"] for r in mine],
                    marker="o", label=algorithm)
        for y in (-10, 10):
            ax.axhline(y, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("all-reduce bytes")
        ax.set_ylabel("model - SimGrid, % of SimGrid")
        nodes = -(-p // result["machine"]["ranks_per_node"])
        ax.set_title(f"{p} ranks, {nodes} nodes")
        ax.legend(fontsize=7)
    fig.suptitle(f"mpidl simulate vs SimGrid SMPI: {result['machine']['name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

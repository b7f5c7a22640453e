"""A real multi-node run on one machine: ``slurm/vcluster.sh`` brings up two "nodes"
(network namespaces with their own host names and addresses, joined by a bridge; MPI
between them over TCP), the tests run MPI across them, and the cluster is taken down
with nothing left behind (no namespace, bridge or /etc/hosts line).

Needs root and iproute2; skipped otherwise, or when a virtual cluster is already up
(someone else's: the tests never touch it).
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpirun import model_arrays, needs_fashion, run_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VCLUSTER = os.path.join(ROOT, "slurm", "vcluster.sh")
EQUIVALENCE = os.path.join(HERE, "ranks", "comm_equivalence.py")
STATE = "/run/mpidl-vcluster"

LAYOUT = """
import socket
from mpidl.comm import Communicator
from mpidl.comm.hierarchical import node_layout
c = Communicator()
seen = c.mpi.gather((c.rank, socket.gethostname(), c.local_size, node_layout(c.mpi)))
if c.rank == 0:  # one writer: the ranks' lines would interleave
    for rank, host, local, nodes in seen:
        print("layout", rank, host, local, nodes, flush=True)
c.close()
"""


def _usable():
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    if os.path.exists(STATE):
        return f"a virtual cluster is already up ({STATE}): not touching it"
    from mpi4py import MPI

    vendor = MPI.get_vendor()[0]
    if vendor != "MPICH":  # slurm/vcluster.sh launches through Hydra's ssh hook
        return (f"the virtual cluster's launcher is MPICH's Hydra; this Python's mpi4py "
                f"loads {vendor} (other launchers across the namespaces are not built)")
    return None


def _leftovers():
    nets = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    link = subprocess.run(["ip", "link", "show", "mpidlbr0"], capture_output=True).returncode
    with open("/etc/hosts", encoding="utf-8") as f:
        hosts = [ln for ln in f if "mpidl-vcluster" in ln]
    return ([ln for ln in nets.splitlines() if ln.startswith("mpidl-node")],
            link == 0, hosts, os.path.exists(STATE))


@pytest.fixture(scope="module")
def cluster():
    why = _usable()
    if why:
        pytest.skip(why)
    up = run_command(["bash", VCLUSTER, "up", "2"], timeout=60)
    try:
        up.check()
        yield
    finally:
        down = run_command(["bash", VCLUSTER, "down"], timeout=60)
        assert down.returncode == 0, down.output
        assert _leftovers() == ([], False, [], False), _leftovers()


def across(n, ppn, args, timeout=300):
    return run_command(["bash", VCLUSTER, "mpiexec", "-n", str(n), "-ppn", str(ppn),
                        sys.executable, *args], timeout=timeout)


def test_ranks_see_two_nodes_and_collectives_equal_native_across_them(cluster, tmp_path):
    """Four ranks, two per node: each sees its node's host name and one other rank on
    its node (MPI's shared-memory split), so the node-aware algorithm takes ranks 0-1 and
    2-3 for nodes; every collective of it, of the ring and of MPI's own equals MPI's native
    result across the nodes."""
    script = tmp_path / "layout.py"
    script.write_text(LAYOUT)
    launch = across(4, 2, [str(script)]).check()
    seen = sorted(ln.split()[1:] for ln in launch.output.splitlines()
                  if ln.startswith("layout"))
    assert [s[:3] for s in seen] == [["0", "mpidl-node1", "2"], ["1", "mpidl-node1", "2"],
                                     ["2", "mpidl-node2", "2"], ["3", "mpidl-node2", "2"]], \
        launch.output
    assert all(" ".join(s[3:]) == "[0, 0, 1, 1]" for s in seen), launch.output
    launch = across(4, 2, ["-m", "mpi4py", EQUIVALENCE, "--sections", "grid,random",
                           "--algorithms", "hierarchical,ring,mpi"]).check()
    assert "EQUIVALENCE OK p=4" in launch.output, launch.output


def test_data_parallelism_across_nodes_equals_one_process(cluster, tmp_path):
    """``mpidl train`` with one rank on each node (float64) ends within 1e-12 of one
    process at the global batch: the same program on one laptop or two nodes."""
    needs_fashion()
    args = ["-m", "mpidl.cli.main", "train", "--no-progress", "--dtype", "float64",
            "--model", "mlp", "--epochs", "1", "--limit-train", "1024", "--limit-test",
            "256"]
    across(2, 1, [*args, "--batch-size", "32", "--out-dir", str(tmp_path / "two")]).check()
    run_command([sys.executable, *args, "--batch-size", "64", "--out-dir",
                 str(tmp_path / "one")], timeout=300).check()
    a, b = model_arrays(tmp_path / "one" / "model.npz"), model_arrays(tmp_path / "two" /
                                                                      "model.npz")
    worst = max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k]))) for k in a)
    assert worst <= 1e-12, worst

"""The cost model's all-reduce times against SimGrid SMPI (skipped without SimGrid).

``bench/simgrid.py`` runs the full cross-check (256 and 1024 ranks); this runs a slice
small enough for a test: 2 and 8 nodes of 8 ranks, a latency-bound and a
bandwidth-bound size, every algorithm. On these platforms the model is exact up to
SimGrid's rounding except where the bench says it is not (the hierarchical all-reduce
cut into many pieces), so the bound here is 1 %.
"""

import importlib.util
import os
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("smpirun") is None or shutil.which("smpicc") is None,
                                reason="needs SimGrid (apt-get install libsimgrid-dev)")


def _bench():
    """bench/simgrid.py, by its path (SimGrid's own Python module is also "simgrid")."""
    spec = importlib.util.spec_from_file_location(
        "mpidl_bench_simgrid", os.path.join(ROOT, "bench", "simgrid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def work():
    simgrid = _bench()
    with tempfile.TemporaryDirectory(prefix="mpidl-simgrid-test-") as d:
        binary = os.path.join(d, "simgrid_allreduce")
        subprocess.run(["smpicc", "-O2", "-o", binary, simgrid.STUB], check=True, cwd=d,
                       capture_output=True)
        yield d, binary


@pytest.mark.parametrize("p", [16, 64])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_doubling", "hierarchical",
                                       "mpi"])
def test_model_equals_simgrid(work, p, algorithm):
    from mpidl.simulate import machine as machines

    d, binary = work
    simgrid = _bench()
    m = machines.load(os.path.join(ROOT, "bench", "machines", "gpu_cluster.json"))
    per_node = m.ranks_per_node
    simgrid.write_platform(d, p, per_node, m)
    for nbytes in (1024, 1 << 20):
        sim = simgrid.simulate(d, binary, p, per_node, algorithm, nbytes, 1)
        model, _ = simgrid.predict(m, p, per_node, algorithm, nbytes)
        assert abs(model - sim) <= 0.01 * sim, (algorithm, p, nbytes, model, sim)

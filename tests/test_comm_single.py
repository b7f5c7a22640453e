"""The communicator layer in one process: layout, auto thresholds and the tuning file,
argument errors, p = 1 results, handles, timeline, staging buffers, benchmark helpers
and the ``mpidl bench collectives`` command's arguments."""

import argparse
import json

import numpy as np
import pytest

from mpidl.benchmarks import collectives as bench
from mpidl.comm import ALGORITHMS, Communicator, Handle, even_split
from mpidl.comm import auto
from mpidl.comm.buffers import Scratch, Staging
from mpidl.comm.recursive_doubling import plan


@pytest.fixture
def comm(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "tuning.json"))
    c = Communicator()
    yield c
    c.close()


# ---------------------------------------------------------------------------- layout
def test_even_split_first_ranks_get_one_more():
    assert even_split(10, 4) == ((3, 3, 2, 2), (0, 3, 6, 8))
    assert even_split(2, 3) == ((1, 1, 0), (0, 1, 2))
    assert even_split(0, 2) == ((0, 0), (0, 0))
    for n in range(0, 40):
        for p in range(1, 9):
            counts, displs = even_split(n, p)
            assert sum(counts) == n and max(counts) - min(counts) <= 1
            assert list(counts) == sorted(counts, reverse=True)
            assert all(displs[i] + counts[i] == (displs[i + 1] if i + 1 < p else n)
                       for i in range(p))


def test_recursive_doubling_fold_plan():
    # p = 6: q = 4, rem = 2; ranks 0 and 2 fold into 1 and 3
    roles = [plan(r, 6)[0] for r in range(6)]
    assert roles == ["out", "odd", "out", "odd", "plain", "plain"]
    # partners are symmetric
    for r in range(6):
        for k, partner in enumerate(plan(r, 6)[2]):
            assert plan(partner, 6)[2][k] == r


# ---------------------------------------------------------------------------- auto
def test_selector_defaults_and_lookup():
    s = auto.Selector(2)
    assert s.source == "defaults"
    assert s.choose("allreduce", 4) in auto.ALGORITHMS
    assert s.choose("allreduce", 1 << 30) == "ring"
    for kind in auto.COLLECTIVES + ("allgatherv",):
        assert s.choose(kind, 100) in auto.ALGORITHMS


def test_staged_device_buffers_take_mpis_own_call_at_two_ranks():
    """GPU arrays staged through host memory: the ring's many segment copies lose to one
    staged MPI call (measured on an H100); only with the defaults, and only at p = 2."""
    assert auto.Selector(2).choose("allreduce", 1 << 22, staged=True) == "mpi"
    assert auto.Selector(2).choose("allreduce", 1 << 22) == "ring"
    assert auto.Selector(4).choose("allreduce", 1 << 22, staged=True) == "ring"
    tuned = auto.Selector(2, {"allreduce": {"2": [[None, "tree"]]}})
    assert tuned.choose("allreduce", 1 << 22, staged=True) == "tree"


def test_entries_from_timings_merges_runs():
    timings = {4: {"mpi": 1, "ring": 5}, 64: {"mpi": 1, "ring": 3},
               1024: {"mpi": 4, "ring": 2}, 4096: {"mpi": 9, "ring": 3}}
    assert auto.entries_from_timings(timings) == [[64, "mpi"], [None, "ring"]]


def test_tuning_file_roundtrip_and_nearest_p(tmp_path):
    path = str(tmp_path / "t.json")
    auto.save({"allreduce": {2: [[1000, "tree"], [None, "ring"]]}}, path)
    auto.save({"bcast": {4: [[None, "tree"]]}}, path)  # merged, not replaced
    tables = auto.load(path)
    assert tables["allreduce"]["2"] == [[1000, "tree"], [None, "ring"]]
    assert tables["bcast"]["4"] == [[None, "tree"]]
    s3 = auto.Selector(3, tables)  # nearest tuned p below 3 is 2
    assert s3.source == "tuned"
    assert s3.choose("allreduce", 1000) == "tree"
    assert s3.choose("allreduce", 1001) == "ring"
    assert s3.choose("bcast", 10) == "tree"  # no tuned p <= 3: the smallest tuned, 4
    assert auto.Selector(8, tables).choose("bcast", 10) == "tree"


def test_bad_tuning_file_falls_back_to_defaults(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    assert auto.load(str(path)) is None
    s = auto.Selector(2, {"allreduce": {"2": [[10, "bogus"]]}})
    assert s.choose("allreduce", 1 << 30) == auto.Selector(2).choose("allreduce", 1 << 30)


def test_communicator_reads_tuning_file(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    auto.save({"allreduce": {1: [[None, "tree"]]}}, str(path))
    monkeypatch.setenv("MPIDL_TUNING", str(path))
    with Communicator() as c:
        assert c.selector.source == "tuned"
        assert c.selector.choose("allreduce", 10) == "tree"


# ---------------------------------------------------------------------------- p = 1
def test_basics(comm):
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    assert comm.progress_mode in ("thread", "eager")
    comm.barrier()
    assert "rank 0/1" in repr(comm)


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_collectives_on_one_rank(comm, alg):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = comm.allreduce(x, algorithm=alg)
    assert y is not x and np.array_equal(y, x) and y.shape == (3, 4)
    z = x.copy()
    assert comm.allreduce(z, out=z, op="mean", algorithm=alg) is z
    assert np.array_equal(z, x)
    assert np.array_equal(comm.reduce_scatter(x, algorithm=alg), x.ravel())
    assert np.array_equal(comm.reduce(x, root=0, algorithm=alg), x)
    b = x.copy()
    assert comm.bcast(b, algorithm=alg) is b
    assert np.array_equal(comm.allgather(x, algorithm=alg), x.ravel())
    v, counts = comm.allgatherv(np.arange(3), algorithm=alg)
    assert counts == [3] and np.array_equal(v, np.arange(3))
    v, counts = comm.allgatherv(np.zeros(0, np.int32), algorithm=alg)
    assert counts == [0] and v.size == 0 and v.dtype == np.int32
    assert np.array_equal(comm.iallreduce(x, algorithm=alg, name="i").wait(), x)


def test_noncontiguous_in_place_and_out(comm):
    base = np.arange(20, dtype=np.float64)
    view = base[::2]
    comm.allreduce(view, out=view, op="max", name="nc")
    assert np.array_equal(base, np.arange(20.0))  # values unchanged at p=1, gaps intact
    out_base = np.zeros(30)
    got = comm.allreduce(view, out=out_base[::3], name="nc-out")
    assert np.array_equal(out_base[::3], view) and np.all(out_base[1::3] == 0)
    assert got.base is out_base or got is not None


def test_argument_errors(comm):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.allreduce(x, op="prod")
    with pytest.raises(TypeError, match="'mean' needs a floating dtype"):
        comm.allreduce(np.ones(4, np.int32), op="mean")
    with pytest.raises(TypeError, match="cannot reduce dtype bool"):
        comm.allreduce(np.ones(4, bool))
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        comm.allreduce(x, algorithm="butterfly")
    with pytest.raises(ValueError, match="out has shape"):
        comm.allreduce(x, out=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="out has shape"):
        comm.allreduce(x, out=np.ones(4, np.float64))
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        comm.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="root 3 is not a rank"):
        comm.reduce(x, root=3)
    with pytest.raises(ValueError, match="root -1 is not a rank"):
        comm.bcast(x, root=-1)
    with pytest.raises(ValueError, match="this rank's chunk"):
        comm.reduce_scatter(x, out=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="allgather: out"):
        comm.allgather(x, out=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="check="):
        Communicator(check="sometimes")


def test_handle_semantics():
    h = Handle("allreduce", "w")
    assert not h.test() and not h.done
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.01)
    h._finish(result=42)
    assert h.test() and h.wait() == 42 and h.wait(timeout=0) == 42
    e = Handle("allreduce")
    e._finish(error=ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        e.wait()
    assert "done" in repr(e)


def test_closed_communicator_rejects_nonblocking(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "none.json"))
    c = Communicator()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.iallreduce(np.ones(2))
    c.close()


def test_timeline_one_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "none.json"))
    path = tmp_path / "sub" / "trace.json"
    c = Communicator(timeline=str(path))
    c.allreduce(np.ones(8, np.float32), algorithm="ring", name="w")
    c.iallreduce(np.ones(8), name="nb").wait()
    c.close()
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    w = next(e for e in spans if e["name"] == "allreduce w")
    assert w["args"] == {"collective": "allreduce", "algorithm": "ring", "bytes": 32,
                         "op": "sum"}
    assert w["pid"] == 0 and w["tid"] == 0 and w["dur"] >= 0
    assert any(e["name"] == "allreduce nb" and e["tid"] == 1 for e in spans)


def test_debug_env_forces_always(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "none.json"))
    monkeypatch.setenv("MPIDL_DEBUG", "1")
    with Communicator() as c:
        assert c.check == "always"


# ---------------------------------------------------------------------------- buffers
def test_scratch_reuses_and_grows():
    s = Scratch(np)
    a = s.get("x", 10, np.dtype(np.float32))
    b = s.get("x", 10, np.dtype(np.float32))
    assert a is b and a.size == 10
    c = s.get("x", 100, np.dtype(np.float32))
    assert np.shares_memory(a, c)  # 100 still fits the first (rounded-up) buffer
    big = s.get("x", 1 << 20, np.dtype(np.float32))
    assert big.size == 1 << 20 and s.nbytes() >= 4 << 20
    s.free()
    assert s.nbytes() == 0


def test_staging_bump_allocator():
    st = Staging(pinned=False)
    a = st.take(100, np.float32)
    b = st.take(50, np.float64)
    assert not np.shares_memory(a, b)
    st.release()
    st.release()
    c = st.take(10, np.float32)  # nothing live: starts at the front again
    assert np.shares_memory(a, c)
    huge = st.take(1 << 19, np.float64)  # does not fit: a new arena, old regions intact
    assert huge.size == 1 << 19
    st.reset()


# ---------------------------------------------------------------------------- bench helpers
def test_parse_sizes():
    assert bench.parse_size("4") == 4
    assert bench.parse_size("64KiB") == 65536
    assert bench.parse_size("1M") == 1 << 20
    assert bench.parse_sizes("4:32") == [4, 8, 16, 32]
    assert bench.parse_sizes("1KiB,4,1KiB") == [4, 1024]
    assert bench.parse_sizes("4:64MiB")[-1] == 64 << 20
    for bad in ("4x", "", "0", "1.5", "64KiB:4"):
        with pytest.raises(ValueError):
            bench.parse_sizes(bad)


def _rec(size, alg, lat, native):
    return {"collective": "allreduce", "algorithm": alg, "bytes": size, "p": 2,
            "lat_us": lat, "lat_us_min": lat * 0.9, "busbw_GBps": size / lat / 1e3,
            "speedup_vs_native": native / lat}


def test_goals_and_table():
    recs = []
    for size, nat, ring, rd in ((4, 2.0, 20.0, 4.0), (1 << 20, 100.0, 95.0, 300.0),
                                (64 << 20, 26000.0, 5000.0, 90000.0)):
        recs += [_rec(size, "native", nat, nat), _rec(size, "ring", ring, nat),
                 _rec(size, "recursive_doubling", rd, nat)]
    results = dict(bench.goals(recs))
    assert len(results) == 4, results
    assert all(results.values()), results
    assert any("0.9x" in t and "worst 1.05x (1 MiB)" in t for t in results)
    assert any("2x native at 64 MiB: 5.20x" in t for t in results)
    assert any("best home-made" in t and "2.00x (4 B, recursive_doubling)" in t
               for t in results)
    assert all(t.startswith("[min]") for t in dict(bench.goals(recs, "min")))
    text = bench.table(recs)
    assert "64 MiB" in text and "native" in text and "(" in text


def test_cli_register_and_run_one_rank(tmp_path, monkeypatch, capsys):
    """``mpidl.cli.bench.register`` on a bare argparse, as the CLI main does."""
    from mpidl.cli import bench as cli_bench
    from mpidl.errors import UserError

    monkeypatch.setenv("MPIDL_TUNING", str(tmp_path / "none.json"))
    parser = argparse.ArgumentParser(prog="mpidl")
    sub = parser.add_subparsers(dest="command")
    cli_bench.register(sub)
    args = parser.parse_args(["bench", "collectives", "--sizes", "4,1KiB", "--iters", "3",
                              "--repeats", "1", "--algorithms", "ring,mpi",
                              "--json", str(tmp_path / "r.json")])
    job = args.prepare(args, None)
    assert job() == 0
    out = capsys.readouterr().out
    assert "allreduce  p=1" in out and "ring us" in out and "1 KiB" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert {r["algorithm"] for r in doc["results"]} == {"native", "ring", "mpi"}
    assert doc["info"]["mpi4py"] and doc["info"]["numpy"]
    bad = parser.parse_args(["bench", "collectives", "--sizes", "4x"])
    with pytest.raises(UserError, match="bad size"):
        bad.prepare(bad, None)
    bad = parser.parse_args(["bench", "collectives", "--algorithms", "fast"])
    with pytest.raises(UserError, match="unknown algorithm"):
        bad.prepare(bad, None)

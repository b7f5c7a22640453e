"""Checkpoint files: the nested-state encoding, atomic writes, crash safety, pruning."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mpidl.training import checkpoint as ckpt


def test_encode_decode_roundtrip(tmp_path):
    state = {
        "model": {"0.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
                  "1.calls": np.int64(7)},
        "optimizer": {"state": {0: {"m": np.ones(3)}, "lr": 0.1}, "steps": [1, 2, (3, "x")]},
        "rng": np.random.default_rng(5).bit_generator.state,  # 128-bit integers
        "numpy_global": np.random.get_state(legacy=False),
        "none": None, "flag": True, "nan": float("nan"), "text": "é",
    }
    ckpt.save(str(tmp_path), 12, state)
    back = ckpt.load(ckpt.checkpoint_path(str(tmp_path), 12))
    assert back["model"]["0.weight"].dtype == np.float32
    np.testing.assert_array_equal(back["model"]["0.weight"], state["model"]["0.weight"])
    assert back["model"]["1.calls"] == 7 and isinstance(back["model"]["1.calls"], np.int64)
    assert back["optimizer"]["state"][0]["m"].tolist() == [1, 1, 1]
    assert back["optimizer"]["steps"] == [1, 2, (3, "x")]
    assert back["rng"] == state["rng"]
    g = np.random.default_rng()
    g.bit_generator.state = back["rng"]
    assert g.random() == np.random.default_rng(5).random()
    np.random.set_state(back["numpy_global"])
    assert back["none"] is None and back["flag"] is True and np.isnan(back["nan"])
    assert back["text"] == "é"


def test_no_pickle_needed(tmp_path):
    ckpt.save(str(tmp_path), 1, {"a": np.zeros(2), "b": {"c": [1, 2]}})
    with np.load(ckpt.checkpoint_path(str(tmp_path), 1), allow_pickle=False) as z:
        assert "a" in z.files and "__tree__" in z.files


def test_unsupported_type(tmp_path):
    with pytest.raises(TypeError, match="cannot checkpoint object at x"):
        ckpt.save(str(tmp_path), 1, {"x": object()})
    assert os.listdir(tmp_path) == []  # nothing half-written is left


def test_latest_and_pruning(tmp_path):
    d = str(tmp_path)
    for step in (5, 10, 15, 20):
        ckpt.save(d, step, {"step": step}, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [15, 20]
    path, state = ckpt.latest(d)
    assert path.endswith("ckpt-000000020.npz") and state["step"] == 20
    assert ckpt.latest(str(tmp_path / "none")) == (None, None)


def test_truncated_newest_falls_back(tmp_path):
    d = str(tmp_path)
    ckpt.save(d, 1, {"w": np.arange(1000.0)})
    p2 = ckpt.save(d, 2, {"w": np.arange(1000.0) + 1})
    raw = open(p2, "rb").read()
    open(p2, "wb").write(raw[: len(raw) // 2])
    warnings = []
    path, state = ckpt.latest(d, warn=warnings.append)
    assert path.endswith("ckpt-000000001.npz") and state["w"][1] == 1.0
    assert len(warnings) == 1 and "ckpt-000000002.npz" in warnings[0]


def test_crash_while_writing_leaves_previous_loadable(tmp_path):
    """A process killed in the middle of writing checkpoint 2 (the test hook stops it with
    os._exit after part of the temporary file is on disk): checkpoint 1 is still the newest
    loadable one, and the leftover temporary file is never mistaken for a checkpoint."""
    d = str(tmp_path)
    ckpt.save(d, 1, {"w": np.arange(10000.0)})
    code = ("import numpy as np, sys; from mpidl.training import checkpoint as c; "
            f"c.save({d!r}, 2, {{'w': np.arange(10000.0) * 2}}, crash_after_bytes=5000)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert p.returncode == 1
    leftovers = [n for n in os.listdir(d) if n.startswith(".tmp-ckpt-")]
    assert len(leftovers) == 1 and os.path.getsize(os.path.join(d, leftovers[0])) == 5000
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [1]
    path, state = ckpt.latest(d)
    assert path.endswith("ckpt-000000001.npz") and state["w"][-1] == 9999.0
    ckpt.remove_stale_temporaries(d)
    assert sorted(os.listdir(d)) == ["ckpt-000000001.npz"]


def test_exception_while_writing_removes_temporary(tmp_path, monkeypatch):
    d = str(tmp_path)
    ckpt.save(d, 1, {"w": np.zeros(3)})

    def boom(f, items):
        f.write(b"PK partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_npz", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(d, 2, {"w": np.ones(3)})
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == ["ckpt-000000001.npz"]
    assert ckpt.latest(d)[1]["w"].tolist() == [0, 0, 0]


def test_not_a_checkpoint(tmp_path):
    p = tmp_path / "ckpt-000000003.npz"
    np.savez(p, a=np.zeros(1))
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint"):
        ckpt.load(str(p))


def _sharded(directory, step, count, rng):
    """A checkpoint as tensor parallelism writes it: ``w`` (6 x 1000) sliced over ``count``
    shards along its columns (uneven), its optimizer slot likewise, ``b`` whole in the
    index. Returns the whole tensors."""
    from mpidl.comm.layout import even_split

    w, m, b = rng.standard_normal((6, 1000)), rng.standard_normal((6, 1000)), np.arange(4.0)
    counts, displs = even_split(1000, count)
    for i, (c, d) in enumerate(zip(counts, displs)):
        ckpt.save_shard(directory, step, i, count, {
            "model": {"w": w[:, d:d + c]}, "optimizer": {"w": {"m": m[:, d:d + c]}}})
    ckpt.save(directory, step, {
        "config": {}, "progress": {"step": step}, "ranks": [{"seed": np.int64(3)}],
        "model": {"b": b}, "optimizer": {"state": {"w": {"step": 5}, "b": {"m": -b}}},
        "shards": {"count": count, "slices": {"w": [1, 1000]},
                   "files": [ckpt.shard_name(step, i, count) for i in range(count)]}})
    return w, m, b


def test_a_checkpoint_left_on_disk_reads_only_what_is_asked(tmp_path):
    """``load(path, read=False)`` (a split model's resume): the model's and optimizer's
    tensors are ``Ref``s, joined over the shards without reading them; a slice reads only
    the shards it overlaps; scalars and the rest are read at once."""
    directory = str(tmp_path)
    w, m, b = _sharded(directory, 7, 3, np.random.default_rng(0))
    path = ckpt.checkpoint_path(directory, 7)
    state = ckpt.load(path, read=False)
    ref, slot = state["model"]["w"], state["optimizer"]["state"]["w"]["m"]
    assert isinstance(ref, ckpt.Ref) and ref.shape == (6, 1000) and len(ref.parts) == 3
    assert isinstance(state["optimizer"]["state"]["b"]["m"], ckpt.Ref)
    assert state["optimizer"]["state"]["w"]["step"] == 5
    assert state["ranks"][0]["seed"] == 3 and not isinstance(state["ranks"][0]["seed"],
                                                                ckpt.Ref)
    whole = ckpt.load(path)
    assert np.array_equal(ref.values(), whole["model"]["w"]) and np.array_equal(ref.values(), w)
    assert np.array_equal(slot.values(), m) and np.array_equal(state["model"]["b"].values(), b)
    for dim, lo, hi in ((1, 0, 334), (1, 300, 700), (1, 999, 1000), (0, 2, 5), (1, 5, 5)):
        index = [slice(None)] * 2
        index[dim] = slice(lo, hi)
        assert np.array_equal(ref.values(dim, lo, hi), w[tuple(index)]), (dim, lo, hi)
    os.unlink(os.path.join(directory, ckpt.shard_name(7, 2, 3)))  # columns 667..999
    assert np.array_equal(ref.values(1, 0, 667), w[:, :667])
    with pytest.raises(ckpt.CheckpointError, match="shard-2-of-3"):
        ref.values(1, 600, 700)


def test_a_damaged_shard_is_found_before_any_rank_reads_it(tmp_path):
    """Left on disk, a checkpoint is still checked whole (every member's checksum), so a
    damaged shard makes the resume fall back to the checkpoint before, as when read."""
    directory = str(tmp_path)
    _sharded(directory, 5, 2, np.random.default_rng(1))
    w, _, _ = _sharded(directory, 6, 2, np.random.default_rng(2))
    shard = os.path.join(directory, ckpt.shard_name(6, 1, 2))
    with open(shard, "r+b") as f:  # a bit flipped in the middle of the weights' bytes
        f.seek(os.path.getsize(shard) // 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    warnings = []
    for read in (True, False):
        path, state = ckpt.latest(directory, warn=warnings.append, read=read)
        assert path == ckpt.checkpoint_path(directory, 5), (read, warnings)
    assert len(warnings) == 2 and all("shard-1-of-2" in why for why in warnings), warnings


def test_a_ranks_slice_of_a_checkpoint_costs_its_slice(tmp_path):
    """Reading one rank's quarter of a 16 MB tensor sharded four ways allocates about
    that quarter, not the whole tensor."""
    import tracemalloc

    from mpidl.comm.layout import even_split

    directory, w = str(tmp_path), np.random.default_rng(3).standard_normal((512, 4096))
    counts, displs = even_split(4096, 4)
    for i in range(4):
        ckpt.save_shard(directory, 1, i, 4, {"model": {"w": w[:, displs[i]:displs[i] +
                                                          counts[i]]}, "optimizer": {}})
    ckpt.save(directory, 1, {"config": {}, "progress": {}, "ranks": [], "model": {},
                             "optimizer": {"state": {}},
                             "shards": {"count": 4, "slices": {"w": [1, 4096]},
                                        "files": [ckpt.shard_name(1, i, 4) for i in range(4)]}})
    ref = ckpt.load(ckpt.checkpoint_path(directory, 1), read=False)["model"]["w"]
    tracemalloc.start()
    piece = ref.values(1, displs[2], displs[2] + counts[2])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(piece, w[:, displs[2]:displs[2] + counts[2]])
    assert peak < 1.5 * piece.nbytes, (peak, piece.nbytes, w.nbytes)


def _flat_sharded(directory, step, tensors, cuts, drop=None):
    """A ZeRO-style checkpoint: shard ``i`` holds elements ``cuts[i]:cuts[i+1]`` of every
    tensor's flat layout (all of ``tensors`` joined, as a bucket is), as flat pieces."""
    names = list(tensors)
    offsets = np.cumsum([0] + [tensors[n].size for n in names])
    for i in range(len(cuts) - 1):
        pieces = []
        for n, o in zip(names, offsets):
            a, b = max(cuts[i], o), min(cuts[i + 1], o + tensors[n].size)
            if a < b and (i, n) != drop:
                pieces.append([["model", n], int(a - o), tensors[n].reshape(-1)[a - o:b - o]])
                pieces.append([["optimizer", "state", n, "m"], int(a - o),
                               -tensors[n].reshape(-1)[a - o:b - o]])
        ckpt.save_shard(directory, step, i, len(cuts) - 1, {"pieces": pieces})
    flat = [[place, list(tensors[n].shape), tensors[n].dtype.str] for n in names
            for place in (["model", n], ["optimizer", "state", n, "m"])]
    ckpt.save(directory, step, {
        "config": {}, "progress": {"step": step}, "ranks": [], "model": {"buf": np.ones(2)},
        "optimizer": {"state": {n: {"step": 4} for n in names}},
        "shards": {"count": len(cuts) - 1, "flat": flat,
                   "files": [ckpt.shard_name(step, i, len(cuts) - 1)
                             for i in range(len(cuts) - 1)]}})


def test_flat_pieces_join_into_whole_tensors_and_a_chunk_reads_its_pieces(tmp_path):
    """ZeRO's shards (flat pieces of every tensor, cut across tensors' bounds): read,
    the tensors come back whole in their shapes; left on disk they are ``FlatRef``s,
    and a chunk of their flat layout reads only the pieces it overlaps."""
    from mpidl.engine.lazy import flat_slice

    rng = np.random.default_rng(4)
    tensors = {"w": rng.standard_normal((7, 5)), "b": rng.standard_normal(5),
               "e": np.zeros((0, 3))}
    directory = str(tmp_path)
    _flat_sharded(directory, 3, tensors, [0, 12, 13, 40])  # a one-element shard too
    path = ckpt.checkpoint_path(directory, 3)
    whole = ckpt.load(path)
    for n, t in tensors.items():
        assert np.array_equal(whole["model"][n], t) and whole["model"][n].shape == t.shape
        assert np.array_equal(whole["optimizer"]["state"][n]["m"], -t)
        assert whole["optimizer"]["state"][n]["step"] == 4
    assert np.array_equal(whole["model"]["buf"], np.ones(2))
    left = ckpt.load(path, read=False)
    ref = left["model"]["w"]
    assert isinstance(ref, ckpt.FlatRef) and ref.shape == (7, 5) and len(ref.parts) == 3
    assert np.array_equal(ref.values(), tensors["w"])
    assert np.array_equal(ref.values(1, 1, 3), tensors["w"][:, 1:3])
    assert np.array_equal(flat_slice(ref, 10, 14), tensors["w"].reshape(-1)[10:14])
    os.unlink(os.path.join(directory, ckpt.shard_name(3, 2, 3)))  # elements 13..39 of all
    assert np.array_equal(flat_slice(ref, 0, 13), tensors["w"].reshape(-1)[:13])
    with pytest.raises(ckpt.CheckpointError, match="shard-2-of-3"):
        flat_slice(ref, 12, 14)


def test_flat_pieces_that_do_not_cover_a_tensor_make_the_checkpoint_unreadable(tmp_path):
    """A piece missing from a shard (or pieces of a tensor the index does not name) is a
    CheckpointError naming the tensor, so ``latest`` falls back to the one before."""
    rng = np.random.default_rng(5)
    tensors = {"w": rng.standard_normal((4, 4)), "b": rng.standard_normal(4)}
    directory = str(tmp_path)
    _flat_sharded(directory, 1, tensors, [0, 10, 20])
    _flat_sharded(directory, 2, tensors, [0, 10, 20], drop=(1, "w"))
    warnings = []
    for read in (True, False):
        path, _ = ckpt.latest(directory, warn=warnings.append, read=read)
        assert path == ckpt.checkpoint_path(directory, 1), warnings
    assert len(warnings) == 2 and all("'model/w'" in w and "index says 16" in w
                                      for w in warnings), warnings


def test_each_ranks_own_state_comes_back_from_its_rank_shard(tmp_path):
    """A per-rank list in the state (every rank's residuals): each rank's arrays taken out
    into its own rank shard (``split_arrays``), only the skeleton in the index; read, the
    list is whole again, tuples and scalars as they were; left on disk, its arrays are
    ``FlatRef``s marked ``own``, which ``read_shared`` leaves for their rank to read
    while it reads everything else."""
    from mpidl.engine.lazy import values_of

    rng = np.random.default_rng(6)
    ranks = [{"memory": {"w": rng.standard_normal((3, 4)), "n": 5},
              "pair": (rng.standard_normal(2), "x"), "none": None} for _ in range(3)]
    directory, step, skeletons, flat = str(tmp_path), 9, [], []
    files = []
    for i, mine in enumerate(ranks):
        skeleton, arrays = ckpt.split_arrays(mine, ["runtime", "syncs", i])
        assert skeleton["memory"]["w"] is None and skeleton["memory"]["n"] == 5
        skeletons.append(skeleton)
        flat += [[place, list(a.shape), a.dtype.str] for place, a in arrays]
        ckpt.save_shard(directory, step, i, 3, {"pieces": [[place, 0, a.reshape(-1)]
                                                           for place, a in arrays]},
                        kind="rank")
        files.append(ckpt.shard_name(step, i, 3, "rank"))
    model = rng.standard_normal(4)
    ckpt.save(directory, step, {
        "config": {}, "progress": {"step": step}, "ranks": [], "model": {"b": model},
        "optimizer": {"state": {}}, "runtime": {"syncs": skeletons},
        "rank_shards": {"files": files, "flat": flat}})
    path = ckpt.checkpoint_path(directory, step)
    whole = ckpt.load(path)["runtime"]["syncs"]
    for got, want in zip(whole, ranks):
        assert np.array_equal(got["memory"]["w"], want["memory"]["w"])
        assert got["memory"]["n"] == 5 and got["none"] is None
        assert np.array_equal(got["pair"][0], want["pair"][0]) and got["pair"][1] == "x"
    left = ckpt.read_shared(ckpt.load(path, read=False))
    assert isinstance(left["model"]["b"], np.ndarray)  # read: the whole model's
    own = left["runtime"]["syncs"][1]["memory"]["w"]
    assert isinstance(own, ckpt.FlatRef) and own.own  # left for rank 1 to read
    assert np.array_equal(values_of(left["runtime"]["syncs"][1])["memory"]["w"],
                          ranks[1]["memory"]["w"])
    os.unlink(os.path.join(directory, files[2]))  # a rank shard missing: unreadable
    with pytest.raises(ckpt.CheckpointError, match="rank-2-of-3"):
        ckpt.load(path, read=False)

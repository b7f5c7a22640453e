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

    def boom(f, **arrays):
        f.write(b"PK partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
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

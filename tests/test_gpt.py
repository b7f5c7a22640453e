"""gpt-tiny: its layers (gradient checks in float64 against central differences, the
per-head column layout tensor parallelism relies on, causality), the whole model, weight
tying, ``mpidl train --dataset text`` + ``mpidl sample`` end to end, the CLI's one-line
errors, and 2 data-parallel ranks equal to one process at the global batch."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from test_gradcheck import gradcheck

from mpidl.engine import Embedding, Linear, Residual, Sequential, ShapeError, SparseGrad
from mpidl.engine.attention import CausalAttention, PositionEmbedding, TiedHead
from mpidl.engine.losses import SoftmaxCrossEntropy, TokenCrossEntropy
from mpidl.engine.models import build_model
from mpidl.engine.normalization import LayerNorm
from mpidl.data.text import split_text
from mpidl.training.checkpoint import load_model_arrays, save_model
from mpirun import mpi_env, mpiexec_cmd, run_command

F64 = "float64"
MPIDL = [sys.executable, "-m", "mpidl.cli.main"]


def randn(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def naive_attention(x, dh):
    """Per head, per position: softmax over the positions up to it, in plain loops."""
    b, t, w = x.shape
    heads = w // (3 * dh)
    out = np.zeros((b, t, heads * dh))
    for n in range(b):
        for h in range(heads):
            cols = x[n, :, h * 3 * dh:(h + 1) * 3 * dh]
            q, k, v = cols[:, :dh], cols[:, dh:2 * dh], cols[:, 2 * dh:]
            for i in range(t):
                s = np.array([q[i] @ k[j] / math.sqrt(dh) for j in range(i + 1)])
                p = np.exp(s - s.max())
                p /= p.sum()
                out[n, i, h * dh:(h + 1) * dh] = p @ v[:i + 1]
    return out


# -- layers

def test_causal_attention_matches_loops_and_groups_columns_per_head():
    x = randn(2, 5, 3 * 3 * 4) * 2  # 3 heads of 4
    att = CausalAttention(4)
    y = att.forward(x)
    np.testing.assert_allclose(y, naive_attention(x, 4), rtol=1e-12, atol=1e-12)
    # a contiguous column shard of whole heads (what a tensor-parallel rank holds) gives
    # exactly those heads' output columns
    shard = CausalAttention(4).forward(x[:, :, 12:36])
    np.testing.assert_array_equal(shard, y[:, :, 4:12])


def test_causal_attention_gradient_and_stability():
    gradcheck(CausalAttention(3), randn(2, 4, 2 * 3 * 3))
    big = randn(1, 6, 6) * 1e4  # scores far beyond exp's range: no overflow, rows sum to 1
    y = CausalAttention(2).forward(big)
    assert np.isfinite(y).all()


def test_causal_attention_float32_and_bad_width():
    x = randn(2, 4, 12).astype(np.float32)
    att = CausalAttention(2)
    y = att.forward(x)
    assert y.dtype == np.float32 and y.shape == (2, 4, 4)
    assert att.backward(np.ones_like(y)).dtype == np.float32
    with pytest.raises(ShapeError, match="3 \\* heads \\* 2"):
        CausalAttention(2).forward(randn(2, 4, 10))


def test_position_embedding_gradient_and_context_limit():
    gradcheck(PositionEmbedding(6, 3, rng=2, dtype=F64), randn(2, 4, 3))  # T < context
    pe = PositionEmbedding(4, 3, dtype=F64)
    with pytest.raises(ShapeError, match="4 positions .* sequence of 5"):
        pe.forward(randn(1, 5, 3))


def test_tied_head_shares_one_parameter_and_adds_both_gradients():
    emb = Embedding(7, 4, rng=1, dtype=F64)
    model = Sequential(emb, LayerNorm(4, dtype=F64), TiedHead(emb))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "1.weight", "1.bias"]  # the tied weight once
    ids = np.array([[1, 2, 2, 5]])
    r = randn(1, 4, 7)
    model.forward(ids)
    model.backward(r.copy())
    grad = emb.weight.grad
    assert not isinstance(grad, SparseGrad)  # head (dense) + embedding rows (sparse)
    # the head part alone, and the embedding part alone, add up to it
    h = model.layers[1].forward(emb.weight.data[ids])
    head_part = r.reshape(-1, 7).T @ h.reshape(-1, 4)
    assert not np.allclose(grad, head_part)
    # central differences of sum(out * r) through both uses of the weight
    w = emb.weight.data
    for idx in [(1, 0), (2, 3), (5, 1), (0, 2)]:
        old = w[idx]
        w[idx] = old + 1e-6
        lp = float(np.sum(model.forward(ids) * r))
        w[idx] = old - 1e-6
        lm = float(np.sum(model.forward(ids) * r))
        w[idx] = old
        assert abs((lp - lm) / 2e-6 - grad[idx]) < 1e-7 + 1e-6 * abs(grad[idx])
    model.discard_saved(all_keys=True)


def test_token_cross_entropy_is_softmax_cross_entropy_over_tokens():
    logits, labels = randn(2, 3, 5), np.array([[0, 4, 1], [2, 2, 3]])
    tok, flat = TokenCrossEntropy(), SoftmaxCrossEntropy()
    assert tok.forward(logits, labels) == flat.forward(logits.reshape(6, 5), labels.ravel())
    g = tok.backward()
    assert g.shape == (2, 3, 5)
    np.testing.assert_array_equal(g.reshape(6, 5), flat.backward())
    with pytest.raises(ShapeError, match="leading shape"):
        tok.forward(logits, labels[:, :2])


# -- the model

def tiny(tie=False, dtype=F64, **kw):
    options = dict(layers=2, heads=2, width=8, context=6, tie_weights=tie)
    options.update(kw)
    return build_model("gpt-tiny", input_shape=(6,), num_classes=11, seed=3, dtype=dtype,
                       **options)


def test_gpt_tiny_layout_pairs_linears_per_block():
    model = tiny()
    blocks = [m for m in model.layers if isinstance(m, Residual)]
    assert len(blocks) == 4
    for k, block in enumerate(blocks):
        linears = [(i, m) for i, m in enumerate(block.body.layers) if isinstance(m, Linear)]
        assert len(linears) == 2
        (i, first), (j, second) = linears
        assert all(not m.has_params() for m in block.body.layers[i + 1:j])
        assert first.out_features == (24 if k % 2 == 0 else 32)  # qkv 3d, MLP 4d
        if k % 2 == 0:
            assert isinstance(block.body.layers[i + 1], CausalAttention)
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["0.weight", "1.weight"] and names[-2:] == ["8.weight", "8.bias"]
    assert names == [n for n, _ in tiny(dropout=0.1).named_parameters()]  # stable names


def larger_weights(model):
    for _, p in model.named_parameters():  # gradients well above the checks' 1e-6 floor
        p.data *= 1.0 if p.data.ndim == 1 else 10.0
    return model


def test_gpt_tiny_gradient():
    ids = np.random.default_rng(0).integers(0, 11, size=(2, 5))
    gradcheck(larger_weights(tiny()), ids, check_input=False)


def test_gpt_tiny_tied_gradient():
    """Central differences at 25 coordinates of every parameter (gradcheck's own bitwise
    accumulation check does not apply: the tied gradient is a sum of two parts, and
    (a + b) + (a + b) need not round like 2 (a + b))."""
    model = larger_weights(tiny(tie=True))
    ids = np.random.default_rng(0).integers(0, 11, size=(2, 5))
    r = randn(2, 5, 11, seed=4)
    model.zero_grad()
    model.forward(ids)
    model.backward(r.copy())
    rng = np.random.default_rng(5)
    for name, p in model.named_parameters():
        grad = p.grad.to_dense() if isinstance(p.grad, SparseGrad) else p.grad
        flat = rng.choice(p.data.size, min(25, p.data.size), replace=False)
        for idx in (np.unravel_index(i, p.data.shape) for i in flat):
            old = p.data[idx]
            p.data[idx] = old + 1e-6
            lp = float(np.sum(model.forward(ids) * r))
            p.data[idx] = old - 1e-6
            lm = float(np.sum(model.forward(ids) * r))
            p.data[idx] = old
            num = (lp - lm) / 2e-6
            assert abs(grad[idx] - num) <= 1e-6 + 1e-5 * abs(num), (name, idx, grad[idx], num)
    model.discard_saved(all_keys=True)


def test_gpt_tiny_is_causal():
    model = tiny()
    model.eval()
    ids = np.random.default_rng(1).integers(0, 11, size=(2, 6))
    base = model.forward(ids)
    for t in range(6):
        changed = ids.copy()
        changed[:, t] = (changed[:, t] + 1) % 11
        out = model.forward(changed)
        np.testing.assert_array_equal(out[:, :t], base[:, :t])  # the past never sees it
        assert not np.allclose(out[:, t], base[:, t])
    model.discard_saved(all_keys=True)


def test_gpt_tiny_float32_and_bad_options():
    out = tiny(dtype="float32").forward(np.zeros((1, 6), dtype=np.int64))
    assert out.dtype == np.float32 and out.shape == (1, 6, 11)
    with pytest.raises(ValueError, match="width 10 does not split into 4 heads"):
        tiny(width=10, heads=4)
    with pytest.raises(ValueError, match="context 4 cannot take sequences of 6"):
        tiny(context=4)


# -- the command line

def corpus(tmp_path, n=3000):
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    rng = np.random.default_rng(0)
    text = " ".join(words[i] for i in rng.integers(0, len(words), n // 4)) + "\n"
    path = tmp_path / "tiny.txt"
    path.write_text(text, encoding="utf-8")
    return path


SMALL = ["--model", "gpt-tiny", "--dataset", "text", "--layers", "1", "--heads", "2",
         "--width", "16", "--context", "16", "--no-progress"]


def mpidl(*args, env=None, timeout=120):
    return subprocess.run(MPIDL + [str(a) for a in args], capture_output=True, text=True,
                          env=mpi_env(env), timeout=timeout)


def test_train_then_sample(tmp_path):
    data = corpus(tmp_path)
    model = tmp_path / "m.npz"
    r = mpidl("train", *SMALL, "--data-dir", data, "--epochs", "1", "--limit-train", "64",
              "--batch-size", "8", "--save", model, "--out-dir", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert '"test_bits_per_char"' in r.stdout and '"test_nats_per_char"' in r.stdout
    _, meta = load_model_arrays(model)
    train_text, _ = split_text(data.read_text())
    assert meta["vocab"] == "".join(sorted(set(train_text)))
    assert meta["model_options"] == {"layers": 1, "heads": 2, "width": 16, "context": 16}
    runs = [mpidl("sample", "--model", model, "--prompt", "the ", "--tokens", 40,
                  "--seed", s, "--top-k", 5) for s in (1, 1, 2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first = runs[0].stdout.rstrip("\n")
    assert first.startswith("the ") and len(first) == 44
    assert set(first) <= set(meta["vocab"])
    assert runs[1].stdout == runs[0].stdout  # same seed, same text
    assert runs[2].stdout != runs[0].stdout
    # sample's one-line errors
    bad = mpidl("sample", "--model", model, "--prompt", "thé")
    assert bad.returncode == 2 and "'é' (U+00E9) is not in the model's vocabulary" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    gone = mpidl("sample", "--model", tmp_path / "nope.npz")
    assert gone.returncode == 2 and "no such file" in gone.stderr
    image = tmp_path / "mlp.npz"
    save_model(image, build_model("mlp", hidden=(4,)), {"model": "mlp", "dataset": "synthetic",
                                                         "input_shape": [1, 28, 28]})
    other = mpidl("sample", "--model", image)
    assert other.returncode == 2 and "not a text model" in other.stderr, other.stderr


def test_cli_errors(tmp_path, monkeypatch):
    data = corpus(tmp_path, n=400)
    cases = [
        (["--model", "mlp", "--dataset", "synthetic", "--layers", "2"],
         "--layers: model 'mlp' has no such option (models that take --layers: gpt-tiny)"),
        (SMALL + ["--data-dir", data, "--width", "10", "--heads", "4"],
         "width 10 does not split into 4 heads"),
        (SMALL + ["--data-dir", tmp_path / "missing.txt"], "does not exist"),
        (SMALL + ["--data-dir", data, "--context", "200"], "too few for windows of 200"),
    ]
    for args, message in cases:
        r = mpidl("train", *args, "--epochs", "1", "--out-dir", tmp_path / "run")
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("tie", [False, pytest.param(True, marks=pytest.mark.mpi_matrix_extra)],
                         ids=["untied", "tied"])
def test_two_ranks_equal_one_process_at_the_global_batch(tmp_path, tie):
    """float64, AdamW, 2 epochs: every parameter within 1e-12 of the one-process run."""
    data = corpus(tmp_path)
    common = SMALL + ["--data-dir", data, "--dtype", "float64", "--epochs", "2",
                      "--limit-train", "48", "--limit-test", "8"]
    common += ["--tie-weights"] if tie else []
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    r = mpidl("train", *common, "--batch-size", "8", "--save", one, "--out-dir", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    launch = run_command([*mpiexec_cmd(), "-n", "2"] + MPIDL + ["train"] + common +
                         ["--batch-size", "4", "--save", two, "--out-dir", tmp_path / "b"],
                         timeout=120).check()
    a, _ = load_model_arrays(one)
    b, meta = load_model_arrays(two)
    assert meta["mpidl_config"]["batch_size"] == 4 and "2 rank(s)" in launch.output
    assert set(a) == set(b)
    for name in a:
        if a[name].dtype.kind == "f":
            np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-12, err_msg=name)
    start = build_model("gpt-tiny", input_shape=(16,), num_classes=int(meta["num_classes"]),
                        seed=0, dtype=F64, **meta["model_options"]).state_dict()
    moved = sum(not np.array_equal(np.asarray(start[k]), a[k]) for k in a
                if a[k].dtype.kind == "f")
    assert moved >= len([k for k in a if a[k].dtype.kind == "f"]) - 1  # training happened
    assert os.path.getsize(two) > 0

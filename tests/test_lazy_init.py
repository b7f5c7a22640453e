"""Deferred initialization (``mpidl.engine.lazy``): a lazily built model holds bitwise the
eager model's values wherever they are drawn, whole, in slices or in flat ranges; the
runtime's cuts draw only what a rank keeps (real ranks: ``tests/ranks/lazy_build.py``)."""

import tracemalloc

import numpy as np
import pytest

from mpidl.engine import Conv2d, Embedding, Linear, Sequential
from mpidl.engine.attention import PositionEmbedding
from mpidl.engine import lazy
from mpidl.engine.dropout import Dropout
from mpidl.engine.init import initialize
from mpidl.engine.lazy import LazyInit, LazyRNG, drawn, is_lazy, materialize, shape_only
from mpidl.engine.models import build_model

ZOO = {
    "mlp": dict(hidden=(40, 31), dropout=0.2),
    "cnn": dict(channels=(4, 6), hidden=21),
    "resnet-tiny": dict(input_shape=(3, 16, 16), widths=(4, 6, 8)),
    "gpt-tiny": dict(input_shape=(8,), num_classes=13, layers=2, heads=2, width=8,
                     dropout=0.1),
    "gpt-tiny tied": dict(input_shape=(8,), num_classes=13, layers=1, heads=2, width=8,
                          tie_weights=True),
}


def build(name, lazy_build, **extra):
    options = dict(ZOO[name], **extra)
    return build_model(name.split()[0], seed=7, dtype="float64", lazy=lazy_build, **options)


@pytest.mark.parametrize("chunk", [5, lazy.CHUNK])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_lazy_build_draws_the_eager_values(name, chunk, monkeypatch):
    """Every parameter is lazy until drawn, and then bitwise the eager build's, and so are
    the draws made after it (the dropout layers' seeds come from the same stream)."""
    monkeypatch.setattr(lazy, "CHUNK", chunk)
    eager, model = build(name, False), build(name, True)
    drawn_from_rng = (Linear, Conv2d, Embedding, PositionEmbedding)  # (norms: ones, zeros)
    expected = {f"{prefix}.{k}" if prefix else k for prefix, layer in model.modules()
                if isinstance(layer, drawn_from_rng) for k in layer._params}
    params = model.named_parameters()
    assert expected and {n for n, p in params if is_lazy(p.data)} == expected
    assert [(n, p.shape, p.dtype) for n, p in params] == \
        [(n, p.shape, p.dtype) for n, p in eager.named_parameters()]
    materialize(model)
    assert not any(is_lazy(p.data) for _, p in model.named_parameters())
    mine, theirs = model.state_dict(), eager.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert np.array_equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype, k
    seeds = [m.seed for _, m in model.modules() if isinstance(m, Dropout)]
    assert seeds == [m.seed for _, m in eager.modules() if isinstance(m, Dropout)]


def test_materialize_counts_what_it_draws_and_a_tied_weight_once():
    model = build("gpt-tiny tied", True)
    lazies = {id(p) for _, p in model.named_parameters() if is_lazy(p.data)}
    assert len(lazies) >= 4
    assert materialize(model) == len(lazies)
    assert materialize(model) == 0


@pytest.mark.parametrize("chunk", [1, 5, 64, lazy.CHUNK])
@pytest.mark.parametrize("init", ["he_uniform", "glorot_normal", "normal", "zeros"])
@pytest.mark.parametrize("shape", [(37, 11), (5, 3, 4, 2), (13,), (0, 4), (1, 1)])
def test_slices_and_flat_ranges_are_the_eager_ones(shape, init, chunk, monkeypatch):
    monkeypatch.setattr(lazy, "CHUNK", chunk)
    eager_rng, lazy_rng = np.random.default_rng(3), LazyRNG(np.random.default_rng(3))
    whole = initialize(init, shape, 6, 5, eager_rng, "float64")
    deferred = initialize(init, shape, 6, 5, lazy_rng, "float64")
    assert isinstance(deferred, LazyInit)
    assert np.array_equal(eager_rng.standard_normal(3), lazy_rng.standard_normal(3))
    assert deferred.shape == whole.shape and deferred.nbytes == whole.nbytes
    assert np.array_equal(deferred.values(), whole)
    for dim, n in enumerate(shape):
        for lo, hi in ((0, n), (n // 3, n - n // 4), (n // 2, n // 2), (n - 1, n)):
            if 0 <= lo <= hi <= n:
                assert np.array_equal(deferred.values(dim, lo, hi),
                                      np.take(whole, range(lo, hi), axis=dim)), (dim, lo, hi)
    flat = whole.reshape(-1)
    for lo, hi in ((0, flat.size), (flat.size // 5, flat.size // 2 + 1), (3, 3)):
        if lo <= hi <= flat.size:
            assert np.array_equal(deferred.values_flat(lo, hi), flat[lo:hi]), (lo, hi)


def test_a_lazy_build_leaves_the_stream_where_the_eager_one_does():
    """Draws after a lazy build (a user model's own ``rng.normal``) see the same stream:
    a uniform draw skipped by jumping the generator ahead keeps the 32-bit half a small
    integer draw left buffered, a normal's is skipped by drawing."""
    def layers(rng):
        a = Linear(30, 20, rng=rng)
        seed = rng.integers(2**31)  # (a dropout seed: 32 bits, half a draw kept)
        b = Linear(30, 20, init="glorot_normal", rng=rng)
        c = Linear(20, 7, rng=rng)
        return seed, rng.integers(5), a, b, c

    eager_rng, lazy_rng = np.random.default_rng(9), LazyRNG(np.random.default_rng(9))
    eager, lazy_ = layers(eager_rng), layers(lazy_rng)
    assert eager[:2] == lazy_[:2]
    assert np.array_equal(eager_rng.normal(size=4), lazy_rng.normal(size=4))
    model = Sequential(*lazy_[2:])
    materialize(model)
    for x, y in zip(eager[2:], model.layers):
        assert np.array_equal(x.weight.data, y.weight.data)


def test_an_initializer_not_marked_elementwise_is_drawn_at_once():
    """A user's initializer may not give the same numbers when drawn in pieces (an
    orthogonal matrix, say): it is drawn whole at build time, and the stream goes on as
    in the eager build."""
    def orthogonal(rng, shape, fan_in=None, fan_out=None):
        q, _ = np.linalg.qr(rng.standard_normal(shape))
        return q

    eager_rng, lazy_rng = np.random.default_rng(4), LazyRNG(np.random.default_rng(4))
    a = [Linear(6, 6, init=orthogonal, rng=eager_rng), Linear(6, 3, rng=eager_rng)]
    b = [Linear(6, 6, init=orthogonal, rng=lazy_rng), Linear(6, 3, rng=lazy_rng)]
    assert isinstance(b[0].weight.data, np.ndarray) and is_lazy(b[1].weight.data)
    materialize(Sequential(*b))
    for x, y in zip(a, b):
        assert np.array_equal(x.weight.data, y.weight.data)


def test_shape_only_runs_a_forward_without_drawing_and_restores():
    """The command line's fit check runs two samples through a lazily built model: its
    parameters read as zeros that take no memory, and stay lazy afterwards."""
    model = build_model("mlp", seed=1, dtype="float64", hidden=(2048, 2048), lazy=True)
    x = np.zeros((2, 1, 28, 28))
    tracemalloc.start()
    with shape_only(model):
        out = model(x)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.shape == (2, 10)
    assert all(is_lazy(p.data) for _, p in model.named_parameters())
    whole = sum(p.data.nbytes for _, p in model.named_parameters())
    assert peak < whole / 2, (peak, whole)


def test_drawn_holds_the_values_for_the_block_only():
    model = build("mlp", True)
    layer = model.layers[1]
    with drawn(layer):
        values = layer.weight.data.copy()
        assert isinstance(layer.weight.data, np.ndarray)
    assert is_lazy(layer.weight.data)
    assert np.array_equal(values, build("mlp", False).layers[1].weight.data)


@pytest.mark.parametrize("ranks, mode", [(3, "tp"), (2, "pp measured"), (3, "zero3"),
                                         (2, "tp eager")])
def test_a_split_model_is_never_whole_on_a_rank(ranks, mode):
    """On real ranks: a lazily built 80 MB MLP under ``--tensor-parallel 3`` (uneven
    slices), ``--pipeline-stages 2`` (layers timed on a batch) and ``--zero 3`` on 3 ranks
    (each rank its chunk of every bucket): each rank's peak while
    building and setting up is what it keeps, the runtime's buffers and a few pieces of
    the draw (one layer more while the pipeline times them), and what it keeps is
    bitwise its piece of the eager model (``tests/ranks/lazy_build.py``). The anchor,
    ``eager``: built eagerly, every rank's peak is the whole model."""
    from mpirun import HERE, run_ranks

    launch = run_ranks(ranks, [f"{HERE}/ranks/lazy_build.py", *mode.split()],
                       timeout=300).check()
    # (the ranks' lines may run together in the launcher's output)
    assert launch.output.count("lazy_build ") == ranks, launch.output


@pytest.mark.parametrize("layout", [["--tensor-parallel", "2"], ["--zero", "3"]])
def test_mpidl_train_builds_a_split_model_lazily(tmp_path, layout):
    """``mpidl train --tensor-parallel 2`` (``--zero 3``) says what rank 0 drew: its slices
    (its chunks of the buckets) only."""
    from mpirun import needs_fashion, run_command, train_cmd

    needs_fashion()
    launch = run_command(train_cmd(2, tmp_path, "--model", "mlp", "--batch-size", "16",
                                   "--limit-train", "64", "--limit-test", "32",
                                   "--epochs", "1", *layout), timeout=300).check()
    # 784-1024-1024-10 in float64: 14.2 MiB whole; rank 0 holds half the columns of the
    # first layer, half the rows of the second, half the classes of the last (half of
    # every bucket)
    assert ("model built lazily: this rank drew 7.1 MiB of the model's 14.2 MiB of "
            "parameters, only what it keeps") in launch.output, launch.output


@pytest.mark.parametrize("mode", ["tp", "pp", "tp-pp"])
def test_a_split_model_resumes_and_saves_without_the_whole_model(tmp_path, mode):
    """On 2 real ranks (4 for tp-pp): a lazily built 48 MB MLP under tensor (pipeline)
    parallelism, or 2 stages of 2 tensor-parallel ranks,
    checkpointed as the trainer writes it (each rank a shard of its slices, or of its
    stage, from their own memory: writing allocates under 1 MiB) and resumed as
    ``Trainer.restore`` does: the root
    broadcasts the checkpoint with its tensors left on disk (a few kB), each rank reads its
    part, one tensor at a time; the resumed parameters and momentum are bitwise the saved
    ones and each rank's loading peak is about the momentum it takes; ``--save``'s stream
    writes the whole model with the root holding a few tensors' worth at a time
    (``tests/ranks/split_resume.py``)."""
    from mpirun import HERE, run_ranks

    n = 4 if mode == "tp-pp" else 2  # (tp-pp: 2 stages of 2 tensor-parallel ranks)
    launch = run_ranks(n, [f"{HERE}/ranks/split_resume.py", mode, tmp_path],
                       timeout=300).check()
    assert launch.output.count("split_resume ") == n + 1, launch.output


def test_a_lazily_built_model_that_does_not_fit_the_data_is_one_line(tmp_path):
    """The fit check runs on a lazily built model's shapes (``shape_only``): a model that
    does not fit the data is one ``mpidl: error:`` line and exit 2 under every layout
    that builds lazily, before any value is drawn."""
    from mpirun import assert_one_line_error, run_cli_cases

    layouts = [["--tensor-parallel", "2"], ["--pipeline-stages", "2"], ["--zero", "3"]]
    cases = [["train", "--no-progress", "--model", "mlp", "--dataset", "text",
              "--limit-train", "64", "--limit-test", "16", "--out-dir",
              str(tmp_path / str(i)), *layout] for i, layout in enumerate(layouts)]
    for launch in run_cli_cases(cases, n=2):
        assert_one_line_error(launch, "model 'mlp' does not fit dataset 'text'",
                              "expected (128, 113) scores per position")

"""The text dataset (``--dataset text``): reading files and folders, fortune files, the
split, the vocabulary and its reserved unknown id, the windows, the errors, and the
add-alpha character-bigram baseline against a hand-computed case."""

import math

import numpy as np
import pytest

from mpidl.data import load_dataset
from mpidl.data import text as text_mod
from mpidl.data.loader import BatchLoader, eval_batches
from mpidl.data.text import (Vocabulary, bigram_baseline, bigram_counts, bigram_log_probs,
                             bigram_nats, fit_bigram, read_text, split_text,
                             strip_fortune_separators, windows)
from mpidl.errors import DataError
from mpidl.training.tasks import LanguageModelTask, task_for


def test_split_vocab_windows_and_unknown_characters(tmp_path):
    text = "abcabcabca" * 9 + "abcabxyz!\n"  # 100 characters; the last 10 are validation
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    ds = load_dataset("text", str(path), context=4)
    train, valid = split_text(text)
    assert (train, valid) == (text[:90], text[90:])
    assert ds.vocab == "abc" and ds.num_classes == 4  # 3 characters + the unknown id 3
    assert ds.task == "language-model" and isinstance(task_for(ds), LanguageModelTask)
    # training windows: every 4th start, y one character ahead
    assert ds.train_x.shape == (22, 4) and ds.train_x.dtype == np.int64
    np.testing.assert_array_equal(ds.train_x[0], [0, 1, 2, 0])
    np.testing.assert_array_equal(ds.train_y[0], [1, 2, 0, 1])
    np.testing.assert_array_equal(ds.train_x[1], [1, 2, 0, 1])
    # validation "abcabxyz!\n": x, y, z, ! and newline were never seen: id 3
    np.testing.assert_array_equal(ds.test_x, [[0, 1, 2, 0], [1, 3, 3, 3]])
    np.testing.assert_array_equal(ds.test_y, [[1, 2, 0, 1], [3, 3, 3, 3]])
    v = Vocabulary(ds.vocab)
    assert v.decode([0, 1, 3]) == "ab\ufffd"
    with pytest.raises(KeyError):
        v.encode("abz", strict=True)
    limited = ds.limit(3, 1)  # keeps what the trainer and sampling need
    assert limited.task == "language-model" and limited.vocab == "abc"


def test_windows_stride_and_the_loader_keeps_ids_integer():
    ids = np.arange(10)
    x, y = windows(ids, 3, stride=2)
    np.testing.assert_array_equal(x, [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8]])
    np.testing.assert_array_equal(y, x + 1)
    loader = BatchLoader(x, y, 2, dtype="float32", shuffle=False)
    _, bx, by = next(loader.epoch(0))
    assert bx.dtype == np.int64 and by.dtype == np.int64  # token ids are not cast
    bx, _ = next(eval_batches(x, y, 2, dtype="float32"))
    assert bx.dtype == np.int64
    images = np.zeros((4, 1, 2, 2), dtype=np.float64)
    _, ix, _ = next(BatchLoader(images, np.zeros(4, dtype=np.int64), 2,
                                dtype="float32").epoch(0))
    assert ix.dtype == np.float32  # images still are


def test_folder_sorted_binary_skipped_and_fortune_separators(tmp_path):
    (tmp_path / "b.txt").write_text("second\n", encoding="utf-8")
    (tmp_path / "a").write_text("One.\n%\nTwo\n  -- me\n%\n", encoding="utf-8")
    (tmp_path / "a.dat").write_bytes(b"\0\0\0\x02binary index")  # strfile's index
    (tmp_path / "a.u8").symlink_to(tmp_path / "a")  # a second name for a listed file
    text, source = read_text(str(tmp_path))
    assert text == "One.\n\nTwo\n  -- me\nsecond\n"
    assert source == str(tmp_path)
    assert strip_fortune_separators("%\nA\n%\nB\n%\n") == "A\n\nB\n"


def test_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        read_text(str(tmp_path / "nothing"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not UTF-8 text \\(byte 3 is 0xe9\\)"):
        read_text(str(bad))
    short = tmp_path / "short.txt"
    short.write_text("tiny text\n", encoding="utf-8")
    with pytest.raises(DataError, match="too few for windows of 8"):
        load_dataset("text", str(short), context=8)
    monkeypatch.setattr(text_mod, "DEFAULT_CORPUS", str(tmp_path / "no-fortunes"))
    with pytest.raises(DataError) as e:
        load_dataset("text")
    assert "apt-get install fortunes" in str(e.value) and "\n" not in str(e.value)


def test_bigram_by_hand():
    # pairs: a->b, b->a, a->b, b->b over vocabulary {a, b} (size 2), alpha 1
    x, y = np.array([[0, 1, 0, 1]]), np.array([[1, 0, 1, 1]])
    counts = bigram_counts(x, y, 2)
    np.testing.assert_array_equal(counts, [[0, 2], [1, 1]])
    lp = bigram_log_probs(counts, 1.0)
    # P(b|a) = (2+1)/(2+2) = 3/4, P(a|a) = 1/4, P(a|b) = P(b|b) = 2/4
    np.testing.assert_allclose(np.exp(lp), [[0.25, 0.75], [0.5, 0.5]])
    # scored on a->a and b->b: -(log 1/4 + log 1/2) / 2
    assert bigram_nats(lp, [0, 1], [0, 1]) == pytest.approx(-(math.log(0.25) + math.log(0.5)) / 2)
    alpha, _ = fit_bigram(x, y, 2, alphas=(0.5,))
    assert alpha == 0.5


def test_bigram_baseline_picks_alpha_on_training_text_only(tmp_path):
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcd"), 4000)) + "\n"
    path = tmp_path / "r.txt"
    path.write_text(text, encoding="utf-8")
    ds = load_dataset("text", str(path), context=16)
    base = bigram_baseline(ds)
    # uniform random characters: about log 4 nats whatever the smoothing
    assert abs(base["nats_per_char"] - math.log(4)) < 0.05
    assert base["bits_per_char"] == pytest.approx(base["nats_per_char"] / math.log(2))
    assert base["alpha"] in text_mod.BIGRAM_ALPHAS

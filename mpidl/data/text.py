"""Character-level text: ``--dataset text --data-dir FILE_OR_DIR``.

Any UTF-8 text file, or a folder of them (read in sorted name order and concatenated).
The last ``valid_fraction`` (10 %) of the characters is the validation text, the rest the
training text: a deterministic split that keeps validation text unseen. The vocabulary
is the sorted set of the training text's characters, ids 0 .. V-1; id V is reserved for
validation characters that never occur in the training text (the model never sees it
as a target, so such characters cost what they should: they were unpredictable).

Samples are windows of ``context`` characters: ``x`` the ids of characters
``[s, s + context)``, ``y`` those of ``[s + 1, s + context + 1)`` (every position's next
character), for window starts ``s`` every ``stride`` characters (default ``context``:
non-overlapping windows, each character a target once per epoch). Both are int64
``(N, context)`` arrays in a ``Dataset`` whose ``task`` is ``"language-model"``.

The default corpus is Debian's fortune cookies (``apt-get install fortunes``: about
2.6 MB of English quotations, jokes and verse in /usr/share/games/fortunes). In fortune
files (recognised by the ``strfile`` index ``NAME.dat`` beside them) the ``%`` lines
that separate the cookies become blank lines.
"""

import math
import os

import numpy as np

from mpidl.errors import DataError

DEFAULT_CORPUS = "/usr/share/games/fortunes"
CORPUS_PACKAGE = "fortunes"
DEFAULT_CONTEXT = 128
VALID_FRACTION = 0.1
#: the add-alpha values the bigram baseline chooses from (see ``fit_bigram``)
BIGRAM_ALPHAS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


def _text_files(path):
    """The files a path names: itself, or a folder's regular files in sorted order
    (binary files such as fortune's ``.dat`` indexes and second links to a file already
    listed are skipped)."""
    if os.path.isfile(path):
        return [path]
    files, seen = [], set()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        real = os.path.realpath(full)
        if name.startswith(".") or not os.path.isfile(full) or real in seen:
            continue
        with open(full, "rb") as f:
            if b"\0" in f.read(4096):  # binary: not text
                continue
        seen.add(real)
        files.append(full)
    return files


def strip_fortune_separators(text):
    """A fortune file's cookies separated by a blank line instead of a ``%`` line."""
    cookies = [c.strip("\n") for c in text.split("\n%\n")]
    if cookies and cookies[-1].rstrip("\n") == "%":
        cookies.pop()
    if cookies and cookies[0].startswith("%\n"):
        cookies[0] = cookies[0][2:]
    return "\n\n".join(c for c in cookies if c.strip()) + "\n"


def read_text(path=None):
    """(text, source): the characters of a UTF-8 file or of a folder's files.

    ``path`` None: the default corpus. Errors are one ``DataError`` line naming the file
    and what to do."""
    if path is None:
        if not os.path.isdir(DEFAULT_CORPUS):
            raise DataError(f"the default text corpus {DEFAULT_CORPUS} is missing: install "
                            f"it with apt-get install {CORPUS_PACKAGE} (Debian/Ubuntu), or "
                            "pass --data-dir FILE_OR_DIR with UTF-8 text of your own")
        path = DEFAULT_CORPUS
    if not os.path.exists(path):
        raise DataError(f"--data-dir {path} does not exist; give a UTF-8 text file or a "
                        "folder of them")
    files = _text_files(path)
    if not files:
        raise DataError(f"--data-dir {path} holds no text files; give a UTF-8 text file or "
                        "a folder of them")
    parts = []
    for name in files:
        with open(name, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{name} is not UTF-8 text (byte {e.start} is "
                            f"0x{raw[e.start]:02x}); convert it to UTF-8 or leave it out") from None
        if os.path.isfile(name + ".dat"):
            text = strip_fortune_separators(text)
        if text and not text.endswith("\n"):
            text += "\n"
        parts.append(text)
    return "".join(parts), os.path.abspath(path)


def split_text(text, valid_fraction=VALID_FRACTION):
    """(training text, validation text): the last ``valid_fraction`` is validation."""
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    cut = len(text) - int(round(len(text) * valid_fraction))
    return text[:cut], text[cut:]


class Vocabulary:
    """Characters <-> ids: ``chars[i]`` has id i; id ``len(chars)`` (``unknown``) stands
    for any other character. ``size`` counts it: the model's number of classes."""

    def __init__(self, chars):
        self.chars = "".join(chars)
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("a vocabulary lists each character once")
        self.unknown = len(self.chars)
        self.size = self.unknown + 1
        self._index = {c: i for i, c in enumerate(self.chars)}
        self._lookup = None

    @classmethod
    def of(cls, text):
        return cls(sorted(set(text)))

    def encode(self, text, strict=False):
        """int64 ids of ``text``; characters outside the vocabulary become ``unknown``,
        or with ``strict`` raise ``KeyError`` naming the first one."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        if self._lookup is None:
            top = max((ord(c) for c in self.chars), default=0) + 1
            self._lookup = np.full(top, self.unknown, dtype=np.int64)
            self._lookup[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        lookup = self._lookup
        ids = np.full(len(codes), self.unknown, dtype=np.int64)
        known = codes < len(lookup)
        ids[known] = lookup[codes[known]]
        if strict and (ids == self.unknown).any():
            bad = text[int(np.argmax(ids == self.unknown))]
            raise KeyError(bad)
        return ids

    def decode(self, ids):
        """The text of ``ids`` (``unknown`` becomes U+FFFD)."""
        return "".join(self.chars[i] if i < self.unknown else "\ufffd" for i in map(int, ids))


def windows(ids, context, stride=None):
    """(x, y) int64 ``(N, context)``: windows starting every ``stride`` ids, y one ahead."""
    stride = context if stride is None else int(stride)
    n = (len(ids) - 1 - context) // stride + 1 if len(ids) > context else 0
    if n <= 0:
        return (np.zeros((0, context), dtype=np.int64),) * 2
    starts = np.arange(n) * stride
    offsets = np.arange(context)
    x = ids[starts[:, None] + offsets]
    y = ids[starts[:, None] + offsets + 1]
    return x, y


def text_dataset(data_dir=None, context=None, stride=None, valid_fraction=VALID_FRACTION):
    """The ``Dataset`` of a text (module doc): windows of ``context`` characters."""
    from mpidl.data.datasets import Dataset  # noqa: PLC0415 - datasets imports this module

    context = DEFAULT_CONTEXT if context is None else int(context)
    if context < 1:
        raise DataError(f"--context must be at least 1, got {context}")
    text, source = read_text(data_dir)
    train_text, valid_text = split_text(text, valid_fraction)
    vocab = Vocabulary.of(train_text)
    train_ids, valid_ids = vocab.encode(train_text), vocab.encode(valid_text)
    tx, ty = windows(train_ids, context, stride)
    vx, vy = windows(valid_ids, context, stride)
    if len(tx) == 0 or len(vx) == 0:
        raise DataError(f"{source}: {len(text)} characters are too few for windows of "
                        f"{context} (the validation part, the last {valid_fraction:.0%}, "
                        f"needs {context + 1} or more); give more text or a smaller --context")
    return Dataset("text", tx, ty, vx, vy, vocab.size, list(vocab.chars) + ["<unknown>"],
                   source, task="language-model", vocab=vocab.chars)


# -- the character-bigram baseline

def bigram_counts(x, y, size):
    """``counts[a, b]``: how many of the pairs ``(x[i], y[i])`` are ``(a, b)``."""
    counts = np.zeros((size, size), dtype=np.float64)
    np.add.at(counts, (np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)), 1.0)
    return counts


def bigram_log_probs(counts, alpha):
    """log P(b | a) with add-alpha smoothing: ``(C(a, b) + alpha) / (C(a) + alpha V)``."""
    size = counts.shape[1]
    return np.log(counts + alpha) - np.log(counts.sum(axis=1, keepdims=True) + alpha * size)


def bigram_nats(log_probs, x, y):
    """Mean ``-log P(y | x)`` over the pairs ``(x[i], y[i])`` (nats per character)."""
    return float(-log_probs[np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)].mean())


def fit_bigram(x, y, size, alphas=BIGRAM_ALPHAS, holdout=VALID_FRACTION):
    """(alpha, log P) of the add-alpha bigram model of the training pairs: every
    ``(x[i, t], y[i, t])`` of the training windows (each character and the next).

    Alpha is the one of ``alphas`` that predicts the last ``holdout`` of the training
    windows best when fitted on the rest (the validation text is never looked at); then
    the model is refitted on all of them. The baseline gets its best smoothing, so a
    model that beats it beats a fair opponent."""
    x, y = np.asarray(x).reshape(len(x), -1), np.asarray(y).reshape(len(y), -1)
    cut = len(x) - int(round(len(x) * holdout))
    if len(alphas) > 1 and 0 < cut < len(x):
        counts = bigram_counts(x[:cut], y[:cut], size)
        scores = [bigram_nats(bigram_log_probs(counts, a), x[cut:], y[cut:]) for a in alphas]
        alpha = alphas[int(np.argmin(scores))]
    else:
        alpha = alphas[0]
    return alpha, bigram_log_probs(bigram_counts(x, y, size), alpha)


def bigram_baseline(dataset, alphas=BIGRAM_ALPHAS):
    """{"alpha", "nats_per_char", "bits_per_char"} of the add-alpha bigram fitted on a
    text dataset's training windows, scored on exactly the validation targets the model
    is scored on (every ``(x, y)`` pair of the validation windows)."""
    alpha, log_probs = fit_bigram(dataset.train_x, dataset.train_y, dataset.num_classes,
                                  alphas)
    nats = bigram_nats(log_probs, dataset.test_x, dataset.test_y)
    return {"alpha": alpha, "nats_per_char": nats, "bits_per_char": nats / math.log(2)}

"""Checkpoints: nested training state in one ``.npz`` file, written atomically.

Format: a NumPy ``.npz`` (zip) file ``ckpt-<step>.npz``. Arrays are stored as members
named by their path in the state (``model/0.weight``, ``optimizer/state/0.weight/m``);
everything else (numbers, strings, big integers of RNG states, the nesting itself) is one
JSON document in the member ``__tree__``. Loading needs no pickle, so a checkpoint cannot
run code, and ``numpy.load`` alone can inspect one.

Sharded (tensor parallelism): every rank holding a piece of the model writes its slices
as ``ckpt-<step>-shard-<i>-of-<n>.npz`` (the same format), and only then does the root
write ``ckpt-<step>.npz``, the index: the unsliced tensors, the rest of the state, and
``shards`` (the shard files and, per sliced tensor, the dimension it is cut along and
its whole size). ``load`` joins the shards, so a reader gets the whole model whatever
layout wrote it; a missing or unreadable shard makes the checkpoint unreadable, and
``latest`` falls back to the one before. ``load(path, read=False)`` checks the files the
same way but leaves the model's and optimizer's tensors on disk (``Ref``): a rank of a
split model reads only its part (``Runtime.load_full_state``).

ZeRO over data parallelism alone shards the same way, in flat pieces: rank ``i`` of ``n``
writes the elements of every tensor that fall in its chunks (``{"pieces": [[path, start,
1-D array], ...]}``: parameters, optimizer slots, float32 masters), and the index names
each such tensor's place in the state and its shape (``shards["flat"]``); ``load`` joins
the pieces, which must cover each tensor exactly, and ``read=False`` gives ``FlatRef``s,
from which a rank of another run reads the elements of its own chunks only. Under
tensor parallelism a sliced tensor's pieces are of its tp rank's slice (places under
``["tp", t, ...]``): ``load`` joins each slice from its pieces, then the slices along their
dimension (``shards["flat_slices"]``; ``read=False``: a ``Joined`` of ``FlatRef``s).

A training rank's own state (error-feedback residuals, model averaging's own
parameters, an asynchronous pipeline's pending gradient) is written by that rank, as
``ckpt-<step>-rank-<i>-of-<n>.npz`` in the same flat pieces; the index keeps the
per-rank lists with each array taken out (``split_arrays``) and names the pieces
(``rank_shards``). Left on disk, those arrays are ``FlatRef``s marked ``own``:
``read_shared`` reads everything else, each rank reads its own where it loads it.

Atomic write: the file is written under a temporary name in the same folder, flushed and
fsync'ed, then ``os.replace``'d onto its final name, and the folder is fsync'ed. A crash
at any moment leaves either the previous checkpoints only, or the previous ones and the
complete new one; a leftover temporary file is never taken for a checkpoint, and
``latest`` falls back to an older checkpoint when the newest cannot be read.
"""

import json
import os
import re
import shutil
import tempfile
import zipfile

import numpy as np

from mpidl.backend import is_gpu_array, to_numpy
from mpidl.engine.lazy import Deferred
from mpidl.errors import UserError

FORMAT = "mpidl-checkpoint"
VERSION = 1
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")
_SHARD = re.compile(r"^ckpt-(\d+)-(?:shard|rank)-\d+-of-\d+\.npz$")
_TMP_PREFIX = ".tmp-ckpt-"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint that cannot be written (disk full, permissions): one line for the
    user; the earlier checkpoints are kept. Still an OSError for callers that catch one."""


#: the state a checkpoint of ``mpidl train`` holds at its top level
REQUIRED = ("config", "progress", "model", "optimizer", "ranks")


def check_training_state(path, state):
    """CheckpointError unless ``state`` has every part a training checkpoint has."""
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise CheckpointError(f"{path} lacks part of a training state (it needs "
                              f"{', '.join(REQUIRED)})")


# -- nested state <-> (JSON tree, arrays)

def _is_array(x):
    return isinstance(x, np.ndarray) or is_gpu_array(x)


def encode(state):
    """(json-able tree, {member name: ndarray}) for a nested state."""
    arrays = {}

    def enc(obj, path):
        if _is_array(obj) or isinstance(obj, np.generic):
            key = "/".join(path) or "value"
            while key in arrays or key == "__tree__":
                key += "_"
            arrays[key] = to_numpy(obj) if _is_array(obj) else np.asarray(obj)
            return {"__array__": key, "scalar": isinstance(obj, np.generic)}
        if isinstance(obj, dict):
            return {"__dict__": [[enc_key(k), enc(v, path + [str(k)])] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"__list__" if isinstance(obj, list) else "__tuple__":
                    [enc(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot checkpoint {type(obj).__name__} at {'/'.join(path)}")

    def enc_key(k):
        if isinstance(k, (str, int)) and not isinstance(k, bool):
            return k
        raise TypeError(f"checkpoint keys must be str or int, got {k!r}")

    return enc(state, []), arrays


def decode(tree, arrays):
    """The nested state from ``encode``'s output (arrays come back as NumPy)."""
    if isinstance(tree, dict):
        if "__array__" in tree:
            a = arrays[tree["__array__"]]
            return a[()] if tree.get("scalar") else a
        if "__dict__" in tree:
            return {k: decode(v, arrays) for k, v in tree["__dict__"]}
        if "__list__" in tree:
            return [decode(v, arrays) for v in tree["__list__"]]
        if "__tuple__" in tree:
            return tuple(decode(v, arrays) for v in tree["__tuple__"])
    return tree


# -- files

def checkpoint_path(directory, step):
    return os.path.join(directory, f"ckpt-{int(step):09d}.npz")


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_npz_atomic(path, arrays, crash_after_bytes=None):
    """Write ``arrays`` as an .npz at ``path`` atomically (temp file, fsync, rename).

    ``arrays``: {name: array}, or ``(name, array)`` pairs as they come (each is written
    before the next is asked for, so a stream of a model's tensors is never held whole).
    ``crash_after_bytes`` is a test hook: stop the process (``os._exit``) after that many
    bytes of the temporary file are on disk, like a kill in the middle of a write.
    """
    items = arrays.items() if hasattr(arrays, "items") else arrays
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_npz(f, items)
            f.flush()
            if crash_after_bytes is not None:
                f.truncate(crash_after_bytes)
                os.fsync(f.fileno())
                os._exit(1)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    return path


def _write_npz(f, items):
    """What ``numpy.savez`` writes (a zip of uncompressed ``.npy`` members), one member at
    a time. A contiguous array goes from its own memory (``write_array`` would copy it
    16 MiB at a time into a zip member)."""
    fmt = np.lib.format
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in items:
            a = np.asanyarray(a)
            with z.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                if a.flags.c_contiguous and not a.dtype.hasobject:
                    fmt.write_array_header_1_0(member, fmt.header_data_from_array_1_0(a))
                    member.write(memoryview(a.reshape(-1).view(np.uint8)))
                else:
                    fmt.write_array(member, a, allow_pickle=False)


def shard_name(step, index, count, kind="shard"):
    """A shard file's name: ``kind`` "shard" (a piece of the model and its optimizer
    state) or "rank" (a training rank's own state: ``rank_shards``)."""
    return f"ckpt-{int(step):09d}-{kind}-{index}-of-{count}.npz"


def _arrays_of(step, state):
    tree, arrays = encode(state)
    doc = json.dumps({"format": FORMAT, "version": VERSION, "step": int(step), "state": tree})
    arrays["__tree__"] = np.frombuffer(doc.encode("utf-8"), dtype=np.uint8)
    return arrays


def _check_space(directory, path, arrays, kept):
    need = sum(int(a.nbytes) for a in arrays.values()) + (1 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise CheckpointWriteError(
            f"not enough space to write checkpoint {path}: it needs about "
            f"{need / (1 << 20):.1f} MiB and {free / (1 << 20):.1f} MiB are free{kept}; "
            "free some space (or use another --checkpoint-dir) and run again with "
            "--resume")


def save_shard(directory, step, index, count, state, crash_after_bytes=None, kind="shard"):
    """Write this rank's part of checkpoint ``step`` (``index`` of ``count`` shards of
    ``kind``, ``shard_name``) atomically, space checked first; the index written after
    every shard makes the checkpoint."""
    path = os.path.join(directory, shard_name(step, index, count, kind))
    try:
        os.makedirs(directory, exist_ok=True)
        arrays = _arrays_of(step, state)
        _check_space(directory, path, arrays, f"; the earlier checkpoints in {directory} "
                                              "are kept")
        return write_npz_atomic(path, arrays, crash_after_bytes)
    except CheckpointWriteError:
        raise
    except OSError as e:
        raise CheckpointWriteError(f"cannot write checkpoint shard {path} ({e.strerror or e});"
                                   f" the earlier checkpoints in {directory} are kept; fix "
                                   "that and run again with --resume") from None


def check_shards_visible(directory, files):
    """CheckpointWriteError unless every shard the other ranks wrote is in ``directory``
    as this rank sees it: a folder local to each node (not a file system every rank
    sees) would leave an index whose shards are elsewhere."""
    missing = [f for f in files if not os.path.exists(os.path.join(directory, f))]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointWriteError(
            f"checkpoint shard {missing[0]}{more}, written by another rank, is not in "
            f"{directory} as the first rank sees it: "
            "the ranks of this layout each write a shard, so --checkpoint-dir (or "
            "--out-dir) must be a folder every rank sees, on a shared file system; the "
            "earlier checkpoints are kept")


def _join_shards(path, state, read=True):
    """Replace the index's sharded entries by the whole tensors joined from its shards
    (``read=False``: by ``Ref``s over the shards' members), and the training ranks' own
    arrays by those of their rank shards."""
    info = state.pop("shards", None)
    if info is not None:
        _join_model_shards(path, state, info, read)
    info = state.pop("rank_shards", None)
    if info is not None:
        _join_flat(path, state, info["flat"], _load_shards(path, info["files"], read),
                   info["files"], read, own=True)
    return state


def _load_shards(path, files, read):
    directory = os.path.dirname(path)
    pieces = []
    for name in files:
        shard = os.path.join(directory, name)
        if not os.path.exists(shard):
            raise CheckpointError(f"{path}: its index names shard {name}, which is missing; "
                                  "the checkpoint cannot be put back together")
        try:
            pieces.append(load(shard, read))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: its shard {name} cannot be read ({e})") from None
    return pieces


def _join_model_shards(path, state, info, read):
    pieces = _load_shards(path, info["files"], read)
    if info.get("flat"):
        _join_flat(path, state, info["flat"], pieces, info["files"], read)
    _join_flat_slices(path, state, info.get("flat_slices"))
    for name, entry in info.get("slices", {}).items():
        dim, full = entry[:2]
        # (the shards that hold its slices, in order: all of them, or a pipeline
        # stage's tp ranks)
        holders = [pieces[i] for i in entry[2]] if len(entry) > 2 else pieces
        try:
            whole = _join([p["model"][name] for p in holders], dim)
            slots = {slot: _join([p["optimizer"][name][slot] for p in holders], dim)
                     for slot in (holders[0]["optimizer"].get(name) or {})}
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: the shards of {name!r} do not fit together "
                                  f"({type(e).__name__}: {e})") from None
        if whole.shape[dim] != full:
            raise CheckpointError(f"{path}: the shards of {name!r} hold {whole.shape[dim]} "
                                  f"along dimension {dim}, the index says {full}")
        state["model"][name] = whole
        if slots:
            state["optimizer"]["state"].setdefault(name, {}).update(slots)
    return state


def _join_flat(path, state, entries, shards, files, read, own=False):
    """Put every ``[place, shape, dtype]`` of ``entries`` into ``state``: the tensor joined
    from the flat pieces the shards hold of it (``read=False``: a ``FlatRef`` over them,
    marked ``own`` for a rank's own state). A place runs through dicts (keys) and lists
    (positions: a per-rank list's entries) the index already holds, or makes dicts."""
    found = {}
    for i, shard in enumerate(shards):
        for place, start, piece in shard.get("pieces", ()):
            found.setdefault(tuple(place), []).append((int(start), piece, files[i]))
    for place, shape, dtype in entries:
        where = "/".join(map(str, place))
        shape, dtype = tuple(shape), np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        have = sorted(found.pop(tuple(place), []), key=lambda e: e[0])
        end, dtypes = 0, {np.dtype(p.dtype) for _, p, _ in have} - {dtype}
        for start, piece, name in have:
            if start != end or piece.ndim != 1:
                raise CheckpointError(f"{path}: the shards' pieces of {where!r} do not fit "
                                      f"together (shard {name} begins at element {start}, "
                                      f"the pieces before end at {end})")
            end += piece.shape[0]
        if end != size or dtypes:
            raise CheckpointError(f"{path}: the shards hold {end} elements of {where!r} "
                                  f"({', '.join(sorted(map(str, dtypes | {dtype})))}); the "
                                  f"index says {size} ({shape}) of {dtype}")
        if not read:
            value = FlatRef([(p.parts[0][0], p.parts[0][1], start, start + p.shape[0])
                             for start, p, _ in have], shape, dtype, own)
        else:
            value = (np.concatenate([np.asarray(p) for _, p, _ in have]) if have
                     else np.empty(0, dtype=dtype)).reshape(shape)
        node = state
        try:
            for key in place[:-1]:
                node = node[key] if isinstance(node, list) else node.setdefault(key, {})
            node[place[-1]] = value
        except (IndexError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{path}: its index has no place {where!r} for the "
                                  "shards' tensor") from None
    if found:
        names = ", ".join("/".join(map(str, k)) for k in list(found)[:3])
        raise CheckpointError(f"{path}: its shards hold pieces of tensors its index does "
                              f"not name: {names}")


def _join_flat_slices(path, state, entry):
    """ZeRO under tensor parallelism: each tp rank's slice of a tensor was joined from
    flat pieces under ``["tp", t, *place]``; join the slices along their dimension into
    the tensor at ``place`` (``entry``: ``{"degree": T, "tensors": [[place, dim, whole
    size]]}``)."""
    if not entry:
        return
    slices = state.pop("tp", {})
    for place, dim, full in entry["tensors"]:
        where = "/".join(map(str, place))
        try:
            parts = []
            for t in range(entry["degree"]):
                node = slices[t]
                for key in place:
                    node = node[key]
                parts.append(node)
            whole = _join(parts, dim)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: the shards' slices of {where!r} do not fit "
                                  f"together ({type(e).__name__}: {e})") from None
        if whole.shape[dim] != full:
            raise CheckpointError(f"{path}: the shards' slices of {where!r} hold "
                                  f"{whole.shape[dim]} along dimension {dim}, the index "
                                  f"says {full}")
        node = state
        for key in place[:-1]:
            node = node.setdefault(key, {})
        node[place[-1]] = whole


def split_arrays(tree, place):
    """``(skeleton, [(place, array)])``: ``tree`` (a rank's own state) with each array
    taken out, None where it was, and the arrays with their places (``place`` and the
    keys and positions below it), for the rank's own shard (``rank_shards``). Tuples
    holding arrays come back as lists."""
    out = []

    def walk(obj, at):
        if _is_array(obj):
            out.append((at, to_numpy(obj)))
            return None
        if isinstance(obj, dict):
            return {k: walk(v, at + [k]) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, at + [i]) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) or any(
                _is_array(v) for v in obj) else tuple(items)
        return obj

    return walk(tree, list(place)), out


def read_shared(state):
    """``state`` (``load(path, read=False)``'s) with every tensor read but the training
    ranks' own state (each rank reads its own: ``FlatRef.own``): what the first rank
    hands the others when their model is whole on each of them."""
    if isinstance(state, Deferred):
        return state if getattr(state, "own", False) else state.values()
    if isinstance(state, dict):
        return {k: read_shared(v) for k, v in state.items()}
    if isinstance(state, list):
        return [read_shared(v) for v in state]
    if isinstance(state, tuple):
        return tuple(read_shared(v) for v in state)
    return state


def _join(pieces, dim):
    """Arrays concatenated along ``dim``, or ``Ref``s joined into one (ValueError, as
    ``numpy.concatenate`` gives, when their other dimensions or dtypes differ)."""
    if any(isinstance(p, Deferred) for p in pieces) and not all(
            isinstance(p, Ref) for p in pieces):
        return Joined(pieces, dim)
    if not all(isinstance(p, Ref) for p in pieces):
        return np.concatenate(pieces, axis=dim)
    _check_joinable(pieces, dim)
    return Ref([part for p in pieces for part in p.parts], pieces[0].dtype, dim)


def _check_joinable(pieces, dim):
    """ValueError, as ``numpy.concatenate`` gives, unless ``pieces`` (deferred tensors)
    agree in dtype and in every dimension but ``dim``."""
    first = pieces[0]
    for p in pieces[1:]:
        if (p.ndim != first.ndim or np.dtype(p.dtype) != np.dtype(first.dtype)
                or tuple(p.shape[:dim]) + tuple(p.shape[dim + 1:])
                != tuple(first.shape[:dim]) + tuple(first.shape[dim + 1:])):
            raise ValueError(f"pieces of shapes {first.shape} ({first.dtype}) and {p.shape} "
                             f"({p.dtype}) do not join along dimension {dim}")


class Ref(Deferred):
    """A tensor of a checkpoint, read when it is asked for (``load(path, read=False)``):
    one member of one file, or, for a tensor sliced over shards, the members of several
    joined along ``dim``. ``values(dim, lo, hi)`` reads only the files the slice
    overlaps, so a tensor-parallel rank resuming at the layout that wrote the checkpoint
    reads its own shard."""

    __slots__ = ("parts", "dtype", "dim", "shape")

    def __init__(self, parts, dtype, dim=0):
        self.parts = list(parts)  # [(file, member, shape)]
        self.dtype = np.dtype(dtype)
        self.dim = dim
        shape = list(self.parts[0][2])
        if len(self.parts) > 1:
            shape[dim] = sum(part[2][dim] for part in self.parts)
        self.shape = tuple(shape)

    def values(self, dim=None, lo=None, hi=None):
        pieces, start = [], 0
        for path, member, shape in self.parts:
            first, start = start, start + (shape[self.dim] if shape else 1)
            if dim is None:
                pieces.append(_read_member(path, member))
                continue
            a, b = lo, hi  # the slice, in this part's coordinates
            if dim == self.dim and len(self.parts) > 1:
                a, b = max(lo, first) - first, min(hi, start) - first
                if a >= b:
                    continue
            part = _read_member(path, member)
            if (a, b) != (0, shape[dim]):  # (a copy: the part is not kept behind a view)
                index = [slice(None)] * len(shape)
                index[dim] = slice(a, b)
                part = part[tuple(index)].copy()
            pieces.append(part)
        if not pieces:  # an empty slice
            shape = list(self.shape)
            shape[dim] = 0
            return np.empty(shape, dtype=self.dtype)
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces, axis=self.dim)

    def __repr__(self):
        return f"Ref({self.shape}, {self.dtype}, {len(self.parts)} file(s))"


class FlatRef(Deferred):
    """A tensor of a checkpoint in flat pieces over shard files (ZeRO's chunks, a
    pipeline stage's tensors, a rank's own state), read when asked for:
    ``values_flat(lo, hi)`` reads only the pieces that overlap elements ``[lo, hi)`` (a
    rank's chunks), ``values()`` all of them. ``own``: a training rank's own state (its
    rank shard), which that rank alone reads (``read_shared``)."""

    __slots__ = ("parts", "shape", "dtype", "own")

    def __init__(self, parts, shape, dtype, own=False):
        self.parts = list(parts)  # [(file, member, first element, end)]
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.own = own

    def values_flat(self, lo, hi):
        over = [part for part in self.parts if part[2] < hi and part[3] > lo]
        if len(over) == 1 and over[0][2] <= lo and over[0][3] >= hi:  # one piece: no copy
            path, member, first, end = over[0]
            piece = _read_member(path, member)
            return piece if (first, end) == (lo, hi) else piece[lo - first:hi - first].copy()
        out = np.empty(hi - lo, dtype=self.dtype)
        for path, member, first, end in over:
            a, b = max(first, lo), min(end, hi)
            if a < b:
                out[a - lo:b - lo] = _read_member(path, member)[a - first:b - first]
        return out

    def values(self, dim=None, lo=None, hi=None):
        whole = self.values_flat(0, self.size).reshape(self.shape)
        if dim is None:
            return whole
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(lo, hi)
        return whole[tuple(index)].copy()

    def __repr__(self):
        return f"FlatRef({self.shape}, {self.dtype}, {len(self.parts)} piece(s))"


class Joined(Deferred):
    """Deferred tensors joined along ``dim``: a tensor's tensor-parallel slices, each in
    flat pieces over shard files (ZeRO's chunks under tensor parallelism).
    ``values(dim, lo, hi)`` makes only the slices ``[lo, hi)`` overlaps along ``dim``."""

    __slots__ = ("parts", "dim", "shape", "dtype")

    def __init__(self, parts, dim):
        _check_joinable(parts, dim)
        first = parts[0]
        self.parts, self.dim = list(parts), dim
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape, self.dtype = tuple(shape), np.dtype(first.dtype)

    def values(self, dim=None, lo=None, hi=None):
        if dim != self.dim:
            whole = np.concatenate([_made(p) for p in self.parts], axis=self.dim)
            if dim is None:
                return whole
            index = [slice(None)] * len(self.shape)
            index[dim] = slice(lo, hi)
            return whole[tuple(index)].copy()
        out, start = [], 0
        for p in self.parts:
            first, start = start, start + p.shape[dim]
            a, b = max(lo, first) - first, min(hi, start) - first
            if a < b:
                out.append(_made(p) if (a, b) == (0, p.shape[dim]) else
                           p.values(dim, a, b) if isinstance(p, Deferred) else
                           np.take(p, range(a, b), axis=dim))
        if not out:
            shape = list(self.shape)
            shape[dim] = 0
            return np.empty(shape, dtype=self.dtype)
        return out[0] if len(out) == 1 else np.concatenate(out, axis=dim)

    def __repr__(self):
        return f"Joined({self.shape}, {self.dtype}, {len(self.parts)} slice(s))"


def _made(a):
    return a.values() if isinstance(a, Deferred) else np.asarray(a)


def _read_member(path, member):
    """Array ``member`` of the .npz at ``path``."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return z[member]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"cannot read {member!r} of checkpoint {path}: "
                              f"{type(e).__name__}: {e}") from None


def _headers(z):
    """{member: (shape, dtype)} of an open .npz, from the arrays' headers only."""
    out = {}
    for member in z.files:
        with z.zip.open(member + ".npy") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                    np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
        out[member] = (tuple(shape), dtype)
    return out


def deferred_member(member, shape):
    """Whether ``load(path, read=False)`` leaves array ``member`` on disk: a tensor of the
    model or of the optimizer, a shard's flat piece (scalars and the rest of the state
    are read)."""
    return bool(shape) and member.startswith(("model/", "optimizer/", "pieces/"))


def save(directory, step, state, keep=None, crash_after_bytes=None):
    """Write ``state`` as checkpoint ``step`` in ``directory``; keep the newest ``keep``.

    Space is checked first, and a write that fails (disk full, permissions) raises
    ``CheckpointWriteError`` with every earlier checkpoint left in place. Pruning keeps
    the newest ``keep`` checkpoints up to this step; a checkpoint with a higher step
    number (an unreadable one a resume skipped) is never what pushes this one out.
    """
    arrays = _arrays_of(step, state)
    path = checkpoint_path(directory, step)
    kept = f"; the earlier checkpoints in {directory} are kept"
    try:
        os.makedirs(directory, exist_ok=True)
        _check_space(directory, path, arrays, kept)
        path = write_npz_atomic(path, arrays, crash_after_bytes)
    except CheckpointWriteError:
        raise
    except OSError as e:
        raise CheckpointWriteError(f"cannot write checkpoint {path} ({e.strerror or e})"
                                   f"{kept}; fix that and run again with --resume") from None
    if keep:
        for old in [c for c in list_checkpoints(directory) if c[0] <= step][:-keep]:
            try:
                os.unlink(old[1])
            except OSError:
                pass
        _remove_orphan_shards(directory, step)
    return path


def _remove_orphan_shards(directory, step):
    """Shards of earlier steps whose index is gone (pruned, or never written: a crash)."""
    have = {s for s, _ in list_checkpoints(directory)}
    for name in os.listdir(directory):
        m = _SHARD.match(name)
        if m and int(m.group(1)) < step and int(m.group(1)) not in have:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def load(path, read=True):
    """The state saved in checkpoint ``path``; CheckpointError when it cannot be read.

    ``read=False``: the model's and the optimizer's tensors stay on disk, as ``Ref``s that
    read them where they are wanted (a split model's resume: each rank reads its part);
    every file is still checked whole (the zip's checksum of every member, read one at a
    time), so a damaged checkpoint is found here, not while the ranks read it."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if not hasattr(loaded, "files"):
            raise CheckpointError(f"{path} holds a single array, not a checkpoint")
        with loaded as z:
            doc = json.loads(bytes(z["__tree__"]).decode("utf-8"))
            if doc.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not an mpidl checkpoint")
            if doc.get("version", 0) > VERSION:
                raise CheckpointError(f"{path} has format version {doc['version']}; this "
                                      f"mpidl reads up to {VERSION}")
            if read:
                arrays = {k: z[k] for k in z.files if k != "__tree__"}
            else:
                bad = z.zip.testzip()
                if bad is not None:
                    raise CheckpointError(f"{path}: its member {bad} is damaged (bad CRC)")
                arrays = {k: Ref([(path, k, shape)], dtype) if deferred_member(k, shape)
                          else z[k] for k, (shape, dtype) in _headers(z).items()
                          if k != "__tree__"}
            state = decode(doc["state"], arrays)
        if isinstance(state, dict) and ("shards" in state or "rank_shards" in state):
            state = _join_shards(path, state, read)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile,
            json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") \
            from None
    return state


def list_checkpoints(directory):
    """[(step, path)] of the finished checkpoints in ``directory``, oldest first."""
    if not directory or not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def latest(directory, warn=None, check=None, read=True):
    """(path, state) of the newest usable checkpoint in ``directory``, or (None, None).

    A newest checkpoint that cannot be read (a disk that filled up, a stray file), or that
    ``check(path, state)`` rejects (by raising CheckpointError: another run's, parameters of
    other shapes), is reported through ``warn(message)`` and skipped for the one before.
    ``read``: as ``load``'s.
    """
    for _, path in reversed(list_checkpoints(directory)):
        try:
            state = load(path, read)
            if check is not None:
                check(path, state)
            return path, state
        except CheckpointError as e:
            if warn:
                warn(f"skipping checkpoint: {e}")
    return None, None


def remove_stale_temporaries(directory):
    """Delete temporary files left by writes that crashed (never a finished checkpoint)."""
    if not directory or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if name.startswith(_TMP_PREFIX):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


# -- the final model

def save_model(path, model, meta=None):
    """The model's parameters and buffers as a plain .npz ({"0.weight": array, ...});
    ``model``: a model, its ``state_dict`` (a whole one, gathered from its pieces), or
    ``(name, array)`` pairs as they come (``Runtime.whole_tensors``: written one at a
    time).

    ``meta`` (model name, input shape, ...) is stored as JSON in the member ``__meta__``;
    ``numpy.load(path)["0.weight"]`` reads a parameter without mpidl.
    """
    state = model.state_dict() if hasattr(model, "state_dict") else model
    items = state.items() if hasattr(state, "items") else state

    def arrays():
        for name, a in items:
            yield name, to_numpy(a)
        if meta is not None:
            yield "__meta__", np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    return write_npz_atomic(path, arrays())


def read_model_file(path, flag, hint=""):
    """(arrays, meta) of a model file saved by ``mpidl train``, for the command-line flag
    ``flag`` that names it; a ConfigError names the flag and the file."""
    from mpidl.errors import ConfigError  # noqa: PLC0415

    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file{hint}")
    try:
        return load_model_arrays(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError,
            zipfile.BadZipFile) as e:
        raise ConfigError(f"{flag} {path}: not a model file saved by mpidl train "
                          f"({type(e).__name__}: {e})") from None


def load_model_arrays(path):
    """({name: array}, meta) from a file written by ``save_model``."""
    loaded = np.load(path, allow_pickle=False)
    if not hasattr(loaded, "files"):  # a single array (.npy), not an .npz archive
        raise ValueError("it holds a single array (.npy), not the .npz archive of a model")
    with loaded as z:
        meta = json.loads(bytes(z["__meta__"]).decode()) if "__meta__" in z.files else {}
        return {k: z[k] for k in z.files if k != "__meta__"}, meta

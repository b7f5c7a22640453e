"""``algorithm="auto"``: pick an algorithm by collective, message size and number of ranks.

The choice comes from a table of size thresholds per collective and per p. A tuning run
(``mpidl bench collectives --tune``, under ``mpiexec -n P``) measures every algorithm and
saves the fastest per size to a JSON file: ``$MPIDL_TUNING`` if set, else
``$XDG_CACHE_HOME/mpidl/tuning.json`` (``~/.cache/mpidl/tuning.json``). The file holds
one table per p; a run at a p that was not tuned uses the nearest tuned p below it (or,
if none is below, the smallest tuned p), and without any file the defaults below apply. Rank 0 reads the file and broadcasts it, so
every rank decides alike (a disagreement would deadlock).

File format::

    {"version": 1, "tables": {"allreduce": {"2": [[65536, "mpi"], [null, "ring"]], ...}}}

Each entry ``[max_bytes, algorithm]`` covers sizes up to ``max_bytes`` (inclusive);
``null`` closes the table.

The defaults are what a tuning run measured at p = 2 on a quiet 2-core machine with MPICH
(bench/results): from Python, MPI's own call wins below ~8 KiB (per-call overhead);
recursive doubling (one exchange straight into the result at p = 2) wins in the middle;
the pipelined ring with persistent buffers wins for large messages (MPI's Allreduce,
Reduce_scatter and Reduce allocate a temporary per call and fall off above ~24 MiB).
Broadcast stays with MPI (no algorithm was consistently faster). Other p and other
machines: run the tuning.
"""

import json
import os

from . import algorithms
from .. import env

ALGORITHMS = algorithms.names()  # the registry's algorithms (algorithms.py)
COLLECTIVES = ("allreduce", "reduce_scatter", "reduce", "bcast", "allgather")
KiB, MiB = 1 << 10, 1 << 20

DEFAULTS = {  # measured at p = 2 on a quiet 2-core machine (bench/results), see above
    "allreduce": [[8 * KiB, "mpi"], [512 * KiB, "recursive_doubling"], [None, "ring"]],
    "reduce_scatter": [[8 * KiB, "mpi"], [256 * KiB, "recursive_doubling"], [None, "ring"]],
    "reduce": [[2 * KiB, "mpi"], [256 * KiB, "tree"], [None, "ring"]],
    "bcast": [[None, "mpi"]],
    "allgather": [[8 * KiB, "mpi"], [MiB, "recursive_doubling"], [None, "ring"]],
}


# Device arrays through pinned host memory (an MPI that is not CUDA-aware), 2 ranks: the
# ring's many segment exchanges each pay a device-host copy and a synchronization; one
# call of MPI's own on the whole staged buffer wins. Measured with 2 ranks sharing an
# H100 training the MLP (bench/results/gpu_ranks.json): images/s with MPICH ring 26.7 k,
# recursive doubling 33.1 k, MPI's own 37.1 k; with Open MPI 27.2 k, 29.3 k, 34.5 k.
# A tuning file, when there is one, decides instead.
STAGED_DEFAULTS = {
    "allreduce": [[None, "mpi"]],
}


def tuning_path():
    """Where tuning results are read and written."""
    explicit = env.get("MPIDL_TUNING")
    if explicit:
        return explicit
    return os.path.join(env.cache_dir(), "tuning.json")


def load(path=None):
    """The tuning tables from ``path`` (default ``tuning_path()``), or None if absent/unreadable."""
    path = path or tuning_path()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    tables = data.get("tables") if isinstance(data, dict) else None
    return tables if isinstance(tables, dict) else None


def save(tables, path=None, info=None):
    """Merge ``tables`` ({collective: {p: entries}}) into the file at ``path``; returns it."""
    path = path or tuning_path()
    merged = load(path) or {}
    for kind, per_p in tables.items():
        merged.setdefault(kind, {}).update({str(p): e for p, e in per_p.items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": 1, "info": info or {}, "tables": merged}, f, indent=1)
    os.replace(tmp, path)
    return path


def entries_from_timings(timings):
    """Threshold entries from ``{nbytes: {algorithm: seconds}}``: the fastest per size,
    adjacent sizes with the same winner merged."""
    entries = []
    for nbytes in sorted(timings):
        best = min(timings[nbytes], key=timings[nbytes].get)
        if entries and entries[-1][1] == best:
            entries[-1][0] = nbytes
        else:
            entries.append([nbytes, best])
    if entries:
        entries[-1][0] = None
    return entries


def _validate(entries, kind):
    out = []
    for item in entries:
        limit, alg = item
        if alg not in algorithms.REGISTRY or (limit is not None and not isinstance(limit, int)):
            raise ValueError(f"bad tuning entry {item!r} for {kind}")
        out.append((float("inf") if limit is None else limit, alg))
    if not out or out[-1][0] != float("inf"):
        out.append((float("inf"), out[-1][1] if out else DEFAULTS[kind][-1][1]))
    return out


class Selector:
    """Resolves ``"auto"`` for one communicator size."""

    def __init__(self, p, tables=None):
        self.p = p
        self.source = "defaults"
        self._table = {}
        for kind in COLLECTIVES:
            entries = DEFAULTS[kind]
            per_p = (tables or {}).get(kind) or {}
            tuned = [int(k) for k in per_p if str(k).isdigit()]
            below = [q for q in tuned if q <= p]
            pick = max(below) if below else (min(tuned) if tuned else None)
            if pick is not None:
                try:
                    entries = per_p[str(pick)]
                    self.source = "tuned"
                    self._table[kind] = _validate(entries, kind)
                    continue
                except (ValueError, TypeError):
                    entries = DEFAULTS[kind]
            self._table[kind] = _validate(entries, kind)
        self._table["allgatherv"] = self._table["allgather"]

    def choose(self, kind, nbytes, staged=False):
        """The algorithm for ``nbytes`` of collective ``kind``; ``staged``: device arrays
        that travel through host memory (see ``STAGED_DEFAULTS``)."""
        if staged and self.source == "defaults" and self.p == 2 and kind in STAGED_DEFAULTS:
            table = _validate(STAGED_DEFAULTS[kind], kind)
        else:
            table = self._table[kind]
        for limit, alg in table:
            if nbytes <= limit:
                return alg
        return table[-1][1]

    def table(self):
        return {k: [[None if lim == float("inf") else lim, a] for lim, a in v]
                for k, v in self._table.items()}

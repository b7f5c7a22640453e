"""Rank-tagged logging: rank 0 speaks, other ranks stay quiet unless asked.

Every line a rank prints carries its rank (``[rank 1] ...``), on stderr, so stdout stays
clean for the per-epoch JSON metrics.
"""

import logging
import sys

_LOGGER = "mpidl"


class _RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_logging(rank=0, verbose=False, stream=None):
    """Configure the "mpidl" logger for this rank and return it.

    Rank 0 logs INFO; other ranks log only warnings and errors unless ``verbose``, which
    also turns on DEBUG everywhere.
    """
    log = logging.getLogger(_LOGGER)
    for h in list(log.handlers):
        log.removeHandler(h)
    for f in list(log.filters):
        log.removeFilter(f)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
    handler.addFilter(_RankFilter(rank))
    log.addHandler(handler)
    log.propagate = False
    if verbose:
        log.setLevel(logging.DEBUG)
    else:
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return log


def get_logger():
    return logging.getLogger(_LOGGER)


def rank_prefix(text, rank):
    """``text`` with ``[rank R] `` before every line."""
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))

"""How a buffer of n elements is cut into p chunks, one per rank.

Counts are split as evenly as possible and the first ``n % p`` ranks get one more
element: ``n = 10, p = 4`` gives counts ``[3, 3, 2, 2]`` and offsets ``[0, 3, 6, 8]``.
``reduce_scatter`` returns chunk ``rank`` of this layout.
"""

from functools import lru_cache


@lru_cache(maxsize=256)
def even_split(n, p):
    """(counts, displs) of ``n`` elements over ``p`` ranks, as tuples of ints."""
    base, extra = divmod(n, p)
    counts = tuple(base + 1 if i < extra else base for i in range(p))
    displs = [0] * p
    for i in range(1, p):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, tuple(displs)


def displacements(counts):
    """Offsets of consecutive blocks with these counts."""
    displs, acc = [], 0
    for c in counts:
        displs.append(acc)
        acc += c
    return tuple(displs)

"""Which server holds which parameter: greedy largest-first by bytes, deterministic.

Every rank computes the same layout from the model alone (names, shapes, dtypes), so no
message is needed to agree on it. Tensors are never split: a server holds whole tensors,
and the heaviest server holds at most ``total/S + largest tensor`` bytes (Graham's bound
for largest-first list scheduling).
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardLayout:
    """``names[s]``: the parameter names server ``s`` holds, in the model's order."""

    names: tuple
    nbytes: tuple

    @property
    def num_servers(self):
        return len(self.names)

    def server_of(self, name):
        for s, names in enumerate(self.names):
            if name in names:
                return s
        raise KeyError(f"no server holds parameter {name!r}")


def shard_parameters(named_params, num_servers):
    """Assign each parameter to one of ``num_servers`` servers, balanced by bytes.

    ``named_params``: (name, array-or-Parameter) pairs in the model's stable order.
    Largest tensor first (ties: model order), each to the server with the fewest bytes so
    far (ties: lowest server index). A server may get no tensor when there are fewer
    tensors than servers; it then serves an empty shard.
    """
    if num_servers < 1:
        raise ValueError(f"need at least one server, got {num_servers}")
    items = []
    for order, (name, p) in enumerate(named_params):
        data = getattr(p, "data", p)
        nbytes = int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
        items.append((nbytes, order, name))
    load = [0] * num_servers
    owner = {}
    for nbytes, order, name in sorted(items, key=lambda t: (-t[0], t[1])):
        s = min(range(num_servers), key=lambda i: (load[i], i))
        owner[name] = s
        load[s] += nbytes
    names = tuple(tuple(n for _, _, n in items if owner[n] == s) for s in range(num_servers))
    return ShardLayout(names=names, nbytes=tuple(load))

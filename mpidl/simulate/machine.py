"""A machine description for the cost model: its links, its reductions, its compute.

``mpidl simulate --machine FILE`` reads one JSON object; ``mpidl simulate --calibrate``
writes one measured on the machine it runs on. Keys (seconds, bytes):

- ``alpha_intra``, ``beta_intra``: latency (s) and inverse bandwidth (s/byte) of a
  message between two ranks of one node; ``alpha_inter``, ``beta_inter``: between
  nodes (default: the intra-node values, i.e. one big node);
- ``gamma``: seconds per byte of a local reduction (``a + b`` into a buffer);
- ``ranks_per_node``: how many consecutive ranks share a node (block placement);
- ``cores_per_node`` (optional): CPU cores of a node. When a node has no spare core
  per rank (``cores_per_node < 2 x ranks_per_node``), the progress thread of an
  overlapped step runs on a core that computes: communication then takes time from
  backward instead of hiding under it (``mpidl.runtime.sync.fused.overlap_pays``);
- ``compute_cv``: the step-to-step spread of a rank's compute (standard deviation over
  mean). A synchronous step waits for the slowest of p ranks, ``compute_cv`` x compute x
  the expected largest of p standard normal draws longer than the mean;
- ``compute`` (optional): per model, what one sample costs in forward and backward,
  layer by layer (``{"mlp": {"batch_size": 64, "dtype": "float32", "layers": {"1":
  [forward_s, backward_s], ...}, "update_s": seconds per optimizer step}}``; layer keys
  are the model's top-level layers, as in parameter names ``1.weight``).

Every value is checked on reading: a bad file is one line naming the key and the file.
Command-line values (``--alpha-inter`` ...) override the file's.
"""

import json
import math
from dataclasses import asdict, dataclass, field

from mpidl.errors import ConfigError

LINK_KEYS = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma")

#: Without a file: shared memory on a typical CPU node (about 1 us, 10 GB/s), a
#: 100 Gbit/s network between nodes, reductions at 5 GB/s. Only a starting point:
#: calibrate (``mpidl simulate --calibrate``) or describe the machine.
DEFAULTS = {"alpha_intra": 1e-6, "beta_intra": 1e-10, "alpha_inter": 5e-6,
            "beta_inter": 8e-11, "gamma": 2e-10, "ranks_per_node": 1}


@dataclass
class Machine:
    alpha_intra: float = DEFAULTS["alpha_intra"]
    beta_intra: float = DEFAULTS["beta_intra"]
    alpha_inter: float = DEFAULTS["alpha_inter"]
    beta_inter: float = DEFAULTS["beta_inter"]
    gamma: float = DEFAULTS["gamma"]
    ranks_per_node: int = 1
    cores_per_node: int = 0  # 0: not known (a spare core per rank assumed)
    compute_cv: float = 0.0
    name: str = "default"
    compute: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def to_dict(self):
        return asdict(self)

    def spare_core(self, ranks_on_node):
        """Whether each rank of a node of ``ranks_on_node`` has a core for its progress
        thread (True when the cores are not known)."""
        return not self.cores_per_node or self.cores_per_node >= 2 * ranks_on_node

    def model_compute(self, model):
        """The measured compute of ``model`` (see the module doc), or None."""
        return self.compute.get(model)


def _number(value, key, where, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        need = "a positive number" if positive else "a number >= 0"
        raise ConfigError(f"{where}: {key} must be {need} (seconds or seconds per byte), "
                          f"got {value!r}")
    return float(value)


def from_dict(data, where):
    """A checked ``Machine`` from the JSON object ``data``; ``where`` names its source."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object of machine settings "
                          f"({', '.join(LINK_KEYS)}, ranks_per_node, compute)")
    known = set(LINK_KEYS) | {"ranks_per_node", "cores_per_node", "compute_cv", "name",
                              "compute", "info"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a machine file has "
                          f"{', '.join(sorted(known))}")
    m = Machine(name=str(data.get("name", where)))
    for key in ("alpha_intra", "beta_intra", "gamma"):
        if key in data:
            setattr(m, key, _number(data[key], key, where))
    # between nodes: the file's values, else the same link as inside a node
    m.alpha_inter = _number(data.get("alpha_inter", m.alpha_intra), "alpha_inter", where)
    m.beta_inter = _number(data.get("beta_inter", m.beta_intra), "beta_inter", where)
    per = data.get("ranks_per_node", 1)
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:
        raise ConfigError(f"{where}: ranks_per_node must be an integer >= 1, got {per!r}")
    m.ranks_per_node = per
    cores = data.get("cores_per_node", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise ConfigError(f"{where}: cores_per_node must be an integer >= 0 (0: not known), "
                          f"got {cores!r}")
    m.cores_per_node = cores
    m.compute_cv = _number(data.get("compute_cv", 0.0), "compute_cv", where)
    compute = data.get("compute", {})
    if not isinstance(compute, dict):
        raise ConfigError(f"{where}: compute must be an object {{model: measurements}}")
    for model, entry in compute.items():
        _check_compute(entry, f"{where}: compute[{model!r}]")
    m.compute = compute
    m.info = data.get("info", {}) if isinstance(data.get("info", {}), dict) else {}
    return m


def _check_compute(entry, where):
    if not isinstance(entry, dict) or not isinstance(entry.get("layers"), dict):
        raise ConfigError(f"{where}: expected {{\"batch_size\": B, \"layers\": {{layer: "
                          "[forward_s, backward_s], ...}, \"update_s\": s}}")
    for layer, times in entry["layers"].items():
        if not (isinstance(times, list) and len(times) == 2):
            raise ConfigError(f"{where}: layer {layer!r} must be [forward_s, backward_s] "
                              f"per sample, got {times!r}")
        for t in times:
            _number(t, f"layer {layer!r}", where)
    _number(entry.get("update_s", 0.0), "update_s", where)


def load(path):
    """The machine of file ``path`` (one clear line if it is missing or malformed)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--machine {path}: no such file (write one with mpidl simulate "
                          "--calibrate --machine FILE, or describe the machine: see "
                          "mpidl simulate --help)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--machine {path}: cannot read it ({e})") from None
    except ValueError as e:
        raise ConfigError(f"--machine {path}: not valid JSON ({e})") from None
    return from_dict(data, f"--machine {path}")


def save(machine, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(machine.to_dict(), f, indent=1)
        f.write("\n")

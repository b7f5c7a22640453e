"""Model averaging: local SGD, post-local SGD and DiLoCo (``--sync local-sgd|diloco``).

A gradient sync (``sync/``) makes the gradients agree before every update. Model
averaging lets every replica take its own optimizer steps on its own data and makes the
*parameters* agree every ``period`` (H) steps instead, so a step of training moves 1/H
of the bytes of all-reduce data parallelism. It is the fourth part of a step, after the
optimizer placement (``Runtime.finish_step`` calls ``after_update``).

With θ_i the parameters of rank i after H local steps, N ranks and θ_g the parameters
every rank started the period from (the anchor):

* **local SGD** (``--sync local-sgd --period H``): θ_g ← mean_i θ_i, every rank takes θ_g.
  Each rank's inner optimizer state (momentum, Adam moments) stays its own.
* **post-local SGD** (Lin et al., ICLR 2020; ``--warmup-steps W``): the first W steps are
  ordinary all-reduce data parallelism (the gradient syncs run, the optimizer applies the
  averaged gradient), then local SGD.
* **DiLoCo** (Douillard et al. 2023; ``--sync diloco --outer-lr η --outer-momentum μ``):
  the pseudo-gradient Δ = θ_g − mean_i θ_i is the gradient of an outer Nesterov-momentum
  SGD step: b ← μ b + Δ; θ_g ← θ_g − η (Δ + μ b). It is computed as
  θ_g ← mean_i θ_i + (1 − η) Δ − η μ b (the same expression rearranged, a term with a zero
  coefficient skipped), so η = 1, μ = 0 is local SGD bit for bit. The inner optimizer is
  whatever is configured (the paper: AdamW).

Identities (tested in float64): local SGD with H = 1 and SGD (any momentum, Nesterov,
weight decay) is all-reduce data parallelism, parameters within rounding: the mean of the
local momentum buffers follows the all-reduce's momentum recursion exactly (it is
linear), though each rank's own buffer differs; with Adam it is not (the moments are not
linear in the gradient). DiLoCo with η = 1, μ = 0 equals local SGD bitwise. Post-local SGD
before its switch is all-reduce bitwise (the same syncs run).

Communication: one all-reduce of the parameters every H steps, in the fused gradient
buckets' layout (``fusion.plan`` with the same ``--bucket-mb``) and with the same
``--algorithm``, so it moves exactly the bytes of one all-reduce step (the communicator's
counters show it). Every rank gets the same bits from the communicator's collectives, and
the outer step is computed from identical inputs on every rank, so the replicas are
bitwise equal after each averaging (``verify=True`` checks it with a digest exchange).

Evaluation sees the model a period boundary would produce now (the mean of the replicas,
or DiLoCo's outer step on the partial pseudo-gradient), without changing training: the
local parameters come back at the next step. Checkpoints hold the step count, the anchor
and the outer momentum, and every rank's own parameters and inner optimizer state, so a
resume in the middle of a period is bitwise exact.
"""

import math
import zlib

from mpidl.backend import array_module, to_device
from mpidl.errors import ConfigError
from mpidl.options import Option
from mpidl.runtime.fusion import MiB, plan

MODES = ("allreduce", "local-sgd", "diloco")
AVERAGING = ("local-sgd", "diloco")
DEFAULT_OUTER_LR = 0.7        # DiLoCo's
DEFAULT_OUTER_MOMENTUM = 0.9  # DiLoCo's (Nesterov)

OPTIONS = [
    Option("sync", str, None, "how the replicas of --strategy allreduce agree: allreduce "
           "(average the gradients every step; the default), local-sgd (each rank steps "
           "alone, the parameters are averaged every --period steps) or diloco (an outer "
           "Nesterov step on the averaged change every --period steps)", "parallelism",
           choices=(None,) + MODES),
    Option("period", int, None, "--sync local-sgd/diloco: average the replicas every H "
           "steps", "parallelism", metavar="H",
           check=lambda v: None if v >= 1 else "must be at least 1 (steps between "
           "averagings)"),
    Option("warmup_steps", int, None, "--sync local-sgd/diloco: run the first N steps as "
           "ordinary all-reduce data parallelism, then average every --period steps "
           "(post-local SGD); default 0", "parallelism", metavar="N",
           check=lambda v: None if v >= 0 else "must be at least 0"),
    Option("outer_lr", float, None, "--sync diloco: learning rate of the outer step on "
           f"the averaged pseudo-gradient (default {DEFAULT_OUTER_LR})", "parallelism",
           metavar="LR", check=lambda v: None if 0 < v < math.inf else
           "must be a positive number"),
    Option("outer_momentum", float, None, "--sync diloco: Nesterov momentum of the outer "
           f"step (default {DEFAULT_OUTER_MOMENTUM}; 0 turns it off)", "parallelism",
           metavar="M", check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
]
NAMES = frozenset(o.name for o in OPTIONS)


def _flag(name):
    return "--" + name.replace("_", "-")


def check_options(strategy, options):
    """ConfigError for a combination of the averaging settings that means nothing;
    ``options``: the settings given (not None). Local work, run for every preset."""
    sync = options.get("sync") or "allreduce"
    if sync not in MODES:
        raise ConfigError(f"--sync must be one of {', '.join(MODES)}, got {sync!r}")
    for name in ("period", "warmup_steps"):
        if name in options and sync not in AVERAGING:
            raise ConfigError(f"{_flag(name)} needs --sync local-sgd or --sync diloco "
                              f"(--sync is {sync})")
    for name in ("outer_lr", "outer_momentum"):
        if name in options and sync != "diloco":
            raise ConfigError(f"{_flag(name)} needs --sync diloco (--sync is {sync})")
    for name, ok, why in (("period", lambda v: v >= 1, "at least 1"),
                          ("warmup_steps", lambda v: v >= 0, "at least 0"),
                          ("outer_lr", lambda v: 0 < v < math.inf, "a positive number"),
                          ("outer_momentum", lambda v: 0 <= v < 1, "in [0, 1)")):
        v = options.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not ok(v)):
            raise ConfigError(f"{_flag(name)} must be {why}, got {v!r}")
    if sync not in AVERAGING:
        return
    if options.get("period") is None:
        raise ConfigError(f"--sync {sync} needs --period H (average the replicas every H "
                          "steps)")
    if strategy == "ps":
        raise ConfigError(f"--sync {sync} averages the replicas of --strategy allreduce; "
                          "the parameter server keeps one copy of the parameters (use "
                          "--strategy allreduce)")
    if options.get("compression"):
        raise ConfigError(f"--compression compresses gradients, which --sync {sync} does "
                          "not send after its warm-up; drop one of them")


def build_averaging(sync=None, period=None, warmup_steps=None, outer_lr=None,
                    outer_momentum=None, algorithm="auto", bucket_mb=4.0, verify=False):
    """The averaging part for ``--sync`` (None for plain all-reduce)."""
    if sync in (None, "allreduce"):
        return None
    common = dict(period=period, warmup_steps=warmup_steps or 0, algorithm=algorithm,
                  bucket_mb=bucket_mb, verify=verify)
    if sync == "local-sgd":
        return ModelAveraging(**common)
    return DiLoCo(outer_lr=DEFAULT_OUTER_LR if outer_lr is None else outer_lr,
                  outer_momentum=(DEFAULT_OUTER_MOMENTUM if outer_momentum is None
                                  else outer_momentum), **common)


class ModelAveraging:
    """Local SGD (post-local SGD with ``warmup_steps``): the module doc."""

    name = "local-sgd"

    def __init__(self, period, warmup_steps=0, algorithm="auto", bucket_mb=4.0,
                 verify=False):
        self.period = int(period)
        self.warmup_steps = int(warmup_steps)
        if self.period < 1 or self.warmup_steps < 0:
            raise ConfigError(f"period must be >= 1 and warm-up >= 0, got {period}, "
                              f"{warmup_steps}")
        self.algorithm = algorithm
        self.bucket_mb = float(bucket_mb)
        self.verify = bool(verify)
        self.step = 0             # steps done (of the whole run: checkpointed)
        self.averagings = 0       # averagings done (checkpointed)
        self.group = None
        self._stash = None        # this rank's own parameters while evaluation holds the mean
        self._wait = 0.0
        self.reset_stats()

    # -- set-up
    def setup(self, ctx):
        """Local: buckets laid out like the fused gradient buckets."""
        self.group = ctx.group
        self.optimizer = ctx.optimizer
        self.named = [(n, p) for n, p in ctx.named_params]
        self.size = 1 if self.group is None else self.group.size
        self.buckets = []
        for group in plan(self.named, int(self.bucket_mb * MiB)):
            first = group[0][1].data
            xp = array_module(first)
            buf = xp.zeros(sum(p.data.size for _, p in group), dtype=first.dtype)
            self.buckets.append((f"average{len(self.buckets)}", group, buf))
        self.nbytes = sum(b.nbytes for _, _, b in self.buckets)
        if self.local_phase:
            self._start_local()

    @property
    def local_phase(self):
        """True once the warm-up of all-reduce steps is over."""
        return self.step >= self.warmup_steps

    def gradients_synced(self):
        """Whether the coming step runs the gradient syncs (the warm-up)."""
        return not self.local_phase

    def _start_local(self):
        """The replicas are identical here (broadcast, or all-reduce steps)."""

    # -- a step
    def after_update(self):
        """After the optimizer placement stepped: average every ``period`` local steps.
        Returns the seconds spent communicating."""
        self.stats["steps"] += 1
        if self.step < self.warmup_steps:
            self.stats["synced"] += 1
        self.step += 1
        if self.step == self.warmup_steps:
            self._start_local()
            return 0.0
        if self.step < self.warmup_steps or (self.step - self.warmup_steps) % self.period:
            return 0.0
        self.averagings += 1
        self.stats["averagings"] += 1
        import time  # noqa: PLC0415

        t = time.perf_counter()
        self._combine(commit=True)
        wait = time.perf_counter() - t
        if self.verify:
            self.check_replicas()
        return wait

    def _mean(self):
        """Per bucket: (pairs, flat mean of the replicas' parameters), the same bits on
        every rank."""
        out = []
        for name, group, buf in self.buckets:
            xp = array_module(buf)
            offset = 0
            for _, p in group:
                n = p.data.size
                buf[offset:offset + n] = p.data.reshape(-1)
                offset += n
            if self.group is not None and self.size > 1:
                self.group.allreduce(buf, out=buf, op="sum", algorithm=self.algorithm,
                                     name=name)
                xp.multiply(buf, 1.0 / self.size, out=buf)
            out.append((group, buf))
        return out

    def _combine(self, commit):
        """Every rank's parameters become the combined model (module doc)."""
        for group, mean in self._mean():
            offset = 0
            for _, p in group:
                n = p.data.size
                p.data[...] = mean[offset:offset + n].reshape(p.data.shape)
                offset += n

    def check_replicas(self):
        """RuntimeError unless every rank holds the same bits (collective)."""
        if self.group is None or self.size == 1:
            return
        from mpidl.backend import to_numpy  # noqa: PLC0415

        crc = 0
        for _, p in self.named:
            crc = zlib.crc32(to_numpy(p.data).tobytes(), crc)
        crcs = self.group.mpi.allgather(crc)
        if len(set(crcs)) != 1:
            raise RuntimeError(f"{self.name}: after averaging {self.averagings} (step "
                               f"{self.step}) the replicas differ: parameter digests "
                               f"{crcs} by rank")

    # -- evaluation
    def since_average(self):
        """Local steps since the replicas last agreed."""
        if not self.local_phase:
            return 0
        return (self.step - self.warmup_steps) % self.period

    def prepare_eval(self):
        """Collective: the model becomes the one a period boundary would give now;
        ``restore`` (called at the next step, and by ``state_dict``) brings this rank's
        own parameters back."""
        if self._stash is not None or self.since_average() == 0:
            return
        self._stash = {n: p.data.copy() for n, p in self.named}
        self._combine(commit=False)

    def restore(self):
        if self._stash is None:
            return
        for n, p in self.named:
            p.data[...] = self._stash[n]
        self._stash = None

    # -- checkpoints
    def shared_state(self):
        """What every rank holds the same of (saved once)."""
        return {"type": self.name, "step": self.step, "averagings": self.averagings}

    def local_state(self, copy=True):
        """This rank's own parameters and inner optimizer state (they differ by rank in
        the middle of a period); ``copy=False``: the arrays themselves, for a caller that
        writes them before the next step (a checkpoint's rank shard)."""
        params = (dict(self._stash) if self._stash is not None
                  else {n: p.data.copy() if copy else p.data for n, p in self.named})
        return {"params": params, "optimizer": self.optimizer.state_dict(copy=copy)}

    def load_state(self, shared, local):
        if shared.get("type") != self.name:
            raise ConfigError(f"the checkpoint was written with --sync "
                              f"{shared.get('type')}, this run uses --sync {self.name}")
        self.step = int(shared["step"])
        self.averagings = int(shared["averagings"])
        self._stash = None
        if local is not None:
            for n, p in self.named:
                p.data[...] = to_device(local["params"][n], dtype=p.data.dtype)
            self.optimizer.load_state_dict(local["optimizer"])

    # -- reporting
    def reset_stats(self):
        self.stats = {"averagings": 0, "steps": 0, "synced": 0}

    def exchange_fraction(self):
        """Exchanges of the whole model (gradient all-reduces in the warm-up, and
        averagings) per step since the last ``metrics``."""
        st = self.stats
        return (st["synced"] + st["averagings"]) / max(st["steps"], 1)

    def metrics(self):
        out = {"averagings": self.stats["averagings"],
               "allreduce_steps": self.stats["synced"]}
        self.reset_stats()
        return out

    def describe(self):
        warm = (f" after {self.warmup_steps} all-reduce step(s) (post-local SGD)"
                if self.warmup_steps else "")
        return [f"{self.name}: parameters averaged every {self.period} step(s){warm}, "
                f"{len(self.buckets)} bucket(s), {self.nbytes / MiB:.2f} MiB, algorithm "
                f"{self.algorithm}"]


class DiLoCo(ModelAveraging):
    """DiLoCo: an outer Nesterov step on the averaged pseudo-gradient (module doc)."""

    name = "diloco"

    def __init__(self, period, outer_lr=DEFAULT_OUTER_LR,
                 outer_momentum=DEFAULT_OUTER_MOMENTUM, **kw):
        super().__init__(period, **kw)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        if not (0 < self.outer_lr < math.inf and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"diloco: outer lr must be > 0 and outer momentum in [0, 1), "
                              f"got {outer_lr}, {outer_momentum}")
        self.anchor = None        # θ_g per bucket: flat arrays
        self.momentum = None      # b per bucket

    def _start_local(self):
        self.anchor = []
        self.momentum = []
        for _, group, buf in self.buckets:
            xp = array_module(buf)
            a = xp.empty_like(buf)
            offset = 0
            for _, p in group:
                n = p.data.size
                a[offset:offset + n] = p.data.reshape(-1)
                offset += n
            self.anchor.append(a)
            self.momentum.append(xp.zeros_like(buf))

    def _combine(self, commit):
        lr, mu = self.outer_lr, self.outer_momentum
        for (group, mean), anchor, b in zip(self._mean(), self.anchor, self.momentum):
            xp = array_module(mean)
            delta = anchor - mean                     # Δ, the pseudo-gradient
            if not commit:
                b = b.copy()
            b *= mu
            b += delta                                # b ← μ b + Δ
            new = mean                                # θ_g − η (Δ + μ b), rearranged
            if lr != 1.0:
                new += (1.0 - lr) * delta
            if mu != 0.0:
                new -= (lr * mu) * b
            offset = 0
            for _, p in group:
                n = p.data.size
                p.data[...] = new[offset:offset + n].reshape(p.data.shape)
                offset += n
            if commit:
                xp.copyto(anchor, new)

    def shared_state(self):
        out = super().shared_state()
        out.update(outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                   anchor=None if self.anchor is None else [a.copy() for a in self.anchor],
                   momentum=None if self.momentum is None else [b.copy() for b in
                                                                 self.momentum])
        return out

    def load_state(self, shared, local):
        super().load_state(shared, local)
        if shared.get("anchor") is None:
            self.anchor = self.momentum = None
            return
        like = [buf for _, _, buf in self.buckets]
        self.anchor = [to_device(a, dtype=buf.dtype).copy()
                       for a, buf in zip(shared["anchor"], like)]
        self.momentum = [to_device(b, dtype=buf.dtype).copy()
                         for b, buf in zip(shared["momentum"], like)]

    def describe(self):
        return super().describe() + [f"outer step: Nesterov, lr {self.outer_lr:g}, momentum "
                                     f"{self.outer_momentum:g}"]

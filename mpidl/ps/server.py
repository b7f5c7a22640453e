"""The server side: holds a shard of the parameters and the optimizer, answers workers.

``ParameterServer.serve()`` runs until every worker has said it is done. It receives with
non-blocking probes and sleeps between them (see ``protocol.Poller``), decodes and checks
each push (shape, dtype, name, index range), hands it to the mode (``modes.py``) which
decides when to apply and when to answer, and counts every push as applied or dropped.
Answers go out with non-blocking sends of a snapshot of the parameters, so a slow worker
never holds the server up and later updates never change what was already sent.

A push that does not fit (wrong shape, dtype or name, a malformed compressed payload)
ends the job on every rank with one message naming the worker and the tensor:
the server tells every other rank (abort), waits until each has printed it (ack, with a
time limit), releases them (fin) and raises ``PSError`` itself.
"""

import copy
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from mpidl.comm import ANY_SOURCE

from mpidl.engine.module import SparseGrad
from mpidl.ps.protocol import (TAG_CTRL, TAG_DOWN, TAG_REPLY, TAG_UP, Poller, PSError,
                               params_header, receive, retire, send)


@dataclass
class Push:
    """One decoded gradient push: ``grads`` maps names to arrays or ``SparseGrad``."""

    worker: int
    clock: int
    version: int
    grads: dict
    lead: int = 0
    staleness: int = 0
    lr: float = None  # the worker's learning rate for this step (its schedule's value)
    row: list = None  # its row of the server's trace, when it keeps one
    portion: int = None  # --deal portions: which portion of the step's global batch
    portions: int = None  # ... of how many
    loss: float = None  # --deal portions: its term of the global batch's mean loss
    buffers: list = None  # receive buffers it holds while kept (server.keep)


@dataclass
class ServerStats:
    """What a server counted; ``pushed == applied + dropped`` when it ends."""

    server: int = 0
    rank: int = 0
    mode: str = "sync"
    pushed: int = 0
    applied: int = 0
    dropped: int = 0
    updates: int = 0
    pulls: int = 0
    pushes_by_worker: dict = field(default_factory=dict)
    dropped_by_worker: dict = field(default_factory=dict)
    max_lead: int = 0
    max_staleness: int = 0
    sum_staleness: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    idle_s: float = 0.0
    # (worker, clock, lead, staleness, applied, update): update is the version the push
    # was applied to (None when dropped)
    trace: list = field(default_factory=list)

    #: what a checkpoint keeps, so that a resumed run's counts go on from there
    CUMULATIVE = ("pushed", "applied", "dropped", "pulls", "pushes_by_worker",
                  "dropped_by_worker", "max_lead", "max_staleness", "sum_staleness",
                  "bytes_received", "bytes_sent")

    def counts(self):
        return {k: copy.copy(getattr(self, k)) for k in self.CUMULATIVE}

    def restore(self, counts):
        """Take a checkpoint's counts; per-worker ones only for the same worker ranks."""
        for k in self.CUMULATIVE:
            if k not in counts:
                continue
            v = counts[k]
            if isinstance(v, dict):
                v = {int(w): n for w, n in v.items()}
                if set(v) != set(getattr(self, k)):
                    continue
            setattr(self, k, v)

    def as_dict(self):
        d = dict(self.__dict__)
        d["mean_staleness"] = self.sum_staleness / self.pushed if self.pushed else 0.0
        return d


class ParameterServer:
    """Serve one shard of the parameters to the workers until all of them are done.

    ``params``: {name: Parameter} of this shard, in the model's order; ``optimizer``: an
    engine optimizer built over exactly these parameters (only servers hold optimizer
    state). ``comm``: the world's mpidl ``Communicator`` (its point-to-point calls).
    """

    def __init__(self, comm, index, params, optimizer, mode, workers, servers,
                 compressor=None, trace=False, poller=None, abort_grace=10.0):
        self.comm = comm
        self.index = index
        self.rank = comm.rank
        self.params = dict(params)
        self.names = list(self.params)
        self.optimizer = optimizer
        self.cfg = mode
        self.workers = list(workers)
        self.servers = list(servers)
        self.compressor = compressor
        self.trace = trace
        self.abort_grace = abort_grace
        self.poller = poller or Poller(comm, who=f"server {index}, rank {self.rank}")
        self.policy = mode.policy()
        self.version = 0
        self.active = set(self.workers)
        self.clock = {w: 0 for w in self.workers}
        self.sends = []
        self.at_barrier = set()
        self.state_wanted = set()  # workers that asked for the optimizer state at the barrier
        self._barrier_passed = False
        self.epoch_cut = False  # --epoch-quorum reached: answers tell workers to stop
        self._stats_sent = False
        self._snapshot = None
        self._recv_buffers = {}
        self._spare = {}  # (shape, dtype) -> receive buffers free again (see keep)
        self._sums = {}  # name -> persistent array for averaging a bucket
        self.on_update = None  # called after every update (benchmarks take snapshots)
        self.stats = ServerStats(server=index, rank=self.rank, mode=mode.mode,
                                 pushes_by_worker={w: 0 for w in self.workers},
                                 dropped_by_worker={w: 0 for w in self.workers})

    @property
    def num_workers(self):
        return len(self.workers)

    # -- the loop
    def serve(self, until="end"):
        """Answer pushes and pulls; returns ``ServerStats`` when every worker is done
        (``until="end"``) or also when every active worker reached the end-of-epoch
        barrier (``until="barrier"``)."""
        wall0, cpu0, idle0 = time.perf_counter(), time.process_time(), self.poller.idle_s
        self._barrier_passed = False
        while self.active and not (until == "barrier" and self._barrier_passed):
            source = self.poller.wait(ANY_SOURCE, TAG_CTRL, what="pushes from workers "
                                      f"{sorted(self.active)}", idle=self._idle,
                                      peers=sorted(self.active))
            header, arrays = receive(self.comm, source, TAG_CTRL, TAG_UP,
                                     into=self._into_buffer(source))
            self._handle(source, header, arrays)
        st = self.stats
        st.wall_s += time.perf_counter() - wall0
        st.cpu_s += time.process_time() - cpu0
        st.idle_s += self.poller.idle_s - idle0
        st.updates = self.version
        if not self.active and not self._stats_sent:
            self._stats_sent = True
            final = st.as_dict()
            for w in self.workers:
                self.sends += send(self.comm, w, TAG_REPLY, TAG_DOWN,
                                   {"kind": "stats", "stats": final})
        self.poller.wait_requests(self.sends)
        return st

    @property
    def finished(self):
        """True once every worker said it is done."""
        return not self.active

    def _into_buffer(self, source):
        """A push is received into buffers kept per (worker, array): no allocation per
        step. Safe to reuse: a worker pushes again only after its answer, and the answer
        comes after the push was applied or dropped, when nothing refers to it any more —
        except where a mode answers first and applies later (softsync, dealt portions),
        which calls ``keep(push)``: the worker's next push goes into other buffers, taken
        from those of pushes already applied (``_spare``) before any is allocated."""
        def into(header, i, shape, dtype):
            if header.get("kind") != "push":
                return None
            key = (source, i)
            buf = self._recv_buffers.get(key)
            if buf is None or buf.shape != shape or buf.dtype != dtype:
                spare = self._spare.get((shape, dtype.str))
                buf = spare.pop() if spare else np.empty(shape, dtype)
                self._recv_buffers[key] = buf
            return buf
        return into

    def _idle(self):
        retire(self.sends)

    def _handle(self, source, header, arrays):
        kind = header.get("kind")
        if kind == "push":
            self._on_push(source, header, arrays)
        elif kind == "deal":  # --deal portions: a worker asks the dealer for a portion
            self._check_worker(source, "deal")
            if not hasattr(self.policy, "on_deal"):
                self._fail(f"worker rank {source} asked for a portion, but this server does "
                           "not deal portions; give every rank the same --deal")
            done = header.get("done")
            self.policy.on_deal(self, source, int(header["version"]), int(header["portions"]),
                                None if done is None else int(done))
        elif kind == "pull":
            self.stats.pulls += 1
            self.reply(source)
        elif kind == "barrier":
            self._check_worker(source, "barrier")
            self.at_barrier.add(source)
            if header.get("state"):
                self.state_wanted.add(source)
            quorum = self.cfg.epoch_quorum
            if quorum and len(self.at_barrier) >= min(quorum, len(self.active)):
                self.epoch_cut = True
            self.policy.recheck(self)
            self._maybe_pass_barrier()
        elif kind == "done":
            self._check_worker(source, "done")
            self.active.discard(source)
            self.at_barrier.discard(source)
            self.policy.recheck(self)
            self._maybe_pass_barrier()
        elif kind == "abort":
            self._abort(header["message"], origin=source)
        else:
            self._fail(f"rank {source} sent an unknown message {kind!r} to the parameter "
                       f"server (rank {self.rank}); are all ranks running the same mpidl?")

    def _check_worker(self, source, what):
        if source not in self.active:
            who = "a server" if source in self.servers else (
                "a worker that already said it was done" if source in self.workers
                else "not a worker")
            self._fail(f"rank {source} sent '{what}' to the parameter server "
                       f"(rank {self.rank}) but is {who}")

    def _on_push(self, w, header, arrays):
        self._check_worker(w, "push")
        st = self.stats
        st.pushed += 1
        st.pushes_by_worker[w] += 1
        st.bytes_received += sum(a.nbytes for a in arrays)
        clock = int(header["clock"])
        if clock != self.clock[w]:
            self._fail(f"worker rank {w} pushed clock {clock}, but the server (rank "
                       f"{self.rank}) has {self.clock[w]} pushes from it")
        grads = self._decode(w, header, arrays)
        lead = clock - min(self.clock[j] for j in self.active)
        staleness = self.version - int(header["version"])
        self.clock[w] = clock + 1
        st.max_lead = max(st.max_lead, lead)
        st.max_staleness = max(st.max_staleness, staleness)
        st.sum_staleness += staleness
        push = Push(w, clock, int(header["version"]), grads, lead, staleness,
                    header.get("lr"), portion=header.get("portion"),
                    portions=header.get("portions"), loss=header.get("loss"))
        if self.trace:
            push.row = [w, clock, lead, staleness, 1, None]
            st.trace.append(push.row)
        self.policy.on_push(self, push)

    def _maybe_pass_barrier(self):
        """Everyone active waits at the barrier: all get the same (current) parameters."""
        if self.at_barrier and self.at_barrier >= self.active:
            waiting, self.at_barrier = sorted(self.at_barrier), set()
            self.epoch_cut = False
            self.stats.updates = self.version
            counts = {k: v for k, v in self.stats.as_dict().items() if k != "trace"}
            # exact: nothing is in flight now, so counts, parameters and optimizer state
            # all belong to the same moment
            wanting = [w for w in waiting if w in self.state_wanted]
            self.reply_many([w for w in waiting if w not in wanting], stats=counts)
            if wanting:
                self.reply_many(wanting, stats=counts, state=self.export_state())
            self.state_wanted = set()
            self._barrier_passed = True

    # -- decoding and checking
    def _decode(self, w, header, arrays):
        from mpidl.backend import to_device

        grads, pos = {}, 0
        for name, enc, meta, n in header["tensors"]:
            payload = arrays[pos:pos + n]
            pos += n
            p = self.params.get(name)
            where = f"worker rank {w} pushed gradient {name!r}"
            if p is None:
                held = ", ".join(self.names) or "nothing"
                self._fail(f"{where}, which server {self.index} (rank {self.rank}) does not "
                           f"hold (it holds: {held}); do all ranks build the same model?")
            if name in grads:
                self._fail(f"{where} twice in one push")
            want = (tuple(p.shape), np.dtype(p.dtype))
            try:
                if enc == "dense":
                    (g,) = payload
                    self._check(where, (g.shape, g.dtype), want)
                    g = to_device(g)
                elif enc == "sparse":
                    idx, vals = payload
                    self._check(where + " (sparse rows)", (vals.shape[1:], vals.dtype),
                                (want[0][1:], want[1]))
                    if idx.ndim != 1 or len(idx) != len(vals) or idx.dtype.kind not in "iu":
                        self._fail(f"{where}: {len(idx)} row indices ({idx.dtype}) for "
                                   f"{len(vals)} rows")
                    if len(idx) and (idx.min() < 0 or idx.max() >= want[0][0]):
                        self._fail(f"{where}: row index out of range [0, {want[0][0]})")
                    g = SparseGrad(to_device(idx), to_device(vals), want[0])
                elif enc == "compressed":
                    if self.compressor is None:
                        self._fail(f"{where} compressed, but the server has no compressor; "
                                   "give every rank the same --compression")
                    g = self.compressor.decompress([to_device(a) for a in payload], meta)
                    self._check(where + " (after decompression)",
                                (tuple(g.shape), np.dtype(g.dtype)), want)
                else:
                    self._fail(f"{where} with unknown encoding {enc!r}")
            except PSError:
                raise
            except Exception as e:  # a malformed payload: name it, end the job
                self._fail(f"{where}, which could not be decoded: {type(e).__name__}: {e}")
            grads[name] = g
        return grads

    def _check(self, where, got, want):
        shape, dtype = tuple(got[0]), np.dtype(got[1])
        if shape != tuple(want[0]) or dtype != want[1]:
            self._fail(f"{where} with shape {shape} and dtype {dtype}; the parameter has "
                       f"shape {tuple(want[0])} and dtype {want[1]}")

    # -- checkpoints
    def export_state(self):
        """What a checkpoint needs from this server: its shard's optimizer state (host
        arrays), its version and its counts."""
        from mpidl.backend import to_numpy

        opt = self.optimizer.state_dict()
        opt["state"] = {name: {k: (v if isinstance(v, int) else to_numpy(v))
                               for k, v in slots.items()}
                        for name, slots in opt["state"].items()}
        return {"version": self.version, "optimizer": opt, "counts": self.stats.counts()}

    def import_state(self, optimizer_state, version=0, counts=None):
        """Resume: take this shard's entries of a (merged) optimizer state, and this
        server's version and counts (when the checkpoint has as many servers)."""
        mine = dict(optimizer_state, state={n: v for n, v in optimizer_state["state"].items()
                                            if n in self.params})
        self.optimizer.load_state_dict(mine)
        self.version = int(version)
        if counts:
            self.stats.restore(counts)

    # -- what modes call
    def pushing(self):
        """Workers that may still push before the barrier (active, not waiting at it)."""
        return self.active - self.at_barrier

    def slowest_clock(self):
        return min((self.clock[j] for j in self.active), default=None)

    def lr_scale_for(self, push):
        if self.cfg.staleness_aware_lr:
            return 1.0 / max(1, push.staleness)
        return 1.0

    def keep(self, push):
        """``push`` stays unapplied after its worker is answered: its arrays must not be
        reused for that worker's next push (``_into_buffer``) until it is applied."""
        keys = [k for k in self._recv_buffers if k[0] == push.worker]
        push.buffers = [self._recv_buffers.pop(k) for k in keys]

    def drop(self, push):
        self.stats.dropped += 1
        self.stats.dropped_by_worker[push.worker] += 1
        if push.row is not None:
            push.row[4] = 0

    def apply(self, pushes, lr_scale=1.0, weights=None):
        """One optimizer step from the mean of ``pushes`` (summed in worker order, then
        clock order), each push's gradient times its entry of ``weights`` if given."""
        weights = [1.0] * len(pushes) if weights is None else list(weights)
        order = sorted(range(len(pushes)), key=lambda i: (pushes[i].worker, pushes[i].clock))
        pushes, weights = [pushes[i] for i in order], [weights[i] for i in order]
        grads = {}
        for name in self.names:
            parts = [(p.grads[name], w) for p, w in zip(pushes, weights) if name in p.grads]
            if parts:
                grads[name] = _mean([g for g, _ in parts], len(pushes), self._sums, name,
                                    weights=[w for _, w in parts])
        self.apply_gradients(pushes, grads, lr_scale)

    def apply_gradients(self, pushes, grads, lr_scale=1.0):
        """One optimizer step from ``grads`` ({name: gradient}), made from ``pushes``
        (counted as applied; the lr is the last one's)."""
        present = [name for name in self.names if name in grads]
        for name in present:
            self.params[name].grad = grads[name]
        lr = pushes[-1].lr
        if lr is not None and hasattr(self.optimizer, "lr"):
            self.optimizer.lr = lr  # the workers run the schedule; the server follows it
        if present:
            with _scaled_lr(self.optimizer, lr_scale, [self.params[k] for k in present]):
                self.optimizer.step(names=present)
        for name in present:
            self.params[name].grad = None
        for p in pushes:
            if p.row is not None:
                p.row[5] = self.version
            self.release(p)
        self.version += 1
        self.stats.applied += len(pushes)
        if self.on_update is not None:
            self.on_update(self)

    def release(self, push):
        """A kept push's receive buffers serve later pushes (its gradients are used up)."""
        for buf in push.buffers or ():
            self._spare.setdefault((buf.shape, buf.dtype.str), []).append(buf)
        push.buffers = None

    def start_sum(self, name, g):
        """A copy of gradient ``g`` to sum into (this server's array for ``name``)."""
        return start_sum(self._sums, name, g)

    def reply(self, worker):
        self.reply_many([worker])

    def deal(self, worker, portion):
        """--deal portions: tell ``worker`` which portion of this step to compute."""
        self.sends += send(self.comm, worker, TAG_REPLY, TAG_DOWN,
                           {"kind": "dealt", "portion": int(portion), "version": self.version})

    def reply_many(self, workers, **extra):
        from mpidl.backend import to_numpy

        if self._snapshot is None or self._snapshot[0] != self.version:
            arrays = [np.array(to_numpy(self.params[n].data), copy=True) for n in self.names]
            self._snapshot = (self.version, arrays)
        arrays = self._snapshot[1]
        header = params_header(self.version, self.names, self.epoch_cut, **extra)
        for w in workers:
            self.sends += send(self.comm, w, TAG_REPLY, TAG_DOWN, header, arrays)
            self.stats.bytes_sent += sum(a.nbytes for a in arrays)

    # -- ending on an error
    def _fail(self, message):
        self._abort(f"parameter server {self.index} (rank {self.rank}): {message}",
                    origin=None)

    def _abort(self, message, origin):
        """Make every rank print ``message``, then raise ``PSError`` (see module doc)."""
        sys.stderr.write(f"mpidl ps [rank {self.rank}]: error: {message}\n")
        sys.stderr.flush()
        comm, grace = self.comm, self.abort_grace
        others = [r for r in self.workers + self.servers if r != self.rank]
        if origin is None:
            sends = []
            for r in others:
                tag = TAG_REPLY if r in self.workers else TAG_CTRL
                data = TAG_DOWN if r in self.workers else TAG_UP
                sends += send(comm, r, tag, data, {"kind": "abort", "message": message})
            waiting, deadline = set(others), time.monotonic() + grace
            while waiting and time.monotonic() < deadline:
                source = self.poller.wait(ANY_SOURCE, TAG_CTRL, timeout=deadline - time.monotonic())
                if source is None:
                    break
                header, _ = receive(comm, source, TAG_CTRL, TAG_UP)
                if header.get("kind") == "ack":  # pushes still in flight are drained
                    waiting.discard(source)
            for r in others:
                if r not in waiting:
                    tag = TAG_REPLY if r in self.workers else TAG_CTRL
                    data = TAG_DOWN if r in self.workers else TAG_UP
                    sends += send(comm, r, tag, data, {"kind": "fin"})
            self.poller.wait_requests(sends, timeout=grace)
        else:
            self.poller.wait_requests(send(comm, origin, TAG_CTRL, TAG_UP, {"kind": "ack"}),
                                      timeout=grace)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:  # drain pushes until the origin says fin
                source = self.poller.wait(ANY_SOURCE, TAG_CTRL, timeout=deadline - time.monotonic())
                if source is None:
                    break
                header, _ = receive(comm, source, TAG_CTRL, TAG_UP)
                if header.get("kind") == "fin" and source == origin:
                    break
        raise PSError(message)


def _mean(parts, n, sums=None, name=None, weights=None):
    """Sum ``parts`` in order and divide by ``n`` (dense; row-sparse parts, when all are,
    are concatenated in order and multiplied by 1/n);
    ``weights``: one factor per part (a part of weight 1 is used as it is).

    ``sums[name]``, when given, is reused as the dense result's storage."""
    if weights is not None and any(w != 1.0 for w in weights):
        parts = [_scaled(g, w) for g, w in zip(parts, weights)]
    if n == 1 and len(parts) == 1:
        return parts[0]
    if all(isinstance(g, SparseGrad) for g in parts):
        from mpidl.backend import array_module

        xp = array_module(parts[0].values)
        idx = xp.concatenate([g.indices for g in parts])
        vals = xp.concatenate([g.values for g in parts])
        if n > 1:  # times 1/n, as the all-gather of data parallelism scales the same rows
            vals *= vals.dtype.type(1.0 / n)
        return SparseGrad(idx, vals, parts[0].shape)
    total = None
    for g in parts:
        g = g.to_dense() if isinstance(g, SparseGrad) else g
        if total is None:
            total = g.copy() if sums is None else start_sum(sums, name, g)
        else:
            total += g
    if n > 1:
        total /= total.dtype.type(n)
    return total


def start_sum(sums, name, g):
    """A copy of ``g`` to sum into, in ``sums[name]`` (reused while it fits ``g``)."""
    keep = sums.get(name)
    if keep is not None and type(keep) is type(g) and keep.shape == g.shape \
            and keep.dtype == g.dtype:
        keep[...] = g
        return keep
    keep = sums[name] = g.copy()
    return keep


def _scaled(g, w):
    """``w * g`` for a dense or row-sparse gradient (a new array; ``g`` is kept)."""
    if w == 1.0:
        return g
    if isinstance(g, SparseGrad):
        return SparseGrad(g.indices, g.values * g.values.dtype.type(w), g.shape)
    return g * g.dtype.type(w)


class _scaled_lr:
    """Scale the optimizer's learning rate for one step (staleness-aware lr)."""

    def __init__(self, optimizer, scale, params):
        self.opt, self.scale, self.params = optimizer, scale, params
        self.saved = None

    def __enter__(self):
        if self.scale == 1.0:
            return
        if hasattr(self.opt, "lr"):
            self.saved = self.opt.lr
            self.opt.lr = self.saved * self.scale
        else:  # no settable lr: scaling the gradient is the same for plain SGD
            for p in self.params:
                p.grad = _scaled(p.grad, self.scale)

    def __exit__(self, *exc):
        if self.saved is not None:
            self.opt.lr = self.saved

"""When the server applies a gradient and when it answers the worker that pushed it.

A mode sees two events — a push (already decoded and checked), and a change in who is
still pushing (a worker ended, or reached the end-of-epoch barrier) — and acts through
three server calls: ``apply(pushes)`` (one optimizer
step from the average of those pushes), ``reply(worker)`` (send the current parameters,
which lets that worker compute its next step) and ``drop(push)``.

Clocks: a worker's clock is the number of gradients it has pushed to this server, so a
worker computing step ``t`` is "at clock t". A push carries its clock ``t`` and the
server's version (number of updates applied) of the parameters it was computed from.

- sync: version ``v`` is answered when every active worker pushed a gradient computed
  from version ``v``: their average is applied (summed in worker-rank order, so the
  result does not depend on arrival order), then all of them get version ``v + 1``.
- backup (``wait=k``): the same with a quorum of the first ``k`` pushes of version ``v``;
  a push computed from an older version arrives late and is dropped, and its worker is
  answered at once with the current parameters.
- async (Downpour): each push is applied on arrival and its worker answered at once.
- ssp (``staleness=s``): applied on arrival like async, but the answer to a push of
  clock ``t`` waits until the slowest active worker has reached clock ``t + 1 - s``, so
  no worker starts step ``t + 1`` more than ``s`` clocks ahead of the slowest.
- softsync (``wait=c``; n-softsync of Zhang et al., IJCAI 2016, with n = workers / c):
  each push is answered at once with the current parameters, so no worker ever waits
  for another; every ``c`` pushes, whatever their versions, make one update from their
  staleness-weighted mean ``(1/c) sum_l w(tau_l) g_l``, where ``tau_l`` is the number of
  updates between the version a gradient was computed from and the one it is applied to,
  and ``w(tau) = 1/tau`` for ``tau >= 1``, ``w(0) = 1`` (``staleness_weight``). With
  ``c = workers`` (the default, 1-softsync) the mean staleness is about 1; with ``c = 1``
  it is async with each gradient scaled by ``w``. When every worker still pushing waits
  at the epoch barrier (or has ended), a partial group is applied as the mean of its
  pushes.
- sync with dealt portions (``deal=True``, ``--deal portions``): every worker holds the
  same global batch, cut into P portions; the first server (the dealer) hands out portion
  indices on request, in order, to whichever worker asks; each server keeps the portions
  of its shard as they come and, once it has all P, applies their sum in portion order
  (each is already scaled by its share of the batch), so the update does not depend on
  who computed what (the sum runs while the portions come in, each added once all lower
  ones are in). When no portion is left undealt, a worker that asks gets a backup copy of
  a portion still out that was dealt before the one it just finished, so is overdue
  (each at most once; the first copy to arrive counts, the other is dropped); otherwise
  it waits for the update, which every worker gets.
"""

from dataclasses import dataclass

MODES = ("sync", "async", "ssp", "backup", "softsync")


@dataclass(frozen=True)
class ModeConfig:
    """The training mode and its knobs, checked once for every rank."""

    mode: str = "sync"
    staleness: int = 0          # ssp: the bound s
    wait: int = 0               # backup: gradients used per step (0: all but one);
                                # softsync: gradients per update (0: all workers)
    staleness_aware_lr: bool = False  # async/ssp: lr / max(1, staleness of the gradient)
    epoch_quorum: int = 0       # async/ssp/backup: workers whose finish ends the epoch (0: all)
    deal: bool = False          # sync: portions of a global batch dealt on demand

    def check(self, num_workers):
        from mpidl.errors import ConfigError

        if self.mode not in MODES:
            raise ConfigError(f"unknown parameter-server mode {self.mode!r}: expected one "
                              f"of {', '.join(MODES)}")
        if self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")
        if self.mode == "backup":
            k = self.quorum(num_workers)
            if not 1 <= k <= num_workers:
                raise ConfigError(f"--wait {self.wait}: backup mode uses the first k of "
                                  f"{num_workers} workers' gradients, so 1 <= k <= "
                                  f"{num_workers}")
        if self.mode == "softsync" and not 1 <= self.quorum(num_workers) <= num_workers:
            raise ConfigError(f"--wait {self.wait}: softsync makes each update from c "
                              f"gradients of the {num_workers} workers, so 1 <= c <= "
                              f"{num_workers}")
        if self.epoch_quorum:
            if self.mode == "sync":
                raise ConfigError("--epoch-quorum applies to --mode async, ssp or backup: in "
                                  "sync mode every worker computes every step, so no epoch "
                                  "can end without the slowest")
            if not 1 <= self.epoch_quorum <= num_workers:
                raise ConfigError(f"--epoch-quorum {self.epoch_quorum}: the epoch ends once "
                                  f"K of the {num_workers} workers are done, so 1 <= K <= "
                                  f"{num_workers}")
        if self.deal and self.mode != "sync":
            raise ConfigError(f"--deal portions keeps synchronous semantics (one update "
                              f"from the whole global batch): use it with --mode sync, not "
                              f"--mode {self.mode}")
        if self.staleness_aware_lr and self.mode not in ("async", "ssp"):
            raise ConfigError("--staleness-aware-lr applies to --mode async or ssp only "
                              f"(got --mode {self.mode})")
        return self

    def quorum(self, num_workers):
        if self.mode == "backup":
            return self.wait if self.wait > 0 else max(1, num_workers - 1)
        if self.mode == "softsync" and self.wait > 0:
            return self.wait
        return num_workers

    def policy(self):
        if self.deal:
            return DealMode(self)
        return {"sync": QuorumMode, "backup": QuorumMode, "async": AsyncMode,
                "ssp": SSPMode, "softsync": SoftsyncMode}[self.mode](self)


def staleness_weight(tau):
    """softsync's weight of a gradient of staleness ``tau``: 1/tau, and 1 for a fresh one."""
    return 1.0 / max(1, tau)


class QuorumMode:
    """sync and backup: one update per version from a quorum of fresh gradients."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.bucket = []  # fresh pushes of the current version, in arrival order

    def on_push(self, srv, push):
        if push.version != srv.version:
            srv.drop(push)           # computed from an older version: too late
            srv.reply(push.worker)
            return
        self.bucket.append(push)
        self._maybe_apply(srv)

    def recheck(self, srv):
        self._maybe_apply(srv)

    def _maybe_apply(self, srv):
        # workers that ended or wait at the epoch barrier push nothing more: don't wait
        need = min(self.cfg.quorum(srv.num_workers), len(srv.pushing()))
        if self.bucket and len(self.bucket) >= need:
            bucket, self.bucket = self.bucket, []
            srv.apply(bucket)
            srv.reply_many([p.worker for p in bucket])


class AsyncMode:
    """Downpour: apply each push on arrival, answer its worker at once."""

    def __init__(self, cfg):
        self.cfg = cfg

    def on_push(self, srv, push):
        srv.apply([push], lr_scale=srv.lr_scale_for(push))
        srv.reply(push.worker)

    def recheck(self, srv):
        pass


class SSPMode:
    """Stale synchronous parallel: apply on arrival, hold answers that would run ahead."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.held = {}  # worker -> clock of its unanswered push

    def on_push(self, srv, push):
        srv.apply([push], lr_scale=srv.lr_scale_for(push))
        self.held[push.worker] = push.clock
        self._release(srv)

    def recheck(self, srv):
        self._release(srv)

    def _release(self, srv):
        slowest = srv.slowest_clock()
        for w, t in sorted(self.held.items()):
            # once the epoch is cut, an answer only tells the worker to stop: no step follows
            if slowest is None or srv.epoch_cut or t + 1 - slowest <= self.cfg.staleness:
                del self.held[w]
                srv.reply(w)


class SoftsyncMode:
    """n-softsync: answer every push at once; each c pushes make one weighted update."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.group = []  # pushes not applied yet, in arrival order

    def on_push(self, srv, push):
        self.group.append(push)
        if len(self.group) >= self.cfg.quorum(srv.num_workers):
            self._apply(srv)
        else:
            srv.keep(push)  # answered now, applied later
        srv.reply(push.worker)  # (after the update when this push completed the group)

    def recheck(self, srv):
        # nobody left to fill the group before the barrier: apply what there is
        if self.group and not srv.pushing():
            self._apply(srv)

    def _apply(self, srv):
        group, self.group = self.group, []
        srv.apply(group, weights=[staleness_weight(p.staleness) for p in group])


class DealMode:
    """sync with portions dealt on demand (``--deal portions``; module doc)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._new_step()

    def _new_step(self):
        self.total = None       # portions in this step's global batch (the workers say)
        self.got = {}           # portion -> its push, this version
        self.undealt = 0        # the next portion never dealt (the dealer's count)
        self.backed_up = set()  # portions already dealt twice
        self.arriving = set()   # portions whose worker said it is pushing them
        self.summed = 0         # portions 0 .. summed-1 are in ``sums``
        self.sums = {}          # name -> their running sum (dense), or parts (row-sparse)

    def on_deal(self, srv, worker, version, total, done=None):
        if version != srv.version:
            return  # asked before an update it has not read yet: its answer is the update
        self._count(srv, worker, total)
        if done is not None and done not in self.got:
            self.arriving.add(done)
        if self.undealt < self.total:
            portion = self.undealt
            self.undealt += 1
        else:
            # a backup copy of a portion dealt before the one this worker is pushing
            # (dealt in order, so: a lower index), which is therefore overdue
            out = [k for k in range(min(self.total, done or 0)) if k not in self.got
                   and k not in self.arriving and k not in self.backed_up]
            if not out:
                return  # nothing to do: the update will come
            portion = out[0]
            self.backed_up.add(portion)
        srv.deal(worker, portion)

    def on_push(self, srv, push):
        if push.version != srv.version or push.portion in self.got:
            srv.drop(push)  # a backup copy's loser (or the original's), after or before
            return
        self._count(srv, push.worker, push.portions)
        if not 0 <= int(push.portion) < self.total:
            srv._fail(f"worker rank {push.worker} pushed portion {push.portion}, but this "
                      f"step has {self.total} portions")
        self.got[push.portion] = push
        self.arriving.discard(push.portion)
        srv.keep(push)
        self._add_in_order(srv)
        if self.summed == self.total:
            from mpidl.ps.server import _mean  # noqa: PLC0415

            pushes = [self.got[k] for k in range(self.total)]
            grads = {name: (_mean(g, 1) if isinstance(g, list) else g)
                     for name, g in self.sums.items()}
            self._new_step()
            self.complete(srv, pushes, grads)

    def complete(self, srv, pushes, grads):
        """Every portion is in (``pushes`` in portion order, ``grads`` their sum): apply
        it and send every worker the update (L-BFGS's mode does otherwise)."""
        srv.apply_gradients(pushes, grads)
        srv.reply_many(sorted(srv.active))

    def _add_in_order(self, srv):
        """Add every portion whose predecessors are all in, in portion order, while the
        others are still computed: the same sum, in the same order, as at the end."""
        from mpidl.engine.module import SparseGrad  # noqa: PLC0415

        while self.summed in self.got:
            push = self.got[self.summed]
            rows = False
            for name, g in push.grads.items():
                if isinstance(g, SparseGrad) or isinstance(self.sums.get(name), list):
                    self.sums.setdefault(name, []).append(g)  # concatenated at the end
                    rows = True
                elif name in self.sums:
                    self.sums[name] += g
                else:
                    self.sums[name] = srv.start_sum(name, g)
            if not rows:  # (row-sparse parts keep their buffers until the update)
                srv.release(push)
            self.summed += 1

    def recheck(self, srv):
        pass  # every worker takes part in every step: nobody stops in the middle of one

    def _count(self, srv, worker, total):
        if self.total is None:
            self.total = int(total)
        elif int(total) != self.total:
            srv._fail(f"worker rank {worker} says this step has {total} portions, another "
                      f"said {self.total}; do all ranks run the same --batch-size and "
                      "--portion-size?")

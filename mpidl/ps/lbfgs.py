"""Sandblaster L-BFGS on the parameter servers (``--strategy ps --optimizer lbfgs``).

After Dean et al. (NIPS 2012): the servers are shards that hold the parameters *and*
the L-BFGS vectors of their tensors (``mpidl.engine.lbfgs.ShardVectors``: the accepted
point, its gradient, the direction, the correction pairs); a coordinator decides every
step from dot products and never holds a vector; the workers compute the full-batch
gradient in portions dealt to whichever of them is free (``mpidl.runtime.dealing``),
summed on each shard in portion order (``LbfgsDealMode``, the dealing mode of
``modes.DealMode`` with its own end of an evaluation).

The coordinator (``Lbfgs``) runs on server 0, beside its shard and the dealer: the dealer
already sees every portion arrive, with the portion's term of the loss in its header, so
the loss needs no message; and a rank of its own would idle while the workers compute.
Its own shard answers by calls; the other shards by messages on the servers' group
(``role_group``), whose traffic is nothing but this exchange, so that group's counters
are the coordinator's bytes exactly. Every message there is a float64 array:

    coordinator -> shard, tag ``TAG_OP``: [code, arguments]
        TRIAL [stp]            x = stp d + t: the next point to evaluate
        ACCEPT [stp, updated]  the point tried is accepted (with a new pair s, y if
                               ``updated``); answered with the accepted point's report
        RESTART []             back to the accepted point, memory dropped
        DIRECTION [c...]       d = sum c_j b_j over (s.., y.., g); answered g.d, d.d
        STOP [restore]         the end (restore: back to the accepted point)
    shard -> coordinator, tag ``TAG_REPORT``: one row of values per tensor of the shard,
        flat (after each evaluation: g_t.d; the starting point: its accepted report)

After an evaluation every shard sends its report and then carries out operations until
TRIAL or STOP; only then does it answer the workers with the new point (or the final
one). So every shard, and every worker, goes through the same evaluations, in the same
order, and the line search's decisions are made once (PyTorch's L-BFGS under DDP hangs
because each rank decides for itself and they run different numbers of evaluations).
"""

import numpy as np

from mpidl.ps.modes import DealMode
from mpidl.ps.protocol import PSError

TAG_OP = 7311
TAG_REPORT = 7312

TRIAL, ACCEPT, RESTART, DIRECTION, STOP = 1, 2, 3, 4, 5  # the operations' codes


def _flat(rows):
    """A shard's rows (one per tensor, all one length) as one float64 message."""
    if not rows:
        return np.zeros(0, dtype=np.float64)
    return np.ascontiguousarray(np.stack(rows), dtype=np.float64).reshape(-1)


def _receive(group, poller, source, tag, what):
    """The next float64 message from ``source`` (its length read from the probe)."""
    poller.wait(source, tag, what=what)
    _, _, nbytes = group.iprobe(source, tag)
    out = np.empty(nbytes // 8, dtype=np.float64)
    group.recv(out, source, tag)
    return out


class RemoteShards:
    """The coordinator's view of the shards (``Lbfgs``'s ``shards``): its own shard's
    vectors answer by calls, the others by messages on ``group`` (the servers' group,
    shard ``s`` at group rank ``s``). ``names[s]``: the tensors shard ``s`` holds."""

    def __init__(self, group, vectors, names, poller):
        self.group, self.vectors, self.poller = group, vectors, poller
        self.names = [list(n) for n in names]
        if list(vectors.names) != self.names[0]:
            raise ValueError("the coordinator's shard must hold shard 0's tensors")

    def _send(self, code, *args):
        msg = np.array([code, *args], dtype=np.float64)
        for s in range(1, len(self.names)):
            self.group.send(msg, s, TAG_OP)

    def _gather(self, own):
        out = dict(zip(self.names[0], own))
        for s in range(1, len(self.names)):
            flat = _receive(self.group, self.poller, s, TAG_REPORT,
                            f"L-BFGS report of shard {s}")
            tensors = self.names[s]
            if tensors:
                if flat.size % len(tensors):
                    raise PSError(f"L-BFGS: shard {s} reported {flat.size} values for "
                                  f"{len(tensors)} tensors")
                out.update(zip(tensors, flat.reshape(len(tensors), -1)))
        return out

    def report(self):
        return self._gather(self.vectors.report())

    def trial(self, stp):
        self._send(TRIAL, stp)
        self.vectors.trial(stp)

    def accept(self, stp, updated):
        self._send(ACCEPT, stp, 1.0 if updated else 0.0)
        return self._gather(self.vectors.accept(stp, updated))

    def restart(self):
        self._send(RESTART)
        self.vectors.restart()

    def direction(self, coeffs):
        self._send(DIRECTION, *coeffs)
        return self._gather(self.vectors.direction(coeffs))

    def stop(self, restore):
        self._send(STOP, 1.0 if restore else 0.0)
        self.vectors.stop(restore)


class ShardFollower:
    """A shard other than the coordinator's: after each evaluation it reports, then
    carries out the coordinator's operations until TRIAL or STOP."""

    def __init__(self, group, vectors, poller):
        self.group, self.vectors, self.poller = group, vectors, poller

    def after_evaluation(self):
        """True when another evaluation follows (TRIAL), False at STOP."""
        v = self.vectors
        self.group.send(_flat(v.report()), 0, TAG_REPORT)
        while True:
            msg = _receive(self.group, self.poller, 0, TAG_OP,
                           "the L-BFGS coordinator's next operation")
            code, args = int(msg[0]), msg[1:]
            if code == TRIAL:
                v.trial(float(args[0]))
                return True
            if code == STOP:
                v.stop(bool(args[0]))
                return False
            if code == ACCEPT:
                self.group.send(_flat(v.accept(float(args[0]), bool(args[1]))), 0,
                                TAG_REPORT)
            elif code == RESTART:
                v.restart()
            elif code == DIRECTION:
                self.group.send(_flat(v.direction([float(c) for c in args])), 0,
                                TAG_REPORT)
            else:
                raise PSError(f"L-BFGS: unknown operation {code} from the coordinator")


class LbfgsDealMode(DealMode):
    """Dealt portions where a complete set is one evaluation of L-BFGS, not an update.

    ``vectors``: this shard's ``ShardVectors``; on server 0 ``coordinator`` (an
    ``Lbfgs`` over ``RemoteShards``), elsewhere ``follower`` (a ``ShardFollower``).
    Once every portion is in, the shard takes their sum as the gradient at the point
    tried, the coordinator's exchange runs, and every worker gets the next point with
    ``lbfgs``: ``{"done": bool, "records": [...]}`` in the answer's header (the records
    of the iterations completed since the last answer; server 0's answer only)."""

    def __init__(self, cfg, vectors, coordinator=None, follower=None):
        super().__init__(cfg)
        self.vectors, self.coordinator, self.follower = vectors, coordinator, follower
        self.evaluations = 0
        self.deals = 0  # portions dealt, backup copies included
        self.records = []
        if coordinator is not None:
            coordinator.on_iteration = self.records.append

    def on_deal(self, srv, worker, version, total, done=None):
        before = self.undealt + len(self.backed_up)
        super().on_deal(srv, worker, version, total, done)
        self.deals += self.undealt + len(self.backed_up) - before

    def complete(self, srv, pushes, grads):
        self.vectors.take_gradient(grads)
        self.evaluations += 1
        if self.coordinator is not None:
            f = 0.0
            for p in pushes:  # in portion order
                if p.loss is None:
                    srv._fail(f"worker rank {p.worker} pushed portion {p.portion} without "
                              "its loss; give every rank the same --optimizer")
                f += float(p.loss)
            more = self.coordinator.evaluated(f)
            info = {"done": not more, "records": self.records[:]}
            del self.records[:]
        else:
            info = {"done": not self.follower.after_evaluation()}
        srv.apply_gradients(pushes, {})  # counted and released; the version moves on
        srv.reply_many(sorted(srv.active), lbfgs=info)


def exchange_size(records, tensors):
    """(bytes, messages) the coordinator and the shards exchange for a run that ended at
    its iteration limit, from its iteration records and ``tensors[s]``, the tensors
    shard ``s`` holds (the README's formula). Per shard but the coordinator's, holding
    T tensors: the starting point's report (3T values); per iteration with k0 pairs
    before it, k after, e evaluations, a new pair (u = 1) or not and r failed line
    searches: DIRECTION (2 k0 + 2 values) and its report (2T), per evaluation TRIAL (2)
    and its report (T), ACCEPT (3) and its report (T (3 + 2k + u (3k - 2))), per
    failed search RESTART (1), DIRECTION (2) and its report (2T); then STOP (2). All
    float64: 8 bytes a value. O(m T) values per iteration, whatever the model's size."""
    values = messages = 0
    for t in tensors[1:]:
        values += 3 * t + 2
        messages += 2
        for before, rec in zip(records, records[1:]):
            k0, k, e, r = before["pairs"], rec["pairs"], rec["evaluations"], rec["restarts"]
            u = 3 * k - 2 if rec["updated"] else 0
            values += 2 * k0 + 2 + 2 * t + e * (2 + t) + 3 + t * (3 + 2 * k + u)
            values += r * (3 + 2 * t)
            messages += 4 + 2 * e + 3 * r
    return 8 * values, messages

"""The worker side: pushes gradients, pulls parameters, never holds optimizer state.

A step on a worker is: compute gradients (the trainer), ``push()`` — send each server
the gradients of its shard (dense, row-sparse for Embedding, or compressed), then wait
for every server's answer and copy the parameters it sends into the model — and on to
the next step. When and what a server answers is the mode's business (``modes.py``);
the worker only waits, without spinning (``protocol.Poller``).

Straggler injection (``straggler=F``): before each push the worker sleeps ``(F - 1)``
times the compute time it measured for that step, so its steps take ``F`` times as long.
"""

import sys
import time

from mpidl.comm import ANY_SOURCE

from mpidl.engine.module import SparseGrad
from mpidl.ps.protocol import (TAG_CTRL, TAG_DOWN, TAG_REPLY, TAG_UP, Poller, PSError,
                               fits, push_header, receive, retire, send)


class PSWorker:
    """Talks to the servers for one worker rank.

    ``params``: the model's (name, Parameter) pairs; ``layout``: ``ShardLayout``;
    ``servers``: the server ranks, index ``s`` holding ``layout.names[s]``.
    ``compressor``/``memory``: optional gradient compression and error feedback.
    """

    def __init__(self, comm, params, layout, servers, compressor=None, memory=None,
                 straggler=1.0, poller=None, abort_grace=10.0):
        self.comm = comm
        self.rank = comm.rank
        self.params = dict(params)
        self.layout = layout
        self.servers = list(servers)
        self.compressor, self.memory = compressor, memory
        self.straggler = float(straggler)
        self.abort_grace = abort_grace
        self.poller = poller or Poller(comm, who=f"worker rank {self.rank}")
        self.versions = {r: 0 for r in self.servers}
        self.clock = 0
        self.epoch_over = False
        self.sends = []
        self.server_stats = None
        self.barrier_stats = None
        self.server_states = None
        self.last_params = {}  # server rank -> the header of its last parameters
        self.stats = {"pushes": 0, "messages": 0, "bytes_sent": 0, "bytes_received": 0,
                      "compute_s": 0.0, "straggle_s": 0.0, "wait_s": 0.0, "pulls": 0}
        self._compute_start = time.perf_counter()

    def begin_step(self):
        """Mark the start of a step's computation (for straggler injection)."""
        self._compute_start = time.perf_counter()

    # -- pushing
    def push(self, lr=None):
        """Push this step's gradients to every server and take the parameters it answers.

        ``lr``: this step's learning rate (the trainer's schedule); the server uses it.
        """
        self.send_push(lr)
        self.take_answer()

    def send_push(self, lr=None):
        """The first half of ``push``: start sending the gradients (non-blocking), so the
        caller can do other work (Parallax: the dense all-reduce) before ``take_answer``."""
        compute = time.perf_counter() - self._compute_start
        self.stats["compute_s"] += compute
        if self.straggler > 1.0:
            t = time.perf_counter()
            time.sleep((self.straggler - 1.0) * compute)
            self.stats["straggle_s"] += time.perf_counter() - t
        self._send_gradients(lr)

    def take_answer(self):
        """The second half of ``push``: wait for every server's answer, take the
        parameters."""
        replies = self._await("params")
        # --epoch-quorum: enough workers finished the epoch; this one skips the rest
        self.epoch_over = any(h.get("epoch_over") for h, _ in replies.values())
        self._take_params(replies)
        self.begin_step()

    # -- dealt portions (--deal portions)
    def deal(self, portions):
        """At a step's start: ask the dealer (the first server) for a portion of this
        step's global batch of ``portions``; returns its index, or None when none is left
        for this worker (then the step's update has been taken, as ``push`` takes it)."""
        self.ask(portions)
        return self._next_portion()

    def ask(self, portions, done=None):
        """Ask the dealer for a portion. ``done``: the portion this worker is about to
        push (the dealer backs up only portions dealt before it, and never that one)."""
        dealer = self.servers[0]
        self.sends += send(self.comm, dealer, TAG_CTRL, TAG_UP,
                           {"kind": "deal", "version": self.versions[dealer],
                            "portions": int(portions), "done": done})

    def push_portion(self, portion, portions, lr=None, loss=None):
        """Push the gradients of ``portion`` (already scaled by its share of the batch) to
        every server and ask the dealer for another: its index, or None (then the update
        has been taken, as ``deal``). The request goes first, so the dealer answers it
        before it receives the push. ``loss``: the portion's term of the batch's mean
        loss (a float in the header; L-BFGS's coordinator adds them up)."""
        self.ask(portions, done=int(portion))
        self._send_gradients(lr, portion=int(portion), portions=int(portions),
                             loss=None if loss is None else float(loss))
        return self._next_portion()

    def _next_portion(self):
        """The dealer's answer: another portion, or the update (then every server's)."""
        dealer = self.servers[0]
        first = self._await(("dealt", "params"), [dealer])
        header = first[dealer][0]
        if header["kind"] == "dealt":
            # finish sending the last portion before computing the next: a large message
            # moves only while both sides are in MPI calls, and the server would wait in
            # its receive, dealing nothing, while this worker computes
            t0 = time.perf_counter()
            self.poller.wait_requests(self.sends)
            self.sends = []
            self.stats["wait_s"] += time.perf_counter() - t0
            return int(header["portion"])
        rest = self._await("params", self.servers[1:]) if len(self.servers) > 1 else {}
        self._take_params({**first, **rest})
        return None

    def _send_gradients(self, lr, **extra):
        """Start sending each server its shard's gradients (one push, this clock)."""
        for s, server in enumerate(self.servers):
            tensors, arrays = [], []
            for name in self.layout.names[s]:
                g = self.params[name].grad
                if g is None:
                    continue
                enc, meta, payload = self._encode(name, g)
                tensors.append((name, enc, meta, len(payload)))
                arrays += payload
            header = push_header(self.clock, self.versions[server], lr, tensors, **extra)
            self.sends += send(self.comm, server, TAG_CTRL, TAG_UP, header, arrays)
            self.stats["bytes_sent"] += sum(int(a.nbytes) for a in arrays)
            self.stats["messages"] += 1
        self.stats["pushes"] += 1
        self.clock += 1

    def _encode(self, name, g):
        if isinstance(g, SparseGrad):  # Embedding: only the touched rows travel
            return "sparse", None, [g.indices, g.values]
        if self.compressor is None:
            return "dense", None, [g]
        if self.memory is not None:  # error feedback: compensate, compress, update
            payload, ctx = self.memory.compress(self.compressor, g, name)
        else:
            payload, ctx = self.compressor.compress(g, name)
        return "compressed", ctx, list(payload)

    # -- pulling
    def pull(self):
        """Fetch the current parameters from every server (no clock change)."""
        for server in self.servers:
            self.sends += send(self.comm, server, TAG_CTRL, TAG_UP, {"kind": "pull"})
        self.stats["pulls"] += 1
        self._take_params(self._await("params"))
        self.begin_step()

    def barrier(self, want_state=False):
        """End of epoch: wait until every active worker got here, then take the current
        parameters — the same ones on every worker, whatever the mode. ``want_state``:
        the servers also send their optimizer state of that moment (``server_states``)."""
        for server in self.servers:
            self.sends += send(self.comm, server, TAG_CTRL, TAG_UP,
                               {"kind": "barrier", "state": bool(want_state)})
        replies = self._await("params")
        self.epoch_over = False
        self.barrier_stats = [replies[r][0].get("stats") for r in self.servers]
        self.server_states = ([replies[r][0].get("state") for r in self.servers]
                              if want_state else None)
        self._take_params(replies)
        self.begin_step()

    def _take_params(self, replies):
        from mpidl.backend import to_device

        for server, (header, arrays) in replies.items():
            self.versions[server] = header["version"]
            self.last_params[server] = header
            for name, a in zip(header["names"], arrays):
                p = self.params[name]
                if a is not p.data:  # (received in place otherwise)
                    p.data[...] = to_device(a, dtype=p.data.dtype)
                self.stats["bytes_received"] += int(a.nbytes)

    # -- ending
    def finish(self):
        """Tell every server we are done; wait for their final counts (the end is agreed
        when every server has heard every worker); returns the servers' stats."""
        for server in self.servers:
            self.sends += send(self.comm, server, TAG_CTRL, TAG_UP,
                               {"kind": "done", "pushed": self.stats["pushes"]})
        replies = self._await("stats")
        self.poller.wait_requests(self.sends)
        self.server_stats = [replies[r][0]["stats"] for r in self.servers]
        return self.server_stats

    # -- waiting
    def _await(self, kind, servers=None):
        """One ``kind`` answer (or one of the kinds, a tuple) from every server, or from
        each of ``servers`` in turn (the others' messages stay queued: a dealt portion is
        computed from the parameters of before the update, so an update from another
        server must not be taken before the dealer says the step is over); an abort from
        a server we wait for ends us."""
        t0 = time.perf_counter()
        kinds = (kind,) if isinstance(kind, str) else tuple(kind)
        pending, got = set(self.servers if servers is None else servers), {}
        while pending:
            source = ANY_SOURCE if servers is None else min(pending)
            src = self.poller.wait(source, TAG_REPLY, idle=self._idle,
                                   what=f"'{' or '.join(kinds)}' from server ranks "
                                   f"{sorted(pending)}",
                                   peers=sorted(pending))
            header, arrays = receive(self.comm, src, TAG_REPLY, TAG_DOWN,
                                     into=self._into_params)
            if header.get("kind") == "abort":
                self._abort(src, header["message"])
            if header.get("kind") not in kinds or src not in pending:
                raise PSError(f"worker rank {self.rank}: expected '{kinds[0]}' from server "
                              f"ranks {sorted(pending)}, got '{header.get('kind')}' from "
                              f"rank {src}")
            got[src] = (header, arrays)
            pending.discard(src)
        self.stats["wait_s"] += time.perf_counter() - t0
        return got

    def _into_params(self, header, i, shape, dtype):
        """Parameters arrive straight into the model's arrays when they fit (CPU)."""
        if header.get("kind") != "params":
            return None
        p = self.params.get(header["names"][i])
        return p.data if p is not None and fits(p.data, shape, dtype) else None

    def _idle(self):
        retire(self.sends)

    def _abort(self, origin, message):
        """Print the server's message, acknowledge, wait for its fin, then raise."""
        sys.stderr.write(f"mpidl ps [rank {self.rank}]: error: {message}\n")
        sys.stderr.flush()
        self.poller.wait_requests(send(self.comm, origin, TAG_CTRL, TAG_UP, {"kind": "ack"}),
                                  timeout=self.abort_grace)
        deadline = time.monotonic() + self.abort_grace
        while time.monotonic() < deadline:
            source = self.poller.wait(origin, TAG_REPLY, timeout=deadline - time.monotonic())
            if source is None:
                break
            header, _ = receive(self.comm, origin, TAG_REPLY, TAG_DOWN)
            if header.get("kind") == "fin":
                break
        raise PSError(message)

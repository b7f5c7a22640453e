"""Messages between actors, replay shards, learners: pickled dicts on two tags.

Every message is a small dict with a ``kind`` (float64 arrays inside are pickled, which
keeps their bits). Requests travel on ``TAG_REQ`` (actor -> shard/learner, learner ->
shard), answers on ``TAG_REP``, Gorila's lockstep "go" on ``TAG_GO``. MPI keeps the order
of messages between one pair of ranks, which the lockstep schedule relies on.

    actor   -> learner  pull {returns, frames}         -> params {version, arrays}
    actor   -> shard    insert {actor, seq, batch, priorities}
    actor   -> *        done {returns, frames}
    learner -> shard    totals {update}                 -> totals {total, size, inserted}
                        sample {update, prefixes}       -> sample {slots, values, batch}
                        prio {update, slots, priorities}
                        round_end {round} (lockstep)    stop {} -> stats {...}
    learner -> actor    go {round} (Gorila lockstep: pull from the servers now)

Sends are non-blocking (``isend_obj``), retired while waiting; waits sleep between probes
(``mpidl.ps.protocol.Poller``), so an idle rank leaves the core to the busy ones, and the
stall inspector names whom a rank waits for.
"""

from mpidl.ps.protocol import Poller, retire

TAG_REQ = 7401
TAG_REP = 7402
TAG_GO = 7403


class Mailbox:
    def __init__(self, comm, who):
        self.comm = comm
        self.poller = Poller(comm, who=who)
        self.sends = []

    def send(self, dest, tag, **msg):
        self.sends.append(self.comm.isend_obj(msg, dest, tag))

    def recv(self, source, tag, what, poller=None):
        """Wait for and receive one message; returns ``(msg, source)``. ``poller``: one
        with other naps than the mailbox's (``mpidl.ps.protocol.Poller``)."""
        src = (poller or self.poller).wait(source, tag, what=what, idle=self.idle)
        msg, src, _ = self.comm.recv_obj(src, tag)
        return msg, src

    def poll(self, source, tag):
        """A waiting message ``(msg, source)`` or None, without blocking."""
        found = self.comm.iprobe(source, tag)
        if found is None:
            return None
        msg, src, _ = self.comm.recv_obj(found[0], tag)
        return msg, src

    def idle(self):
        retire(self.sends)

    def flush(self):
        self.poller.wait_requests(self.sends)
        self.sends = []

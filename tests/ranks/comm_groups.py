"""Process groups of a Mesh, on real ranks: collectives, point-to-point, counters, threads.

Launched by tests/test_comm_groups.py as ``mpiexec -n N python -m mpi4py comm_groups.py
--dp D --tp T [--order ...] [--roles server=2] [--sections ...] [--grid small|full]``.

Sections:
  layout       every rank's coordinates and group members against the arithmetic of the
               layout (innermost axis fastest); roles exclude their ranks from the axes
  equivalence  on every axis group: the collectives x algorithms grid of
               comm_equivalence.py (its helpers bound to the group, so "native" is MPI's
               collective on the SAME group); ``--grid full`` runs its whole grid
  concurrent   both axes at once: non-blocking collectives of every kind and algorithm
               issued on axis A, blocking ones run on axis B, then A's waited (and the
               other way round)
  p2p          on every group: a ring of sendrecv, isend/irecv with tags, ANY_SOURCE
               receives, objects, iprobe, non-contiguous arrays, two groups at once, and
               the staged (pinned-staging) transport
  counters     per-group counters equal the exact messages and bytes each algorithm
               must send; groups do not see each other's traffic
  linear       a toy algorithm registered from a test module runs through
               Communicator.allreduce against native, on every group
  threads      progress threads start lazily, one per group that uses non-blocking
               collectives
  errors       bad mesh sizes raise one clear line on every rank

Failures are collected and printed by world rank 0 ("GROUPS OK" otherwise).
"""

import argparse
import os
import pickle
import threading
import time

import numpy as np
from mpi4py import MPI

import comm_equivalence as ce
import linear_algorithm
from mpidl.comm import ANY_SOURCE, ANY_TAG, Communicator, Mesh, algorithms, even_split
from mpidl.comm.recursive_doubling import plan

W = MPI.COMM_WORLD
WRANK, WSIZE = W.Get_rank(), W.Get_size()
REF = W.Dup()  # failures gathering
ALGS = ce.ALGS
failures = ce.failures


def expect(cond, what):
    if not cond:
        failures.append(f"world rank {WRANK}: {what}")


# ---------------------------------------------------------------------------- helpers
class Groups:
    """The mesh's groups with a native reference communicator for each."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.axes = list(mesh.order)
        self.comm = {a: mesh.group(a) for a in self.axes}
        self.raw = {a: (g.mpi.Dup() if g is not None else None) for a, g in self.comm.items()}

    def on(self, axis):
        """Bind comm_equivalence's helpers to ``axis``; returns its Communicator (None on
        ranks without that axis, which bind nothing)."""
        if self.raw[axis] is None:
            return None
        ce.bind(self.raw[axis])
        return self.comm[axis]

    def close(self):
        for r in self.raw.values():
            if r is not None:
                r.Free()


def tagged(label, fn, *args):
    """Run ``fn``; prefix the failures it adds with ``label`` (which group)."""
    before = len(failures)
    fn(*args)
    for i in range(before, len(failures)):
        failures[i] = f"[{label}] {failures[i]}"


# ---------------------------------------------------------------------------- sections
def section_layout(mesh):
    n_roles = sum(mesh.roles.values())
    if mesh.role != "trainer":
        lo = 0
        for role, count in mesh.roles.items():
            if lo <= WRANK < lo + count:
                expect(mesh.role == role, f"role {mesh.role} != {role}")
                expect(mesh.ranks(role) == tuple(range(lo, lo + count)),
                       f"role group {mesh.ranks(role)}")
            lo += count
        for axis in mesh.order:
            expect(mesh.group(axis) is None and mesh.coord(axis) is None,
                   f"a {mesh.role} rank has axis {axis}")
        return
    expect(WRANK >= n_roles, "trainer among the role ranks")
    sizes = [mesh.size(a) for a in mesh.order]
    t = WRANK - n_roles
    coords = {}
    for axis, size in zip(reversed(mesh.order), reversed(sizes)):
        coords[axis] = t % size
        t //= size
    for axis in mesh.order:
        g = mesh.group(axis)
        expect(mesh.coord(axis) == coords[axis] == g.rank,
               f"{axis}: coord {mesh.coord(axis)} rank {g.rank}, expected {coords[axis]}")
        expect(g.size == mesh.size(axis), f"{axis}: group size {g.size}")
        # members: vary this axis, keep the others
        members = []
        for c in range(mesh.size(axis)):
            idx = 0
            for a, size in zip(mesh.order, sizes):
                idx = idx * size + (c if a == axis else coords[a])
            members.append(idx + n_roles)
        expect(mesh.ranks(axis) == tuple(members),
               f"{axis}: members {mesh.ranks(axis)}, expected {members}")
    inner = mesh.order[-1]
    expect(list(mesh.ranks(inner)) == list(range(mesh.ranks(inner)[0],
                                                 mesh.ranks(inner)[0] + mesh.size(inner))),
           f"innermost axis {inner} is not consecutive ranks: {mesh.ranks(inner)}")
    if mesh.roles:
        expect(mesh.group("trainer").size == WSIZE - n_roles, "trainer group size")


def small_grid(comm, seed0):
    """Every collective x algorithm (blocking) on a few counts and dtypes of ``comm``."""
    p, seed = ce.P, seed0
    comm.segment_bytes = 256
    for n in (0, 1, 7 * p + 3):
        for dtype in (np.float32, np.int64, np.float16):
            for alg in ALGS:
                seed += 1
                ce.case_allreduce(comm, seed, n, dtype, "sum", alg, "inplace")
                ce.case_allreduce(comm, seed, n, dtype, "sum", alg, "new")
                ce.case_reduce_scatter(comm, seed, n, dtype, "sum", alg)
                ce.case_reduce(comm, seed, n, dtype, "sum", alg, root=p - 1, inplace=True)
                ce.case_bcast(comm, seed, n, dtype, alg, root=p // 2)
                ce.case_allgather(comm, seed, n, dtype, alg, with_out=True)
                ce.case_allgatherv(comm, seed, n % 4, dtype, alg)
    for alg in ALGS:
        seed += 1
        ce.case_allreduce(comm, seed, 5 * p + 1, np.float64, "mean", alg, "out",
                          noncontig=True)
        ce.case_reduce_scatter(comm, seed, 5 * p + 1, np.float32, "max", alg, noncontig=True)
    comm.segment_bytes = 1 << 20


def section_equivalence(groups, full):
    for i, axis in enumerate(groups.axes):
        comm = groups.on(axis)
        if comm is None:
            continue
        if full:
            tagged(axis, ce.section_grid, comm)
            tagged(axis, ce.section_nonblocking, comm)
        else:
            tagged(axis, small_grid, comm, 50_000 + 1000 * i)


def issue_all(comm, seed):
    """Issue a non-blocking collective of every kind x algorithm on ``comm`` (bound);
    returns [(label, handle, reference, tolerance)] (references computed before)."""
    p, rank = ce.P, ce.RANK
    n = 7 * p + 3
    jobs = []
    for alg in ALGS:
        seed += 1
        x = ce.data(seed, n, np.float32).copy()
        ref = ce.native_allreduce(x, "sum")
        tol = ce.tolerance(seed, n, np.float32, "sum")
        c, d = even_split(n, p)
        mine = slice(d[rank], d[rank] + c[rank])
        allg = np.concatenate([ce.data(seed, n, np.float32, rank=r) for r in range(p)])
        vx = ce.data(seed, rank + 1, np.int32)
        vref = np.concatenate([ce.data(seed, r + 1, np.int32, rank=r) for r in range(p)])
        bref = ce.data(seed, n, np.float32, rank=p - 1)
        jobs += [
            (f"iallreduce {alg}", comm.iallreduce(x, algorithm=alg, name=f"c{alg}"), ref, tol),
            (f"ireduce_scatter {alg}", comm.ireduce_scatter(x, algorithm=alg,
                                                            name=f"rs{alg}"),
             ref[mine], tol if np.isscalar(tol) else tol[mine]),
            (f"ireduce {alg}", comm.ireduce(x, root=0, algorithm=alg, name=f"r{alg}"),
             ref if rank == 0 else None, tol),
            (f"ibcast {alg}", comm.ibcast(x.copy() if rank == p - 1 else np.zeros(n, np.float32),
                                          root=p - 1, algorithm=alg, name=f"b{alg}"), bref, 0),
            (f"iallgather {alg}", comm.iallgather(x, algorithm=alg, name=f"g{alg}"), allg, 0),
            (f"iallgatherv {alg}", comm.iallgatherv(vx, algorithm=alg, name=f"v{alg}"),
             vref, 0),
        ]
    return jobs


def finish_all(jobs):
    for label, h, ref, tol in jobs:
        got = h.wait()
        if label.startswith("iallgatherv"):
            got = got[0]
        if ref is None:
            expect(got is None, f"{label}: non-root got a result")
            continue
        ce.compare(label, got, ref, tol)


def section_concurrent(groups):
    busy = [a for a in groups.axes if groups.comm[a] is not None and groups.comm[a].size > 1]
    for a in busy:
        for b in busy:
            if a == b:
                continue
            ca = groups.on(a)
            jobs = issue_all(ca, 60_000)
            cb = groups.on(b)  # blocking collectives on B while A's run on its thread
            tagged(f"{b} while {a} runs", small_grid, cb, 61_000)
            ce.bind(groups.raw[a])
            tagged(f"{a} (non-blocking, beside {b})", finish_all, jobs)


def p2p_checks(comm, label, seed):
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    rng_of = lambda who, n: np.random.default_rng([seed, who]).standard_normal(n)  # noqa: E731
    n = 1000 + seed % 7
    # ring of sendrecv (2-D array, any shape travels as its flat elements)
    got = comm.sendrecv(rng_of(r, n).reshape(-1, 1), right, np.empty((n, 1)), left,
                        sendtag=3)
    expect(np.array_equal(got.ravel(), rng_of(left, n)), f"{label}: sendrecv ring")
    # isend/irecv with two tags, received in the other order
    reqs = [comm.irecv(np.empty(n), left, tag=12), comm.irecv(np.empty(5, np.int32), left,
                                                              tag=11),
            comm.irecv(np.empty(3, np.int16), left, tag=ANY_TAG)]  # matches tag 13 only
    sends = [comm.isend(np.arange(5, dtype=np.int32) + r, right, tag=11),
             comm.isend(rng_of(r, n) * 2, right, tag=12),
             comm.isend(np.full(3, r, np.int16), right, tag=13)]
    anytag = reqs[2].wait()
    expect(np.all(anytag == left) and reqs[2].tag == 13, f"{label}: ANY_TAG irecv")
    big, small = reqs[0].wait(), reqs[1].wait()
    for s in sends:
        s.wait()
    expect(np.array_equal(big, rng_of(left, n) * 2), f"{label}: irecv tag 12")
    expect(np.array_equal(small, np.arange(5, dtype=np.int32) + left),
           f"{label}: irecv tag 11")
    expect(reqs[0].source == left and reqs[0].tag == 12, f"{label}: request status")
    # everyone to group rank 0, received with ANY_SOURCE (status says who)
    if r == 0:
        seen = set()
        for _ in range(p - 1):
            st = MPI.Status()
            buf = comm.recv(np.empty(n), ANY_SOURCE, tag=21, status=st)
            src = st.Get_source()
            seen.add(src)
            expect(np.array_equal(buf, rng_of(src, n)), f"{label}: ANY_SOURCE from {src}")
        expect(seen == set(range(1, p)), f"{label}: ANY_SOURCE saw {sorted(seen)}")
    else:
        comm.send(rng_of(r, n), 0, tag=21)
    # non-contiguous send and receive
    base = np.zeros((n, 2))
    comm.sendrecv(rng_of(r, n)[::-1][::-1].reshape(n, 1)[:, 0][::1], right, base[:, 1],
                  left, sendtag=4)
    expect(np.array_equal(base[:, 1], rng_of(left, n)) and not base[:, 0].any(),
           f"{label}: non-contiguous recv")
    # objects: to the right, received from anyone with any tag; probe first
    hdr = {"from": r, "step": seed, "shape": (n,)}
    req = comm.isend_obj(hdr, right, tag=30 + r % 3)
    info = comm.probe(ANY_SOURCE, ANY_TAG)
    expect(info[0] == left and info[1] == 30 + left % 3 and
           info[2] == len(pickle.dumps({"from": left, "step": seed, "shape": (n,)},
                                       protocol=pickle.HIGHEST_PROTOCOL)),
           f"{label}: probe {info}")
    obj, src, tag = comm.recv_obj()
    req.wait()
    expect(obj == {"from": left, "step": seed, "shape": (n,)} and src == left
           and tag == 30 + left % 3, f"{label}: recv_obj {obj} {src} {tag}")
    expect(comm.iprobe(ANY_SOURCE, 99) is None, f"{label}: iprobe found a stray message")
    if r % 2 == 0 or p == 1:  # blocking sends in a ring: even ranks send first
        req = comm.isend_obj(("plain", r), right, tag=1) if p == 1 else None
        if p > 1:
            comm.send_obj(("plain", r), right, tag=1)
        obj, src, tag = comm.recv_obj(left, 1)
        if req is not None:
            req.wait()
    else:
        obj, src, tag = comm.recv_obj(left, 1)
        comm.send_obj(("plain", r), right, tag=1)
    expect(obj == ("plain", left), f"{label}: send_obj/recv_obj")


def section_p2p(groups, mesh):
    named = [(a, groups.comm[a]) for a in groups.axes] + [("world", mesh.world)]
    if mesh.roles:
        named.append((mesh.role, mesh.group(mesh.role)))
    for i, (label, comm) in enumerate(named):
        if comm is not None:
            p2p_checks(comm, label, 70_000 + i)
    # two groups at once: receives posted on A, a ring finished on B, then A's waited
    busy = [a for a in groups.axes if groups.comm[a] is not None and groups.comm[a].size > 1]
    if len(busy) >= 2:
        a, b = groups.comm[busy[0]], groups.comm[busy[1]]
        ra = a.irecv(np.empty(64), (a.rank - 1) % a.size, tag=5)
        sa = a.isend(np.full(64, float(a.rank)), (a.rank + 1) % a.size, tag=5)
        p2p_checks(b, f"{busy[1]} beside {busy[0]}", 71_000)
        expect(np.all(ra.wait() == (a.rank - 1) % a.size), "p2p on two groups at once")
        sa.wait()
    # the staged transport (GPU arrays without CUDA-aware MPI), driven with host arrays
    staged_world = Communicator(_staging="host", label="staged")
    staged = Mesh(staged_world, dp=mesh.size("dp"), pp=mesh.size("pp"), tp=mesh.size("tp"),
                  order=mesh.order, roles=mesh.roles)
    for i, axis in enumerate(staged.order):
        g = staged.group(axis)
        if g is not None:
            p2p_checks(g, f"staged {axis}", 72_000 + i)
    staged.close()
    staged_world.close()


def tree_messages(p, rank):
    """Messages rank sends in tree allreduce (reduce to 0, then bcast from 0)."""
    v, sent, mask = rank, 0, 1
    while mask < p:  # reduce: one send to the parent, then done
        if v & mask:
            sent += 1
            break
        mask <<= 1
    low = v & -v if v else p
    mask = 1
    while mask < p:  # bcast: one send per child v + mask, mask < lowbit(v)
        if mask < low and v + mask < p:
            sent += 1
        mask <<= 1
    return sent


def section_counters(groups, mesh):
    for axis in groups.axes:
        comm = groups.comm[axis]
        if comm is None:
            continue
        p, r = comm.size, comm.rank
        others = [g for g in [mesh.world, *groups.comm.values()] if g is not None
                  and g is not comm]
        before = [g.counters() for g in others]
        for n, dtype in ((7 * p + 3, np.float32), (8 * p, np.float64)):
            item = np.dtype(dtype).itemsize
            c, _ = even_split(n, p)
            x = np.ones(n, dtype)
            nbytes = n * item
            cases = [
                ("ring", "allreduce", lambda a: comm.allreduce(x, algorithm=a),
                 2 * (p - 1), item * (2 * n - c[r] - c[(r + 1) % p])),
                ("ring", "allreduce", lambda a: comm.iallreduce(x, algorithm=a).wait(),
                 2 * (p - 1), item * (2 * n - c[r] - c[(r + 1) % p])),
                ("tree", "allreduce", lambda a: comm.allreduce(x, algorithm=a),
                 tree_messages(p, r), tree_messages(p, r) * nbytes),
            ]
            role, _, partners, _, _ = plan(r, p)
            rd = {"out": 1, "odd": len(partners) + 1, "plain": len(partners)}[role]
            cases += [
                ("recursive_doubling", "allreduce", lambda a: comm.allreduce(x, algorithm=a),
                 rd, rd * nbytes),
                ("mpi", "allreduce", lambda a: comm.allreduce(x, algorithm=a), 0, 0),
                ("ring", "reduce_scatter", lambda a: comm.reduce_scatter(x, algorithm=a),
                 p - 1, item * (n - c[r])),
                ("ring", "allgather", lambda a: comm.allgather(x, algorithm=a),
                 p - 1, (p - 1) * nbytes),
            ]
            for alg, kind, call, msgs, nb in cases:
                comm.reset_counters()
                call(alg)
                got = comm.counters()
                want = {"calls": 1, "messages": msgs, "bytes": nb,
                        "native_calls": int(alg == "mpi" and p > 1)}
                if p == 1:
                    want.update(messages=0, bytes=0, native_calls=0)
                expect(got[kind] == want, f"counters {axis} p={p} {alg} {kind} n={n} "
                       f"{np.dtype(dtype).name}: {got[kind]} != {want}")
                expect(got["total"] == want, f"counters {axis} total {got['total']}")
                if alg == "ring" and kind == "allreduce" and n % p == 0:
                    expect(nb == 2 * (p - 1) * nbytes // p, "ring allreduce bytes formula")
        # point to point: a sendrecv ring, then an object
        comm.reset_counters()
        x = np.arange(10, dtype=np.int64)
        comm.sendrecv(x, (r + 1) % p, np.empty_like(x), (r - 1) % p)
        req = comm.isend_obj({"k": r}, (r + 1) % p, tag=2)
        comm.recv_obj((r - 1) % p, 2)
        req.wait()
        objlen = len(pickle.dumps({"k": r}, protocol=pickle.HIGHEST_PROTOCOL))
        want = {"calls": 3, "messages": 2, "bytes": x.nbytes + objlen, "native_calls": 0}
        expect(comm.counters()["p2p"] == want,
               f"p2p counters {axis}: {comm.counters()['p2p']} != {want}")
        # the other groups saw none of it
        after = [g.counters() for g in others]
        expect(before == after, f"counters of other groups changed by traffic on {axis}")
        comm.reset_counters()
        expect(comm.counters()["total"] == dict.fromkeys(
            ("calls", "messages", "bytes", "native_calls"), 0), "reset_counters")
    mc = mesh.counters()
    expect("world" in mc and all(a in mc for a in groups.axes if groups.comm[a]),
           f"mesh.counters() keys {sorted(mc)}")


def section_linear(groups, mesh):
    algorithms.register("linear", linear_algorithm)
    try:
        for i, axis in enumerate(groups.axes + ["world"]):
            if axis == "world":
                ce.bind(ce.W.Dup())
                comm = mesh.world
            else:
                comm = groups.on(axis)
            if comm is None:
                continue
            p, r = ce.P, ce.RANK
            seed = 80_000 + 100 * i
            for n in (1, 7 * p + 3, 3000):
                for dtype in (np.float32, np.int32, np.float16):
                    seed += 1
                    ce.case_allreduce(comm, seed, n, dtype, "sum", "linear", "out")
                    ce.case_allreduce(comm, seed, n, dtype, "max", "linear", "inplace")
            x = ce.data(seed, 100, np.float64).copy()
            h = comm.iallreduce(x, op="mean", algorithm="linear", name="lin-nb")
            ce.compare(f"{axis} linear iallreduce mean", h.wait(),
                       ce.native_allreduce(x, "mean"), ce.tolerance(seed, 100, np.float64,
                                                                    "mean"))
            comm.reset_counters()
            comm.allreduce(x, algorithm="linear")
            want = (p - 1 if r == 0 else 1) if p > 1 else 0
            got = comm.counters()["allreduce"]
            expect(got["messages"] == want and got["bytes"] == want * x.nbytes,
                   f"{axis} linear counters {got}, expected {want} messages")
            try:
                comm.reduce_scatter(x, algorithm="linear")
                expect(False, f"{axis}: linear reduce_scatter did not raise")
            except ValueError as exc:
                msg = str(exc)
                expect("'linear' does not implement reduce_scatter" in msg
                       and "\n" not in msg, f"unclear error: {msg}")
            if axis == "world":
                ce.RAW.Free()
    finally:
        algorithms.REGISTRY.pop("linear", None)


def section_threads(groups, mesh):
    if os.environ.get("MPIDL_PROGRESS", "thread") == "eager":
        expect(all(g.progress_mode == "eager" for g in groups.comm.values() if g),
               "MPIDL_PROGRESS=eager not honoured by the groups")
        return
    comms = [mesh.world] + [g for g in groups.comm.values() if g is not None]
    started = [g for g in comms if g.progress_started]
    before = threads_besides_inspector()
    axis = next((a for a in ("dp",) + tuple(groups.axes) if groups.comm[a] is not None
                 and not groups.comm[a].progress_started), None)
    if axis is None:
        return
    comm = groups.comm[axis]
    comm.iallreduce(np.ones(4)).wait()
    after = threads_besides_inspector()
    comm.iallreduce(np.ones(4)).wait()
    again = threads_besides_inspector()
    expect(after == before + 1 and again == after,
           f"threads: {before} before, {after} after one iallreduce on {axis}, {again} after "
           "a second")
    expect(comm.progress_started and all(not g.progress_started for g in comms
                                         if g is not comm and g not in started),
           "a progress thread started on a group that made no non-blocking call")
    counts = REF.gather((before, after), root=0)
    if WRANK == 0:
        print(f"threads: active_count before/after a non-blocking allreduce on {axis} "
              f"(groups: world + {', '.join(groups.axes)}): {counts[0][0]} -> {counts[0][1]} "
              f"(at construction, before any non-blocking call: {STARTUP_THREADS})",
              flush=True)


def threads_besides_inspector():
    """Threads of this process, not counting the stall inspector (one per process)."""
    return sum(1 for t in threading.enumerate() if t.name != "mpidl-stall")


def section_errors():
    bad = [dict(dp=WSIZE + 1), dict(dp=2, tp=WSIZE), dict(tp=WSIZE + 1),
           dict(roles={"server": WSIZE}), dict(order=("dp", "tp")),
           dict(roles={"dp": 1})]
    for kw in bad:
        try:
            m = Mesh(**kw)
            m.close()
            expect(False, f"Mesh({kw}) did not raise")
        except ValueError as exc:
            msg = str(exc)
            expect("\n" not in msg and msg.startswith("Mesh:"), f"Mesh({kw}): {msg!r}")
            if "dp" in kw and "tp" not in kw:
                expect(f"dp={kw['dp']}" in msg and str(WSIZE) in msg, f"Mesh({kw}): {msg}")


STARTUP_THREADS = None


def main():
    if os.environ.get("GROUPS_DUMP_AFTER"):  # debugging a hang: every rank's stacks
        import faulthandler  # noqa: PLC0415
        faulthandler.dump_traceback_later(float(os.environ["GROUPS_DUMP_AFTER"]), exit=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--order", default="pp,dp,tp")
    ap.add_argument("--roles", default="")
    ap.add_argument("--sections",
                    default="layout,threads,equivalence,concurrent,p2p,counters,linear,errors")
    ap.add_argument("--grid", default="small", choices=("small", "full"))
    args = ap.parse_args()
    roles = {}
    for item in filter(None, args.roles.split(",")):
        k, v = item.split("=")
        roles[k] = int(v)
    global STARTUP_THREADS
    mesh = Mesh(dp=args.dp, pp=args.pp, tp=args.tp, order=tuple(args.order.split(",")),
                roles=roles, check="always")
    STARTUP_THREADS = threads_besides_inspector()
    groups = Groups(mesh)
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        before = ce.ncases["n"]
        if name == "layout":
            section_layout(mesh)
        elif name == "equivalence":
            section_equivalence(groups, args.grid == "full")
        elif name == "concurrent":
            section_concurrent(groups)
        elif name == "p2p":
            section_p2p(groups, mesh)
        elif name == "counters":
            section_counters(groups, mesh)
        elif name == "linear":
            section_linear(groups, mesh)
        elif name == "threads":
            section_threads(groups, mesh)
        elif name == "errors":
            section_errors()
        else:
            raise SystemExit(f"unknown section {name}")
        REF.Barrier()
        if WRANK == 0:
            print(f"section {name}: {ce.ncases['n'] - before} comparisons on rank 0, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    groups.close()
    mesh.close()
    ce.report(REF, failures, f"GROUPS OK n={WSIZE} shape={mesh.shape} roles={roles}")


if __name__ == "__main__":
    main()

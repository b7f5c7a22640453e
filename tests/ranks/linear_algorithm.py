"""A toy algorithm that proves the registry: adding one is this module plus one line.

"linear" allreduce: every rank sends its buffer to rank 0, which reduces them in rank
order (so the result is bitwise the left-to-right sum) and sends the result back to
everyone. Slow on purpose (p-1 messages into one rank), simple to check: rank 0 sends
p-1 messages of n elements, every other rank one. It implements allreduce only; choosing
it for another collective must give a clear error.

Registered from a test with ``mpidl.comm.algorithms.register("linear", linear_algorithm)``
(the same as adding ``"linear": linear_algorithm`` to ``REGISTRY``).
"""


def allreduce(t, src, dst, op, ctx):
    p, rank = t.size, t.rank
    t.ready()
    if rank != 0:
        t.send(src, 0)
        t.recv(dst, 0)
        return
    tmp = t.scratch.get("linear", src.size, src.dtype)
    if dst is not src:
        t.copy(dst, src)
    for r in range(1, p):
        t.recv(tmp, r)
        t.combine(op.fn, dst, tmp, dst)
    for r in range(1, p):
        t.send(dst, r)

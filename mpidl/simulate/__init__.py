"""The cost model of ``mpidl simulate``: a step's traffic, exactly, and its time, predicted.

- ``collectives``: per algorithm (ring, tree, recursive doubling, hierarchical, MPI's
  own), the messages and bytes each rank sends in one call, as the modules of
  ``mpidl.comm`` send them and its counters count them; and the alpha-beta-gamma time of
  the call on a machine.
- ``step``: a data-parallel step laid out as the runtime lays it out (fused buckets,
  ``auto``'s choices, row-sparse gathers), its per-rank traffic and its predicted time.
- ``compression``: a compressed exchange's calls, found by running the compressor.
- ``server``: the parameter server's pushes and answers (point to point).
- ``tensor``: tensor parallelism's tp group (recorded from the cut model's passes) and
  dp group.
- ``pipeline``: pipeline parallelism's messages between stages (walking the schedule's
  lists) and each stage's dp group.
- ``parallax``: Parallax's pushes of the remote parameters and the trainers' buckets.
- ``hybrid``: the conv-DP/FC-MP hybrid's boundary, FC block and convolutions' buckets.
- ``machine``: the machine description (links, reductions, measured compute) and its file.
- ``calibrate``: the measurements ``mpidl simulate --calibrate`` makes.

Why: "how will this run do on 512 ranks?" deserves an answer before the machine is
booked, and "how many bytes does a step send?" one that tests can hold to the counters.
"""

"""``Runtime``: one training step built from parts, and what the trainer asks of the ranks.

A step is three parts (``mpidl.runtime.presets`` puts them together from the command
line; ``--strategy local|allreduce|ps`` are presets):

* a **schedule** (``schedule.MicroBatches``): forward and backward over the step's
  micro-batches, gradients accumulating;
* **gradient syncs**, each for its own group of parameters (``sync/``): fused all-reduce
  buckets, compressed exchange, row-sparse all-gather, parameter-server push/pull, or
  none;
* an **optimizer placement** (``placement``): replicated on every training rank, or on
  the parameter servers;
* optionally **mixed precision** (``precision``: ``--precision bf16|fp16``): forward
  and backward rounded to the format, 2-byte gradient buckets, the optimizer stepping
  float32 master weights through ``Precision.step`` (fp16: all of a step's gradients at
  once, so an overflow skips the whole step);
* optionally **model averaging** (``averaging``: local SGD, DiLoCo), after the update:
  the replicas step alone and their parameters are averaged every H steps; while it is
  in its local phase the step runs no gradient sync (``GradSync`` over everything).

::

    rt.zero_grad; for s in syncs: s.begin_step()
    loss = schedule.run(model, loss, x, y, arm=hooks on for the final backward pass)
    for s in syncs: for names in s.finish(): placement.step(names)
    averaging.after_update()         # every H steps: parameters averaged (if any)

A rank has a role: ``trainer`` (runs steps) or ``server`` (``serve()`` instead). The
trainer talks to the runtime only (shard, step, evaluation, collectives, checkpoints),
so a new way of training is new parts, not a new trainer.

Rules the runtime keeps: ``__init__`` never communicates (it runs before the ranks have
agreed the configuration is valid); ``setup`` is collective (groups, parameter
broadcast); ``reduce``, ``gather``, ``bcast``, ``barrier``, ``state_dict`` and
``load_state_dict`` are collective over the ranks that need them, called by every rank
in the same order.
"""

import time
from functools import partial

import numpy as np

from mpidl.allocator import keep_freed_blocks
from mpidl.backend import to_numpy
from mpidl.engine.dropout import Dropout
from mpidl.engine.lazy import is_lazy, lazy_parameters, materialize, values_of
from mpidl.runtime.fusion import MiB
from mpidl.runtime.sync.base import GradSync

_clock = time.perf_counter
_SAVE_TAG = 7411  # the stages' tensors to the root (whole_tensors: --save)


def _layout_text(layout):
    """A layout ``[P, T, ranks]`` (``Runtime._pipeline_layout``) in words."""
    if layout is None or (layout[0] == 1 and layout[1] == 1):
        return "plain data parallelism"
    stages = f"{layout[0]} pipeline stage" + ("s" if layout[0] > 1 else "")
    return f"{stages} x {layout[1]} tensor-parallel on {layout[2]} ranks"


class Runtime:
    """A composed step on one rank; build it with ``mpidl.runtime.build``."""

    #: True when a consistent checkpoint exists only between epochs (parameter server)
    checkpoint_at_epoch_end = False

    def __init__(self, comm, name, schedule, syncs, placement_cls, *, role="trainer",
                 server=None, roles=None, sync_bn=False, options=None, unused=(),
                 averaging=None, precision=None, tensor_parallel=None, pipeline=None):
        self.comm = comm                      # the world Communicator (None: one process)
        self.name = name                      # the preset's name, for logs
        self.schedule = schedule
        self.syncs = list(syncs)              # [(selector, GradSync)]; see presets
        self.averaging = averaging            # a ModelAveraging (local SGD, DiLoCo) or None
        self.precision = precision            # a precision.Precision (bf16, fp16) or None
        self.clip = None                      # a clip.GradClip (--clip-grad-norm) or None
        self.tp = tensor_parallel             # a tensor_parallel.TensorParallel or None
        self.tp_group = None                  # its group (the mesh's tp axis)
        self.pp = pipeline                    # a pipeline.Pipeline (also the schedule) or None
        self.pp_group = None                  # its group (the mesh's pp axis)
        self.zero = 0                         # the ZeRO stage (``presets._zero`` sets it)
        self.lazy_build = None                # (bytes drawn here, whole) of a lazy model
        self.sample_batch = None              # (x, y) of one micro-batch: the pipeline
                                              # times its layers on it (set by the trainer)
        self._step_syncs = self.syncs         # the syncs the current step runs
        self.placement_cls = placement_cls
        self.role = role
        self.server = server                  # a ServerRole on server ranks
        self.roles = dict(roles or {})        # role -> world ranks
        self.sync_bn = bool(sync_bn)
        self.options = dict(options or {})
        self.unused_options = tuple(unused)   # given, but no part of this step uses them
        self.checkpoints = False              # set by the trainer before setup
        self.model = self.optimizer = self.loss = None
        self.group = None                     # the data-parallel group of trainers
        self.steps = 0
        self.compressor = None                # set by the preset when --compression is on
        self.whole_batches = False            # every trainer loads the whole global batch
                                              # (--deal portions: the schedule deals it)
        self.checks = []                      # fn(model, optimizer): local, may raise
        self.ledger = None                    # the memory figures of the epoch's first step
        self.cuda_graph = False               # --cuda-graph (the local preset sets it)
        self.graph = None                     # its GraphedStep, made at setup
        self._updating = True                 # the current step applies its gradients
        self.reset_stats()

    # -- who am I
    @property
    def rank(self):
        return 0 if self.comm is None else self.comm.rank

    @property
    def size(self):
        return 1 if self.comm is None else self.comm.size

    @property
    def trains_on_data(self):
        return self.role == "trainer"

    @property
    def trainer_ranks(self):
        return self.roles.get("trainer", list(range(self.size)))

    @property
    def is_root(self):
        """The rank that logs, prints metrics and writes checkpoints: the first trainer."""
        return self.rank == self.trainer_ranks[0]

    def shard(self):
        """(index, count): this rank's piece of every global batch."""
        trainers = self.trainer_ranks
        if not self.trains_on_data:
            return 0, len(trainers)
        mine = trainers.index(self.rank)
        # a tp group, and the stages of a pipeline, share one piece (the mesh: pp, dp, tp
        # from outermost to innermost)
        t = 1 if self.tp is None or self.tp.over_dp else self.tp.degree
        dp = len(trainers) // (t * self.pp_degree)
        return (mine // t) % dp, dp

    @property
    def resizable(self):
        """Whether a checkpoint of this step can continue on another number of ranks
        (an elastic run that lost a rank; a resume on more or fewer ranks): plain data
        parallelism, where every replica holds the whole model and optimizer state and
        no part keeps state of its own per rank."""
        if self.name == "ps":  # the servers' state is merged by name in checkpoints
            mode = getattr(self, "mode_cfg", None)
            return (self.compressor is None and not self.whole_batches
                    and getattr(self.server, "group_size", 1) == 1
                    and all(getattr(s, "group_size", 1) == 1 for _, s in self.syncs)
                    and (mode is None or not getattr(mode, "deal", None)))
        return (self.name in ("local", "allreduce", "allreduce+local-sgd",
                              "allreduce+diloco")
                and self.tp is None and self.pp is None and self.compressor is None)

    @property
    def zero_chunks(self):
        """Whether each rank writes the elements of its ZeRO chunks into a checkpoint
        (``zero.Sharded.checkpoint_pieces``) and reads its new chunks' from one, so that
        nothing of the model or its optimizer state is gathered for it: ZeRO without
        tensor parallelism (whose chunks are of slices), with or without a pipeline."""
        return (self.tp is None and self.trains_on_data
                and hasattr(getattr(self, "placement", None), "checkpoint_pieces"))

    @property
    def tp_chunks(self):
        """ZeRO over the data-parallel groups of tensor parallelism, with a pipeline or
        not (fp32, the only precision tensor parallelism has): every rank writes the
        elements of its chunks of its slices (``_chunk_parts``), so nothing is gathered
        for a checkpoint either."""
        return (self.tp is not None and not self.tp.over_dp
                and self.precision is None and self.trains_on_data
                and hasattr(getattr(self, "placement", None), "checkpoint_pieces"))

    @property
    def shards_checkpoints(self):
        """``zero_chunks`` over data parallelism alone: every rank a shard of its chunks,
        the root the index and the rest."""
        return self.zero_chunks and self.pp is None

    @property
    def resumes_resized(self):
        """Whether a checkpoint of this run resumes on another number of data-parallel
        replicas: the ``resizable`` runtimes, and all-reduce data parallelism, ZeRO or
        not, over tensor parallelism and pipelines too. Their checkpoints hold every
        tensor whole, as tensor-parallel slices or as flat pieces of ZeRO's chunks, and a
        rank reads its part of the new layout. Not with state a rank keeps of its own
        (a compressor's residuals, model averaging, an async pipeline's carried
        gradients) or with the conv-DP/FC-MP hybrid, whose tensor-parallel degree is the
        world's."""
        if self.resizable:
            return True
        dense = self.name == "allreduce" or self.name.startswith("allreduce+zero")
        carries = self.pp is not None and self.pp.kind == "async"
        hybrid = self.tp is not None and self.tp.over_dp
        return dense and self.compressor is None and not carries and not hybrid

    def commit_point(self, step, every):
        """Whether an elastic run keeps the state at the start of ``step`` (it keeps
        every ``every``-th). With model averaging, after its warm-up: at the start of
        every period, the one moment the replicas agree (a rank that got the averaging's
        result before a death may be a period ahead of the others; they all still hold
        that period's start)."""
        if self.checkpoint_at_epoch_end:  # the parameter server: at epoch ends only
            return False
        avg = self.averaging
        if avg is not None and avg.local_phase:
            return avg.since_average() == 0
        return step % every == 0

    @property
    def pp_degree(self):
        return 1 if self.pp is None else self.pp.degree

    # -- set-up
    def check(self, model, optimizer):
        """ConfigError if a part of this step cannot serve ``model`` or ``optimizer``
        (ZeRO: a non-elementwise optimizer, row-sparse gradients). Local work, no
        communication: the command line runs it in its set-up phase, where the ranks
        agree on errors; ``setup`` runs it again."""
        for fn in self.checks:
            fn(model, optimizer)

    def setup(self, model, optimizer, loss):
        """Collective: groups, parameter broadcast, the syncs' layouts, hooks."""
        keep_freed_blocks()  # each step's large arrays reuse mapped pages (mpidl.allocator)
        self.check(model, optimizer)
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.named_params = model.named_parameters()
        whole = _unique_nbytes(self.named_params) if lazy_parameters(model) else None
        self.schedule.setup(model)
        self._build_groups()
        if self.tp is not None:  # the model is cut into this rank's slices
            self.tp.setup(model, self.tp_group)
            self.loss = loss = self.tp.loss(loss)
            self.named_params = model.named_parameters()
        if self.pp is not None:  # every rank keeps its stages' layers
            self.pp.cut(model, optimizer, self.pp_group, self.comm, self.sample_batch,
                        self.tp)
            self.named_params = model.named_parameters()
        if self.zero < 3 or self.precision is not None:
            # a lazily built model: what this rank keeps, drawn whole (ZeRO stage 3 draws
            # only each rank's chunks, ``zero.Shard``)
            materialize(model)
        if self.compressor is not None and self.comm is not None:
            # momentum applied once: a momentum-correcting memory (onebit, dgc) takes it
            # over from whoever runs the optimizer (this rank, or this parameter server)
            memory = self.compressor.memory
            if memory is not None:
                memory.adopt_momentum(optimizer)
        index, _ = self.shard()
        for _, layer in model.modules():  # each share of the data its own dropout masks
            if isinstance(layer, Dropout):  # (but not a layer every share goes through)
                layer.stream = 0 if getattr(layer, "whole_batch", False) else index
        if self.role == "server":
            self.server.setup(self)
            return
        if self.sync_bn and self.group is not None and self.group.size > 1:
            from mpidl.engine.normalization import convert_sync_batchnorm  # noqa: PLC0415

            convert_sync_batchnorm(model, self.group)
        if self.broadcast_at_start and self.group is not None and self.group.size > 1:
            for _, p in self.named_params:
                if _sliced_over_dp(p) or is_lazy(p.data):  # the hybrid's slices differ by
                    continue  # design; a lazy build's values are the seed's on every rank
                self.group.bcast(p.data, root=0)
            for _, buf in model.named_buffers():
                if hasattr(buf, "shape") and buf.ndim > 0 and buf.flags.c_contiguous:
                    self.group.bcast(buf, root=0)
        self.placement = self.placement_cls(optimizer)
        if self.cuda_graph:
            self._setup_graph(model, optimizer, loss)
        if self.precision is not None:  # after the broadcast: masters alike on every rank
            self.precision.setup(model, optimizer, loss,
                                 chunks=self.pp.chunk_layers if self.pp is not None else ())
            # fp16's overflow, where this rank sees only some of the reduced gradients:
            # its stage's (a pipeline), its shards' (ZeRO)
            groups = [g for g, part in ((self.group, self.zero),
                                        (self.pp_group, self.pp)) if part and g is not None
                      and g.size > 1]
            if groups:
                self.precision.agree = partial(_any_rank, groups)
        owned = set()
        for select, sync in self.syncs:
            if hasattr(select, "bind"):
                select.bind(model)
            mine = [(n, p) for n, p in self.named_params if n not in owned and select(n)]
            owned.update(n for n, _ in mine)
            sync.checkpoints = self.checkpoints
            sync.setup(self, mine)
        if self.precision is not None:
            self._keep_working_copies()
        self._local_syncs = self.syncs
        if self.averaging is not None:
            # the local phase of model averaging: no gradient leaves the rank
            local = GradSync()
            local.setup(self, [(n, p) for n, p in self.named_params if n in owned])
            self._local_syncs = [(lambda name: True, local)]
            self.averaging.setup(self)
        self._step_syncs = self.syncs
        if self.clip is not None:
            self.clip.setup(self)
        # (a pipeline's backward passes are spread over its schedule: its gradients are
        # synced after the last one)
        self._hooked = [s for _, s in self.syncs if s.wants_hooks and self.pp is None]
        self._armed = False
        if self._hooked:
            add_hook = getattr(model, "add_grad_ready_hook", None)
            if add_hook is None:  # a model without hooks: everything is synced after backward
                self._hooked = []
            else:
                add_hook(self._on_grads_ready)
        # (bytes of parameters this rank drew, the whole model's) of a lazily built model,
        # for the log
        self.lazy_build = None if whole is None else (self.memory()["mem_params"], whole)

    @property
    def broadcast_at_start(self):
        """Replicas start identical: rank 0's parameters go to the data-parallel group
        (parameter servers hand theirs out with the first pull instead)."""
        return not any(s.updates_remotely for _, s in self.syncs)

    def _build_groups(self):
        """The process groups this step talks on, from a ``Mesh`` over the world: the
        data-parallel group of trainers (``self.group``), and for a parameter server the
        servers' group (``role_group``); the servers' protocol runs on the world group's
        point-to-point calls (``ps_comm``)."""
        from mpidl.comm import Mesh  # noqa: PLC0415

        self.mesh = self.group = self.role_group = None
        if self.comm is None:
            return
        servers = self.roles.get("server", [])
        over_dp = self.tp is not None and self.tp.over_dp
        self.mesh = Mesh(self.comm, roles={"server": len(servers)} if servers else None,
                         tp=1 if self.tp is None or over_dp else self.tp.degree,
                         pp=self.pp_degree)
        self.group = self.mesh.group("dp")
        self.tp_group = (None if self.tp is None else self.group if over_dp
                         else self.mesh.group("tp"))
        self.role_group = self.mesh.group(self.role)
        self.pp_group = None if self.pp is None else self.mesh.group("pp")
        self.ps_comm = self.comm

    def _on_grads_ready(self, names):
        if self._armed:
            for sync in self._hooked:
                sync.on_grads_ready(names)

    def _arm(self, on):
        self._armed = on and bool(self._hooked) and self._step_syncs is self.syncs

    def _setup_graph(self, model, optimizer, loss):
        from mpidl.engine.cuda_graph import GraphedStep  # noqa: PLC0415

        self.graph = GraphedStep(model, loss, optimizer)  # the preset checked the device
        self._graph_said = False

    def _graph_step(self, x, y):
        """A step through the CUDA graph; None once it has fallen back to eager steps
        (the reason is logged once)."""
        graph = self.graph
        if graph.reason is not None:
            if not self._graph_said:
                self._graph_said = True
                from mpidl.training.log import get_logger  # noqa: PLC0415

                get_logger().warning(f"--cuda-graph: running eager steps: {graph.reason}")
            return None
        t0 = _clock()
        value = float(graph(x, y))  # the trainer wants the loss now (stats, divergence)
        self.stats["forward"] += _clock() - t0  # the whole replayed step
        self.stats["steps"] += 1
        self.steps += 1
        return value

    # -- a step
    def train_step(self, x, y):
        """One step on this rank's batch; parameters updated; returns the local loss."""
        if self.graph is not None:
            value = self._graph_step(x, y)
            if value is not None:
                return value
        self.begin_step()
        loss = self.schedule.run(self.model, self.loss, x, y, arm=self._arm)
        self.finish_step(self.schedule.forward_s, self.schedule.backward_s)
        return loss

    def begin_step(self):
        """Clear the gradients and open the syncs' step (before the first forward)."""
        if self.schedule.measure_activations:
            self._start_ledger()
        if self.precision is not None:
            self.precision.begin_step()
        self.placement.zero_grad(self.model)
        # an asynchronous pipeline's first step has no earlier gradient to apply
        self._updating = getattr(self.schedule, "gradients_ready", True)
        avg = self.averaging
        if avg is not None:
            avg.restore()  # after an evaluation of the averaged model
            self._step_syncs = self.syncs if avg.gradients_synced() else self._local_syncs
        if self._updating:
            for _, s in self._step_syncs:
                s.begin_step()

    def finish_step(self, forward_s=0.0, backward_s=0.0):
        """After backward: every sync makes its gradients ready, the optimizer placement
        applies them; the step's times go to the counters. The first step after
        ``reset_stats`` also takes the memory ledger (outside the timed part)."""
        measure = self.schedule.measure_activations
        if measure:
            self._probe_memory(None, "end of backward")
        t2 = _clock()
        wait = self._apply_gradients() if self._updating else 0.0
        if self.averaging is not None:
            wait += self.averaging.after_update()
        t4 = _clock()
        stats = self.stats
        stats["forward"] += forward_s
        stats["backward"] += backward_s
        stats["wait"] += wait + getattr(self.schedule, "wait_s", 0.0)  # (dealt portions)
        stats["update"] += (t4 - t2) - wait
        stats["steps"] += 1
        self.steps += 1
        if measure:
            self._take_ledger()
        tl = self.timeline
        if tl is not None:
            t0 = t2 - backward_s - forward_s
            tl.record("compute", "forward", "", 0, t0, t0 + forward_s, 0)
            tl.record("compute", "backward", "", 0, t0 + forward_s, t2, 0)
            tl.record("compute", "exchange+update", "", 0, t2, t4, 0)

    def _keep_working_copies(self):
        """Mixed precision: the working copies go to the 2-byte format
        (``working_copy``), but ZeRO stage 3's, which its gathers keep so already, and
        those a pipeline uses outside their layers' passes (which stay float32); ZeRO
        stages 1-2 hold them in their buckets' 2-byte buffers (``working_words``)."""
        words, own = {}, set()
        for _, s in self.syncs:
            if getattr(s, "stage", None) == 3:
                own.update(n for sh in s.shards for n in sh.bucket.names)
            elif hasattr(s, "working_words"):
                words.update(s.working_words())
        if self.pp is not None:
            own |= self.pp.params_outside_passes()
        named = [(n, p) for n, p in self.named_params if n not in own]
        if named:
            self.precision.keep_working_copies(self.model, named, words)

    def _apply_gradients(self):
        """The syncs make the step's gradients ready and the placement applies them;
        returns the seconds spent waiting on communication."""
        wait = 0.0
        prec = self.precision
        if self.clip is not None or (prec is not None and prec.dynamic):
            # every gradient before any update: the global norm, fp16's overflow check
            ready = [n for _, s in self._step_syncs for names in s.finish() for n in names]
            wait += sum(s.wait_seconds() for _, s in self._step_syncs)
            coef = 1.0 if self.clip is None else self.clip.coefficient(ready)
            if prec is None:
                self.placement.step(ready, coef)
            else:
                prec.step(self.placement, ready, coef)
        else:  # each sync's buckets as they are ready
            for _, s in self._step_syncs:
                for names in s.finish():
                    if prec is None:
                        self.placement.step(names)
                    else:
                        prec.step(self.placement, names)
                wait += s.wait_seconds()
        return wait

    @property
    def timeline(self):
        """The communicator's Chrome-trace recorder, if it keeps one: compute spans go
        beside its collectives, so the trace shows what overlapped what."""
        return getattr(self.group, "timeline", None) if self.group is not None else None

    def epoch_cut(self):
        """True when this rank should end its epoch early (``--epoch-quorum``)."""
        return any(getattr(s, "epoch_cut", lambda: False)() for _, s in self.syncs)

    def serve(self):
        """Run a non-training rank until training is over."""
        if self.server is None:
            raise RuntimeError(f"{self.name}: rank {self.rank} has no server role")
        return self.server.serve()

    # -- evaluation and buffers
    def prepare_eval(self):
        """Make the model hold the parameters to evaluate and average its buffers."""
        for _, s in self.syncs:
            s.prepare_eval()
        if self.precision is not None:
            self.precision.gather_params()
        if self.averaging is not None and self.trains_on_data:
            self.averaging.prepare_eval()
        self.sync_buffers()

    def sync_buffers(self):
        """Average floating buffers (BatchNorm running statistics) over the data-parallel
        group, so every rank evaluates and saves one model; collective. Integer buffers
        (counters) are the same on every rank already; synchronized BatchNorms' are too."""
        group = self.group
        if group is None or group.size == 1 or not self.trains_on_data:
            return
        self._before_collective()
        synced = {f"{name}." if name else "" for name, layer in self.model.modules()
                  if getattr(layer, "sync_group", None) is not None}
        for name, buf in self.model.named_buffers():
            if not hasattr(buf, "dtype") or buf.dtype.kind != "f" or buf.size == 0:
                continue
            if any(name.startswith(prefix) and "." not in name[len(prefix):]
                   for prefix in synced):
                continue
            out = buf.copy() if buf.ndim == 0 else buf
            group.allreduce(out, out=out, op="mean", algorithm="mpi", name=f"buffer {name}")
            if out is not buf:
                self.model.set_buffer(name, out)

    # -- memory
    def memory(self):
        """The memory ledger now: bytes of parameters, gradients, optimizer state and
        communication buffers this rank holds, each piece of memory once
        (``mpidl.runtime.memory``)."""
        from mpidl.engine.module import SparseGrad  # noqa: PLC0415
        from mpidl.runtime.memory import Ledger  # noqa: PLC0415

        ledger = Ledger()
        params = [p for _, p in self.named_params]
        ledger.add("mem_params", [p.data for p in params])
        ledger.add("mem_grads", [p.grad for p in params if not isinstance(p.grad, SparseGrad)])
        ledger.add("mem_grads", [g for p in params if isinstance(p.grad, SparseGrad)
                                 for g in (p.grad.indices, p.grad.values)])
        if self.precision is not None:  # (before the optimizer: its params are the masters)
            self.precision.memory(ledger)
        placement = getattr(self, "placement", None)
        if placement is not None:
            placement.memory(ledger)
        for _, sync in self.syncs:
            sync.memory(ledger)
        if self.pp is not None:
            self.pp.memory(ledger)
        if self.group is not None:
            ledger.extra("mem_comm", self.group.buffer_nbytes())
        return ledger.as_dict()

    def _start_ledger(self):
        """The step that takes the ledger: a probe before every layer's forward and
        backward follows the held memory and the activations through the passes."""
        self._peak = 0
        self._optimizer_bytes = self.memory()["mem_optimizer"]
        self._probes = [m for _, m in self.model.modules()]
        for m in self._probes:
            m.add_pre_hook(self._probe_memory)

    def _probe_memory(self, layer, phase):
        total = sum(self.memory().values()) + self.model.activation_nbytes()
        self._peak = max(self._peak, total)

    def _take_ledger(self):
        """The epoch line's memory figures: the ledger after this step, the most
        activations a forward kept, and ``mem_peak``, the most the ledger and the
        activations held together at any layer boundary of the step (layers' own
        temporaries, such as a GEMM's output before it is kept, are not in it)."""
        for m in self._probes:
            m.remove_pre_hook(self._probe_memory)
        self._probes = []
        sched = self.schedule
        sched.measure_activations = False
        held = self.memory()
        peak = max(self._peak, sum(held.values()))
        self.ledger = {**held, "mem_activations": sched.activation_bytes, "mem_peak": peak}
        if held["mem_optimizer"] > self._optimizer_bytes:
            # the optimizer's state came into being in this step's update, after the
            # passes the probes followed: the next step's passes hold it, measure that one
            sched.measure_activations = True
            sched.activation_bytes = 0

    # -- metrics
    def reset_stats(self):
        """Zero the per-step time counters (seconds, summed over steps); the next step
        takes the memory ledger."""
        self.stats = {"steps": 0, "forward": 0.0, "backward": 0.0, "wait": 0.0,
                      "update": 0.0}
        if self.schedule is not None and self.trains_on_data:
            self.schedule.measure_activations = True
            self.schedule.activation_bytes = 0

    def metrics(self):
        """This rank's mean per-step times (ms) since the previous epoch and the syncs'
        counters (bytes sent per step, parameter-server counts, ...)."""
        out = dict(self.ledger or {})
        self.ledger = None
        if self.trains_on_data and self.comm is not None and self.size > 1:
            s = self.stats
            n = max(s["steps"], 1)
            out["compute_ms"] = 1e3 * (s["forward"] + s["backward"] + s["update"]) / n
            out["wait_ms"] = 1e3 * s["wait"] / n
            fused = [sy for _, sy in self.syncs if hasattr(sy, "bytes_per_step")]
            if fused and fused[0].hook is None:
                out["bytes_sent_per_step"] = sum(sy.bytes_per_step() for sy in fused)
                if self.averaging is not None:  # (averagings move the same buckets)
                    out["bytes_sent_per_step"] *= self.averaging.exchange_fraction()
        for _, sync in self.syncs:
            out.update(sync.metrics())
        if self.tp is not None and not self.tp.over_dp:
            out["tensor_parallel"] = self.tp.degree
        if self.pp is not None:
            out.update(self.pp.metrics())
        if self.precision is not None:
            out.update(self.precision.metrics())
        if self.averaging is not None:
            out.update(self.averaging.metrics())
        if self.clip is not None and self.trains_on_data:
            out.update(self.clip.metrics())
        if self.server is not None and self.server.final_stats is not None:
            from mpidl.runtime.sync.pushpull import summarize  # noqa: PLC0415

            out.update(summarize(self.server.final_stats))
        self.reset_stats()
        return out

    def describe(self):
        """A few lines on how a step runs (for logs and reports)."""
        lines = [f"{self.name}: {self.schedule.describe()}, optimizer "
                 f"{getattr(getattr(self, 'placement', None), 'name', '-')}"]
        for _, sync in self.syncs:
            lines += sync.describe()
        if self.precision is not None:
            lines += self.precision.describe()
        if self.averaging is not None:
            lines += self.averaging.describe()
        if self.tp is not None:
            lines += self.tp.describe()
        if self.pp is not None:
            lines += self.pp.describe()
        return lines

    def adapt_task(self, task):
        """Give the trainer's task the losses this layout needs (after ``setup``): with
        logits split over a tensor-parallel group, the parallel cross-entropy."""
        if self.tp is not None and (self.tp.output_slice is not None or self.tp.over_dp):
            task.loss = self.loss
            task.eval_loss = self.tp.loss(task.eval_loss)
        if self.pp is not None:  # the last stage computes the sums, every stage returns them
            from functools import partial  # noqa: PLC0415

            task.eval_sums = partial(self.pp.eval_sums, task.eval_sums)
        return task

    def start_lines(self, batch_size):
        """Lines for the log before training, on the root (the hybrid's bytes per step
        from its formula, beside plain data parallelism's); ``batch_size``: per rank and
        micro-batch. Local, no communication."""
        if not self.trains_on_data:
            return []
        lines = getattr(self.tp, "start_lines", None)
        out = [] if lines is None else lines(batch_size)
        if self.pp is not None:
            out += self.pp.start_lines()
        if self.lazy_build is not None:
            mine, whole = self.lazy_build
            out.append(f"model built lazily: this rank drew {mine / MiB:.1f} MiB of the "
                       f"model's {whole / MiB:.1f} MiB of parameters, only what it keeps")
        return out

    def eval_batches(self, x, y, batch_size, dtype=None):
        """This rank's (x, y) batches of an evaluation set: its contiguous piece. When a
        forward is collective over ranks holding different pieces (the hybrid; ZeRO stage
        3 gathering layer by layer), every rank runs as many batches as the rank with the
        most, the extra ones empty."""
        from mpidl.data.loader import eval_batches, lockstep_batches  # noqa: PLC0415

        index, count = self.shard()
        batches = eval_batches(x, y, batch_size, (index, count), dtype=dtype)
        lockstep = getattr(self.tp, "lockstep", None)
        if lockstep is not None:
            return lockstep(batches, x, y, batch_size, dtype)
        if any(getattr(s, "gathers_in_eval", False) for _, s in self.syncs):
            return lockstep_batches(batches, x, y, batch_size, count, dtype)
        return batches

    # -- the whole model, whatever the layout (checkpoints, --save)
    def gather_params(self):
        """Make every parameter whole before the model is read (ZeRO stage 3 holds
        shards between steps, mixed precision 2-byte working copies; the other syncs do
        nothing); they stay so until the next step. Collective under ZeRO stage 3."""
        for _, s in self.syncs:
            s.gather_params()
        if self.precision is not None:
            self.precision.gather_params()

    def full_state(self, model, optimizer=None):
        """Collective over the ranks that hold pieces of one model: (model state,
        optimizer state) of the whole model, as one process would hold them, on the
        root; on other ranks None. Without tensor parallelism: the local states."""
        self.gather_params()
        if self.tp is None and self.pp is None:
            if not self.is_root:
                return None, None
            return (dict(model.state_dict()),
                    None if optimizer is None else optimizer.state_dict())
        model_state = dict(model.state_dict())
        opt_state = None if optimizer is None else optimizer.state_dict()
        if self.tp is not None:
            model_state = self.tp.full_state(model_state)
            if optimizer is not None:
                opt_state = self.tp.full_optimizer_state(opt_state)
        if self.pp is not None:
            # the pipeline group of the root: the stages' first tp ranks of the first
            # data-parallel replica (the other pipeline groups hold copies)
            first_tp = self.tp is None or self.tp_group.rank == 0
            if first_tp and self.shard()[0] == 0:
                model_state, opt_state = self.pp.gather_state(model_state, opt_state)
        if not self.is_root:
            return None, None
        return model_state, opt_state

    def whole_tensors(self, model):
        """Collective over the ranks that hold pieces of one model: ``(name, whole host
        array)`` for every entry of the model's state, one at a time, on the root; every
        other rank must run through it too (it gets None). ``--save`` writes each tensor
        as it comes, so the root holds one tensor beyond its own part, never the whole
        model: a sliced tensor is gathered over the tensor-parallel group as its turn
        comes, and the pipeline's stages send theirs to the root one after another
        (ZeRO stage 3 of a lazily built model: a bucket at a time)."""
        root = self.is_root
        tp, pp = self.tp, self.pp
        frugal = [s for _, s in self.syncs if getattr(s, "gathers_in_eval", False)]
        if frugal and tp is None and pp is None:  # ZeRO 3, never whole: a bucket at a time
            for k, a in frugal[0].whole_params():
                yield k, a if root else None
            for k, b in model.named_buffers():
                yield k, to_numpy(b) if root else None
            return
        self.gather_params()

        def mine():  # this rank's tensors, whole over its tp group (on its first rank)
            for k, a in model.state_dict().items():
                if tp is not None and k in tp.slices:
                    a = (tp.full_state({k: a}) or {}).get(k)
                yield k, None if a is None else to_numpy(a)

        if pp is None:
            for k, a in mine():
                yield k, a if root else None
            return
        g = self.pp_group
        # the root's pipeline group: the stages' first tp ranks of the first replica
        if not ((tp is None or self.tp_group.rank == 0) and self.shard()[0] == 0):
            for _ in mine():  # (its part in the tp gathers)
                pass
            return
        if g.rank == 0:
            yield from mine()
            for stage in range(1, g.size):
                names, _, _ = g.recv_obj(stage, _SAVE_TAG)
                for name, shape, dtype in names:
                    buf = np.empty(shape, dtype=dtype)
                    g.recv(buf, stage, _SAVE_TAG)
                    yield name, buf
            return
        shapes = pp.whole_shapes
        g.send_obj([(k, shapes[k], np.dtype(a.dtype).str)
                    for k, a in model.state_dict().items()], 0, _SAVE_TAG)
        for _, a in mine():
            g.send(np.ascontiguousarray(a), 0, _SAVE_TAG)

    def checkpoint_parts(self, model, optimizer):
        """What this rank puts in a checkpoint: ``model``/``optimizer`` (the root's go into
        the checkpoint file), ``shard`` (this rank's part, to write as a shard file, or
        None) with its ``index`` of ``count``, ``shards`` (the index's entry, or None), and
        ``group``, the ranks that write shards (they agree and wait for each other over
        it; None without shards). With tensor parallelism the ranks holding the root's
        model's pieces each write their slices; under ZeRO over data parallelism alone
        every rank writes its chunks (``shards_checkpoints``); with a pipeline each stage
        writes its tensors; the root's file is the index. Collective over the ranks that
        hold pieces of one model (after ``checkpoint_state``, whose ZeRO gathers a
        pipeline's stage writers take)."""
        from types import SimpleNamespace  # noqa: PLC0415

        if self.shards_checkpoints:  # ZeRO: every rank its chunks, the root the rest
            placement = self.placement
            flat, steps = placement.checkpoint_index()
            rest = {k: to_numpy(v) for k, v in model.state_dict().items()
                    if k not in placement.of_param}
            opt_state = dict(optimizer.state_dict(), state=steps)
            g = self.group
            index, count = (0, 1) if g is None else (g.rank, g.size)
            return SimpleNamespace(model=rest, optimizer=opt_state,
                                   shard={"pieces": placement.checkpoint_pieces()},
                                   index=index, count=count, group=g,
                                   shards={"count": count, "flat": flat})
        if self.tp_chunks or (self.zero_chunks and self.pp is not None):
            return self._chunk_parts(model, optimizer)
        if self.pp is not None:
            return self._stage_parts(model, optimizer)
        if self.tp is None:  # the whole model in the root's file
            model_state, opt_state = self.full_state(model, optimizer)
            return SimpleNamespace(model=model_state, optimizer=opt_state, shard=None,
                                   shards=None, group=None)
        self.gather_params()
        whole, opt_state, shard, slices = self.tp.split_state(
            dict(model.state_dict()), optimizer.state_dict(copy=False))  # (written at once)
        g = self.tp_group
        mine = self.tp.over_dp or self.shard()[0] == 0  # in the root's group
        return SimpleNamespace(model=whole, optimizer=opt_state,
                               shard=shard if mine else None, index=g.rank, count=g.size,
                               shards={"count": g.size, "slices": slices},
                               group=g if mine else None)

    def _stage_parts(self, model, optimizer):
        """``checkpoint_parts`` under a pipeline: every rank of the first data-parallel
        replica (each stage, each of its tp ranks) writes a shard: its stage's tensors,
        each whole as one flat piece (parameters, buffers, optimizer slots and mixed
        precision's masters; under tensor parallelism its slices of the sliced ones, the
        rest from the stage's first tp rank; ZeRO's chunks: ``_chunk_parts``). The
        index names them all: what each holds goes round the writers (no
        tensor travels); a tensor two stages hold (a tied weight's copy) is the first
        one's."""
        from types import SimpleNamespace  # noqa: PLC0415

        self.gather_params()
        model_state = dict(model.state_dict())
        opt_state = optimizer.state_dict(copy=False)  # (written before the next step)
        g = self._stage_writers()  # (collective over the world)
        if g is None:  # another replica: the first one's shards hold the same
            return SimpleNamespace(model=None, optimizer=None, shard=None, shards=None,
                                   group=None)
        shard, slices, first = {}, {}, True
        if self.tp is not None:
            model_state, opt_state, shard, slices = self.tp.split_state(model_state,
                                                                        opt_state)
            first = self.tp_group.rank == 0
        masters = {} if self.precision is None else self.precision.master_arrays()
        tensors = [(["model", k], a) for k, a in model_state.items()]
        tensors += [(["optimizer", "state", k, slot], v)
                    for k, st in opt_state["state"].items() for slot, v in st.items()
                    if hasattr(v, "shape")]
        tensors += [(["runtime", "precision", "masters", k], m) for k, m in masters.items()]
        if not first:  # (the stage's replicated tensors: its first tp rank writes them)
            tensors = []
        steps = {k: {"step": int(st["step"])} for k, st in opt_state["state"].items()}
        tp_rank = 0 if self.tp is None else self.tp_group.rank
        with g.waiting("in the exchange of the pipeline stages' checkpoint index"):
            every = g.mpi.allgather(([[place, list(np.shape(a)), np.dtype(a.dtype).str]
                                      for place, a in tensors], steps,
                                     self.pp_group.rank, tp_rank, slices))
        # a tensor two stages hold is the first stage's (writers ordered stage by stage)
        held = {}
        for entries, _, stage, _, cut in every:
            for place in [tuple(e[0]) for e in entries] + [("slice", k) for k in cut]:
                held.setdefault(place, stage)
        me = self.pp_group.rank
        pieces = [[place, 0, to_numpy(a).reshape(-1)] for place, a in tensors
                  if held[tuple(place)] == me]
        flat, all_steps, sliced = [], {}, {}
        for i, (entries, st, stage, t, cut) in enumerate(every):
            flat += [e for e in entries if held[tuple(e[0])] == stage]
            all_steps = {**st, **all_steps}
            for k, (dim, full) in cut.items():
                if held[("slice", k)] == stage:
                    sliced.setdefault(k, [dim, full, []])[2].append((t, i))
        slices = {k: [dim, full, [i for _, i in sorted(files)]]
                  for k, (dim, full, files) in sliced.items()}
        shard = {"pieces": pieces, **shard}
        return SimpleNamespace(model={}, optimizer=dict(opt_state, state=all_steps),
                               shard=shard, index=g.rank, count=g.size,
                               shards={"count": g.size, "flat": flat, "slices": slices},
                               group=g)

    def _chunk_parts(self, model, optimizer):
        """``checkpoint_parts`` of ZeRO under a pipeline or tensor parallelism (or both):
        every rank writes the elements of its chunks (``zero.Sharded.checkpoint_pieces``),
        of its stage's buckets and of its slices; those of a sliced tensor go under
        ``["tp", t, ...]``, its tp rank's slice, which ``checkpoint.load`` joins from the
        pieces and then joins along the slice's dimension (``shards["flat_slices"]``). A
        tensor the tp ranks hold alike is written by tp rank 0's dp group, the buffers by
        each stage's first replica, a tensor two stages hold (a tied weight's copy) by
        the first stage. The index's entries go round the world (no tensor travels)."""
        from types import SimpleNamespace  # noqa: PLC0415

        placement, tp = self.placement, self.tp
        t = 0 if tp is None else self.tp_group.rank
        stage = 0 if self.pp is None else self.pp_group.rank
        slices = {} if tp is None else tp.slices

        def name_of(place):  # model/<name>, optimizer/state/<name>/<slot>,
            return place[{"model": 1, "optimizer": 2}.get(place[0], 3)]  # runtime/../<name>

        def mine(place):
            return ["tp", t] + place if name_of(place) in slices else place

        entries, steps = placement.checkpoint_index()
        pieces = placement.checkpoint_pieces()
        if self.shard()[0] == 0:  # the first replica: the buffers too
            for k, v in model.state_dict().items():
                if k not in placement.of_param:
                    a = to_numpy(v)
                    entries.append([["model", k], list(a.shape), np.dtype(a.dtype).str])
                    pieces.append([["model", k], 0, a.reshape(-1)])
        else:  # (the first replica's entries name every tensor)
            entries = []
        whole = t == 0  # (the tensors a tp group holds alike: its first rank's dp group)
        entries = [[mine(p), shape, dtype] for p, shape, dtype in entries
                   if whole or name_of(p) in slices]
        pieces = [[mine(p), first, a] for p, first, a in pieces
                  if whole or name_of(p) in slices]
        g = self.comm
        with g.waiting("in the exchange of the ZeRO checkpoint's index"):
            every = g.mpi.allgather((entries, steps, stage))
        flat, holder = self._first_holders([ents for ents, _, _ in every])
        pieces = [p for p in pieces if tuple(p[0]) not in holder
                  or every[holder[tuple(p[0])]][2] == stage]
        all_steps = {}
        for _, st, _ in every:
            all_steps = {**st, **all_steps}
        shards = {"count": g.size, "flat": flat}
        if tp is not None:
            cut = sorted({tuple(e[0][2:]) for e in flat if e[0][0] == "tp"}, key=str)
            shards["flat_slices"] = {"degree": self.tp_group.size, "tensors": [
                [list(p), slices[name_of(p)].dim, slices[name_of(p)].full] for p in cut]}
        return SimpleNamespace(model={}, optimizer=dict(optimizer.state_dict(copy=False),
                                                        state=all_steps),
                               shard={"pieces": pieces}, index=g.rank, count=g.size,
                               shards=shards, group=g)

    @staticmethod
    def _first_holders(every):
        """The checkpoint index's entries gathered from its writers (a list of ``[place,
        shape, dtype]`` per writer, in rank order, or None): each place's entry once, the
        first holder's (a tensor two stages hold is the first stage's), and {place: the
        position of its first holder in ``every``}."""
        flat, holder = [], {}
        for i, entries in enumerate(every):
            for e in entries or ():
                if tuple(e[0]) not in holder:
                    holder[tuple(e[0])] = i
                    flat.append(e)
        return flat, holder

    def _stage_writers(self):
        """The ranks of the first data-parallel replica (every stage and tp rank), the
        ones that write a pipeline's checkpoint shards, as a group (made once: collective
        over the world); None on the other replicas."""
        if not hasattr(self, "_writers"):
            writer = self.shard()[0] == 0
            self._writers = self.comm.split(0 if writer else None, self.rank,
                                            label="checkpoint writers")
        return self._writers

    @staticmethod
    def shards_written(parts):
        """Collective over the ranks that write shards (``parts.group``): every shard is
        on disk (the root writes the index only after)."""
        g = parts.group
        if g is None:
            return
        with g.waiting("in the barrier after writing checkpoint shards"):
            g.mpi.Barrier()

    def rank_shards_written(self):
        """Collective over the world: every rank's own shard is on disk."""
        if self.comm is not None and self.size > 1:
            with self._waiting("barrier after writing the ranks' own shards", world=True):
                self.comm.mpi.Barrier()

    def parameters_finite(self, model, parts):
        """Whether every parameter of the checkpoint ``parts`` describes is finite. When
        shards are written, collective over their writers (``parts.group``), who agree:
        each checks what it writes (ZeRO over data parallelism: its chunks); otherwise
        this rank's parameters (the root's are the checkpoint's)."""
        if self.zero_chunks or self.tp_chunks:
            finite = self.placement.chunks_finite()
        else:
            finite = all(np.isfinite(to_numpy(p.data)).all() for _, p in
                         model.named_parameters())
        g = parts.group
        if g is None:
            return finite
        flag = np.array([0 if finite else 1], dtype=np.int32)
        g.allreduce(flag, out=flag, op="max", algorithm="mpi", name="checkpoint.finite")
        return not flag[0]

    def load_full_state(self, model, optimizer, model_state, opt_state=None):
        """Load a whole model's state (and its optimizer's) saved under any layout into
        this rank's part of the model. Its tensors may be ``Deferred`` (a checkpoint left
        on disk, ``checkpoint.load(path, read=False)``): only this rank's part is read,
        one tensor at a time, as the model and the optimizer load them."""
        if self.pp is not None:  # this rank's stages
            model_state, opt_state = self._stage_state(model, optimizer, model_state,
                                                       opt_state)
        if self.zero_chunks:  # ZeRO: this rank's chunks, read piece by piece
            placement, gathers = self.placement, self.placement.sync.gathers
            if gathers is not None and not gathers.pinned:  # (stage 3, never whole)
                placement.load_params(model, model_state)
            else:  # (the parameters are whole on every rank)
                model.load_state_dict(model_state)
            if opt_state is not None:  # cut into the shards by ``import_state``
                optimizer.load_state_dict(opt_state, read=False)
            return
        self.gather_params()  # (ZeRO stage 3: the parameters to load into, gathered)
        if self.tp is not None:
            model_state = self.tp.local_state(model_state)
            if opt_state is not None:
                opt_state = self.tp.local_optimizer_state(opt_state)
        model.load_state_dict(model_state)
        if opt_state is not None:
            optimizer.load_state_dict(opt_state)

    @staticmethod
    def _stage_state(model, optimizer, model_state, opt_state):
        """A whole model's (model state, optimizer state) cut to this rank's stages."""
        mine = set(model.state_dict())
        model_state = {k: v for k, v in model_state.items() if k in mine}
        if opt_state is not None:
            held = set(optimizer.params)
            opt_state = dict(opt_state, state={k: v for k, v in
                                               opt_state.get("state", {}).items()
                                               if k in held})
        return model_state, opt_state

    def full_shapes(self, model):
        """{name: shape} of the whole model's state (what a checkpoint holds)."""
        if self.pp is not None:
            return dict(self.pp.whole_shapes)
        if self.tp is not None:
            return self.tp.full_shapes(model)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}

    # -- collectives for the trainer (over the training ranks)
    def _before_collective(self):
        for _, s in self.syncs:
            s.before_collective()

    def _trainers(self):
        """The mpi4py communicator of the training ranks (None for one process)."""
        if self.comm is None or self.size == 1:
            return None
        return self.group.mpi if self.group is not None else None

    def _waiting(self, what, world=False):
        """The stall inspector's mark while a collective below runs on the raw mpi4py
        communicator of the trainers (or the world): a stopped rank is named there too."""
        comm = self.comm if world or self.group is None else self.group
        return comm.waiting(f"in the runtime's {what}")

    def reduce(self, values, op="mean"):
        """{name: float} summed ("sum") or averaged ("mean") over the training ranks, in
        rank order on every rank (the same bits everywhere, whatever MPI does)."""
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce op must be 'sum' or 'mean', got {op!r}")
        self._before_collective()
        comm = self._trainers()
        if comm is None:
            return {k: float(v) for k, v in values.items()}
        keys = sorted(values)
        with self._waiting(f"all-gather of {', '.join(keys)}"):
            rows = comm.allgather([float(values[k]) for k in keys])
        totals = [0.0] * len(keys)
        for row in rows:
            totals = [t + v for t, v in zip(totals, row)]
        if op == "mean":
            totals = [t / len(rows) for t in totals]
        return dict(zip(keys, totals))

    def average(self, values):
        return self.reduce(values, "mean")

    def gather(self, obj):
        """Every training rank's ``obj`` as a list on the root, None elsewhere."""
        self._before_collective()
        comm = self._trainers()
        if comm is None:
            return [obj]
        with self._waiting("gather to the root"):
            return comm.gather(obj, root=0)

    def share(self, obj, copies=None):
        """The root's ``obj`` on every training rank (collective over them only), or with
        ``copies`` on the first ``copies`` of them only (None elsewhere)."""
        self._before_collective()
        comm = self._trainers()
        if comm is None:
            return obj
        if copies is None:
            with self._waiting("broadcast to the training ranks"):
                return comm.bcast(obj, root=0)
        me = comm.Get_rank()
        with self._waiting(f"hand-over to the first {copies} training rank(s)"):
            if me == 0:
                for r in range(1, min(copies, comm.Get_size())):
                    comm.send(obj, dest=r, tag=0)
                return obj if copies > 0 else None
            return comm.recv(source=0, tag=0) if me < copies else None

    def bcast(self, obj):
        """The root's ``obj`` on every rank (servers included)."""
        if self.comm is None or self.size == 1:
            return obj
        with self._waiting("broadcast from the root", world=True):
            return self.comm.mpi.bcast(obj, root=self.trainer_ranks[0])

    def barrier(self):
        self._before_collective()
        comm = self._trainers()
        if comm is not None:
            with self._waiting("barrier"):
                comm.Barrier()

    def agree_max(self, value):
        """The largest of the integer ``value`` over the training ranks (one 8-byte
        all-reduce: cheap enough for every step; the trainer agrees on a stop signal
        with it)."""
        self._before_collective()
        comm = self._trainers()
        if comm is None:
            return int(value)
        import numpy as np  # noqa: PLC0415
        from mpi4py import MPI  # noqa: PLC0415

        buf = np.array([int(value)], dtype=np.int64)
        with self._waiting("agreement on a stop signal"):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        return int(buf[0])

    # -- checkpoints
    def state_dict(self):
        """The syncs' state, every training rank's gathered on the root (collective over
        the training ranks): error-feedback residuals, the servers' optimizer state, ...
        ZeRO's optimizer state (and masters) is gathered on the root too, into the
        optimizer's per-parameter state (with tensor or pipeline parallelism, on each
        group's first rank)."""
        return self._state(sharded=False, own=None)

    def checkpoint_state(self, step):
        """Collective, for checkpoint ``step``, whose shards hold the tensors
        (``checkpoint_parts``): ``(the runtime's part of the index, on the root (None
        elsewhere), own)``. Every rank's own state (error-feedback residuals, model
        averaging's parameters and inner optimizer, an asynchronous pipeline's pending
        gradient) stays on its rank for its rank shard and only its skeleton is gathered
        (not with parameter servers, whose state travels with the first worker's):
        ``own.arrays`` are this rank's ``(place, array)``, ``own.index`` of
        ``own.count`` its rank shard's number, ``own.files`` the rank shards the ranks
        holding any write, ``own.flat`` the index's entries for them (both alike on
        every rank). ZeRO over data parallelism gathers nothing; mixed precision's
        masters are left to the shards under it and under a pipeline."""
        from types import SimpleNamespace  # noqa: PLC0415

        from mpidl.training.checkpoint import shard_name  # noqa: PLC0415

        servers = bool(self.roles.get("server"))
        arrays = None if servers else []
        state = self._state(sharded=True, own=arrays)
        arrays = arrays or []
        entries = [[place, list(np.shape(a)), np.dtype(a.dtype).str] for place, a in arrays]
        every = [entries]
        if not servers and self.comm is not None and self.size > 1:  # (world = trainers)
            with self._waiting("all-gather of the ranks' own checkpoint entries",
                               world=True):
                every = self.comm.mpi.allgather(entries)
        n = len(every)
        return state, SimpleNamespace(
            arrays=arrays, index=0 if self.comm is None else self.rank, count=n,
            files=[shard_name(step, i, n, "rank") for i, e in enumerate(every) if e],
            flat=[e for entries in every for e in entries])

    def _per_rank(self, obj, key, own, world=False):
        """Every training rank's ``obj`` as a list on the root (a per-rank entry of the
        state), over the data-parallel group or (``world``) the world. ``own``: a list
        taking this rank's arrays with their places (``runtime/<key>/<position in the
        list>/...``), which leave only their skeleton to gather (over the data-parallel
        group only when it is every rank: otherwise the arrays travel as before)."""
        everyone = world or self.comm is None or self.group is None or \
            self.group.size == self.size
        if own is not None and everyone:
            position = 0 if self.comm is None else (
                self.rank if world or self.group is None else self.group.rank)
            from mpidl.training.checkpoint import split_arrays  # noqa: PLC0415

            obj, arrays = split_arrays(obj, ["runtime", *key, position])
            own.extend(arrays)
        if not world:
            return self.gather(obj)
        with self._waiting(f"gather of the ranks' {'/'.join(key)} state", world=True):
            return self.comm.mpi.gather(obj, root=self.trainer_ranks[0])

    def _state(self, sharded, own):
        self.sync_buffers()
        export = getattr(getattr(self, "placement", None), "export_state", None)
        if export is not None and self.trains_on_data and not (
                sharded and (self.zero_chunks or self.tp_chunks)):
            export(self)  # ZeRO: the shards' optimizer state, per parameter on the root
        pending = self._pipeline_pending(own)
        mine = [s.state_dict() for _, s in self.syncs]
        if self.pp is None:
            out = {"syncs": self._per_rank(mine, ["syncs"], own)}
        else:  # a stage's syncs hold its own parameters' state: every rank's, in order
            out = {"syncs": self._per_rank(mine, ["syncs"], own, world=True),
                   "syncs_layout": self._pipeline_layout()}
        if pending is not None:
            out["pipeline_pending"] = pending
        if self.precision is not None:  # master weights and loss scale: alike on every rank
            out["precision"] = self.precision.state_dict(
                masters=not (sharded and (self.zero_chunks or self.pp is not None)))
        avg = self.averaging
        if avg is not None:  # the replicas differ inside a period: every rank's own
            out["averaging"] = avg.shared_state()
            mine = avg.local_state(copy=own is None)  # (a rank shard writes them at once)
            if not self._split_model:
                out["averaging_ranks"] = self._per_rank(mine, ["averaging_ranks"], own)
            else:  # a stage's (a slice's) outer state is of its own parameters: every
                # rank's, in order
                mine["shared"] = avg.shared_state()
                out["averaging_layout"] = self._pipeline_layout()
                out["averaging_ranks"] = self._per_rank(mine, ["averaging_ranks"], own,
                                                        world=True)
        return out if self.is_root else None

    def local_state(self):
        """What ``state_dict`` saves, from this rank alone, for runtimes whose ranks hold
        the same state (``resizable``): no communication (an elastic run's commit)."""
        import copy  # noqa: PLC0415

        out = {"syncs": []}
        if self.precision is not None:
            out["precision"] = copy.deepcopy(self.precision.state_dict())
        avg = self.averaging
        if avg is not None:
            out["averaging"] = copy.deepcopy(avg.shared_state())
            out["averaging_ranks"] = [copy.deepcopy(avg.local_state())]
        return out

    def _pipeline_layout(self):
        return [self.pp_degree, 1 if self.tp is None else self.tp.degree, self.size]

    def _pipeline_pending(self, own=None):
        """An asynchronous pipeline's checkpoint: the pipeline drained, every rank's
        pending gradient (the step after the checkpoint applies it) gathered on the root
        with the layout (``own``: see ``_per_rank``); None for other steps. Collective
        over the world."""
        if self.pp is None or not self.pp.plan.flushless or not self.trains_on_data:
            return None
        every = self._per_rank(self.pp.pending_state(), ["pipeline_pending", "ranks"], own,
                               world=True)
        return {"layout": self._pipeline_layout(), "ranks": every}

    def _resume_pending(self, saved):
        """This rank's pending gradient from a checkpoint, to an asynchronous pipeline; a
        checkpoint written under another layout (or a schedule that applies gradients at
        once) cannot hand it over: said in one warning line, and the step is dropped."""
        from mpidl.training.log import get_logger  # noqa: PLC0415

        flushless = self.pp is not None and self.pp.plan.flushless
        layout = self._pipeline_layout()
        mine = None
        if saved is not None and flushless and list(saved["layout"]) == layout:
            mine = values_of(saved["ranks"][self.rank])  # (its own rank shard's)
        elif saved is not None and self.is_root:
            P, T, n = saved["layout"]
            now = ("--schedule async" + f" with {layout[0]} stages x {layout[1]} tensor-"
                   f"parallel on {layout[2]} ranks" if flushless else "a schedule that "
                   "applies each step's gradient at once")
            get_logger().warning(
                f"--resume: the checkpoint's asynchronous pipeline ({P} stages x {T} "
                f"tensor-parallel on {n} ranks) had one step's gradient still to apply; "
                f"{now} cannot take it over, so that step's update is dropped (resume with "
                "the layout it was written with to continue exactly)")
        if flushless:
            self.pp.resume_pending(mine)

    @property
    def _split_model(self):
        """Whether this rank holds a part of the model (a pipeline stage, tensor-parallel
        slices) that the data-parallel group's root does not hold."""
        return self.pp is not None or (self.tp is not None and not self.tp.over_dp)

    def _resume_averaging_stage(self, avg, saved, ranks):
        """Model averaging under a pipeline or tensor parallelism: every rank goes on with
        its own saved parameters and inner and outer state, which are its stage's (its
        slices'), so only under the layout the checkpoint was written with (one
        ConfigError line otherwise)."""
        refusal = self._layout_refusal(
            saved, f"--sync {avg.name} state", "model averaging over pipelines or tensor "
            "parallelism resumes only under the layout it was written with")
        if refusal is not None:
            raise refusal
        entry = values_of(ranks[self.rank])
        avg.load_state(entry["shared"], entry)

    def load_state_dict(self, state):
        """Every rank takes its own part of what ``state_dict`` saved (when the number of
        training ranks is the same; parameter servers take their shard's in any case)."""
        per_rank = (state or {}).get("syncs") or []
        if self.role == "server":
            servers = next((st["servers"] for st in (per_rank[0] if per_rank else [])
                            if isinstance(st, dict) and st.get("servers")), None)
            if servers is not None:
                self.server.load_state_dict(servers)
            return
        self._resume_pending((state or {}).get("pipeline_pending"))
        load = getattr(getattr(self, "placement", None), "import_state", None)
        if load is not None:
            load()  # ZeRO: the optimizer's per-parameter state, cut into this rank's shards
        index, count = self.shard()
        if self.precision is not None and state is not None:
            self.precision.load_state_dict(state.get("precision"))
        avg = self.averaging
        if avg is not None and (state or {}).get("averaging") is not None:
            ranks = state.get("averaging_ranks") or []
            saved = state.get("averaging_layout")
            if self._split_model or saved is not None:  # each rank its own stage's
                self._resume_averaging_stage(avg, saved, ranks)
            else:
                # on another number of ranks, rank i goes on with the i-th saved rank's
                # own parameters and inner optimizer (the first ones again when there
                # are more)
                avg.load_state(state["averaging"],
                               values_of(ranks[index % len(ranks)]) if ranks else None)
        elif avg is not None and state is not None:
            from mpidl.errors import ConfigError  # noqa: PLC0415

            raise ConfigError(f"the checkpoint was written without --sync {avg.name}; "
                              "resume with the settings it was written with")
        saved = (state or {}).get("syncs_layout")
        if self.pp is not None or saved is not None:
            mine = self._stage_sync_state(saved, per_rank)
        elif len(per_rank) != count:
            return
        else:
            mine = per_rank[index]
        for (_, sync), st in zip(self.syncs, values_of(mine) or ()):
            sync.load_state_dict(st)

    def _stage_sync_state(self, saved, per_rank):
        """Under a pipeline, this rank's saved syncs' state (its own stage's), which
        only the layout it was written with can take: under another one, stateless syncs
        go on (None) and state that would be lost (compression's residuals) is one
        ConfigError line."""
        refusal = self._layout_refusal(
            saved, "gradient exchange state (error feedback residuals)",
            "resume under the layout it was written with", fits=len(per_rank) == self.size)
        if refusal is None:
            return per_rank[self.rank]
        if not any(st for entries in per_rank for st in (entries or ())):
            return None
        raise refusal

    def _layout_refusal(self, saved, what, advice, *, fits=True):
        """None when a checkpoint's per-rank ``what`` was saved under this run's layout
        ``saved`` (and ``fits``), else the one-line ConfigError to raise: per-rank state
        is a stage's (a slice's), which no other layout can take."""
        from mpidl.errors import ConfigError  # noqa: PLC0415

        layout = self._pipeline_layout()
        if saved is not None and list(saved) == layout and fits:
            return None
        return ConfigError(f"--resume: the checkpoint's {what} was written under "
                           f"{_layout_text(saved)}, this run has {_layout_text(layout)}; "
                           f"{advice}")

    def finish(self):
        """Once at the end: the syncs say goodbye; every rank ran the same steps; an
        asynchronous pipeline runs the backwards it carries, and drops their gradient (a
        step that was never applied, as when training stops at any step)."""
        if self.pp is not None and self.trains_on_data:
            self.pp.drain()
            self.pp.discard_pending()
        for _, s in self.syncs:
            s.finish_training()
        comm = self._trainers()
        if comm is not None and self.trains_on_data and self.broadcast_at_start:
            with self._waiting("all-gather of step counts at the end"):
                counts = comm.allgather(self.steps)
            if len(set(counts)) != 1:
                raise RuntimeError(f"{self.name}: ranks ran different numbers of steps "
                                   f"{counts}; every rank must see the same number of "
                                   "batches (use mpidl.data.BatchLoader's sharding)")


def _any_rank(groups, flag):
    """Whether ``flag`` holds on any rank of ``groups`` (collective over each in turn;
    MPI's own all-reduce, which the byte counters leave out)."""
    out = np.array([1 if flag else 0], dtype=np.int32)
    for group in groups:
        group.allreduce(out, out=out, op="max", algorithm="mpi", name="precision.overflow")
    return bool(out[0])


def _unique_nbytes(named_params):
    """Bytes of the parameters (a tied weight once)."""
    return sum({id(p): p.data.nbytes for _, p in named_params}.values())


def _sliced_over_dp(p):
    """A parameter whose ranks of the data-parallel group hold different slices."""
    pl = getattr(p, "placement", None)
    return pl is not None and pl.kind == "sharded" and pl.axis == "dp"

"""One training step of one process on a GPU, captured as a CUDA graph and replayed.

A small model's step is mostly kernel launches, each costing microseconds of Python and
driver time; the GPU idles in between. Captured once, the whole step (gradients cleared,
forward, loss, backward, optimizer update) replays as a single launch, the thing PyTorch's
eager mode cannot do. ``GraphedStep(model, loss, optimizer)(x, y)`` runs a step and
returns the loss as a 0-d device array, so the host never waits for the GPU.

How: a few eager warm-up steps on a private stream and memory pool (kernels compile,
cuBLAS and the pool settle), then one step under stream capture, replayed from then on.
The batch is copied into fixed input arrays before each replay. Everything a replay
writes stays at the addresses the capture saw: parameters and optimizer state are
updated in place, BatchNorm's running statistics too, and the arrays made during the
capture come from the private pool that nothing else allocates from.

Replays are the same kernels on the same addresses as the eager step, so they give
bitwise the same parameters (checked in ``tests/test_cuda_graph.py``).

Values passed to kernels are frozen into a graph, so what changes from step to step is
read from device memory, written before each replay: SGD's learning rate
(``SGD.lr_ref``), Adam's step size, bias correction and decoupled decay
(``Adam.scalars_ref``); schedules work. What it does not capture, falling back to eager
steps and saying why (``reason``): another optimizer; a model whose step waits for the
GPU inside (e.g. Dropout's call counter); parameters of mixed dtypes or on the host. A batch of
another shape than the captured one (an epoch's last, smaller batch) runs eagerly. MPI
calls cannot be captured: data-parallel steps stay eager.
"""

import numpy as np

from mpidl.backend import cupy_module, is_gpu_array
from mpidl.engine.optim import SGD, Adam


class GraphedStep:
    """Run training steps of ``model`` with ``loss`` and ``optimizer`` as CUDA-graph
    replays once captured; see the module docstring."""

    def __init__(self, model, loss, optimizer, warmup=2):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.warmup = int(warmup)
        self.graph = None
        self.reason = self._why_not()
        self.replays = 0
        self.eager_steps = 0
        self._shapes = None
        self._warmed = 0
        if self.reason is None:
            cp = cupy_module()
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.pool = cp.cuda.MemoryPool()
            self._dtype = next(iter(optimizer.params.values())).data.dtype
            if isinstance(optimizer, SGD):
                self._lr_value = float(optimizer.lr)
                self._lr_ref = cp.full(1, self._lr_value, dtype=self._dtype)
                optimizer.lr_ref = self._lr_ref
            else:
                self._scalars_ref = cp.zeros(3, dtype=self._dtype)
                optimizer.scalars_ref = self._scalars_ref

    @property
    def captured(self):
        return self.graph is not None

    def _why_not(self):
        if cupy_module() is None:
            return "CuPy is not installed"
        params = list(self.optimizer.params.values())
        if not params:
            return "the optimizer holds no parameters"
        if not all(is_gpu_array(p.data) for p in params):
            return "the parameters are not on the GPU"
        if len({p.data.dtype for p in params}) != 1:
            return "the parameters have mixed dtypes"
        if not isinstance(self.optimizer, (SGD, Adam)):
            return (f"{type(self.optimizer).__name__}: only SGD and Adam/AdamW read their "
                    "per-step values from device memory, which a graph needs")
        if self.optimizer.fused is False:
            return "the optimizer was built with fused=False"
        if not hasattr(self.loss, "forward_array"):
            return f"{type(self.loss).__name__} has no forward_array (its value would wait)"
        return None

    # -- one step, eagerly
    def _step(self, x, y, check_labels=True):
        self.optimizer.zero_grad()
        out = self.model.forward(x)
        value = self.loss.forward_array(out, y, check_labels=check_labels)
        self.model.backward(self.loss.backward())
        self.optimizer.step()
        return value

    def _sync_scalars(self):
        """Write what the next update reads from device memory (on the step's stream):
        SGD's learning rate; Adam's ``step_scalars`` of its next update number."""
        opt = self.optimizer
        if isinstance(opt, SGD):
            lr = float(opt.lr)
            if lr != self._lr_value:
                self._lr_ref.fill(lr)
                self._lr_value = lr
            return
        steps = {st["step"] for st in opt.state.values()}
        if len(steps) > 1:
            self._give_up("the parameters' Adam update counts differ (one scalar set "
                          "serves them all)")
            return
        t = (steps.pop() if steps else 0) + 1
        host = np.array(opt.step_scalars(t), dtype=self._dtype)
        self._scalars_ref.set(host, stream=self.stream)

    def _give_up(self, reason):
        """Eager steps from now on, with values passed to kernels as before."""
        self.reason = reason
        self.graph = None
        self.optimizer.lr_ref = self.optimizer.scalars_ref = None

    def __call__(self, x, y):
        """One training step on the batch ``(x, y)`` (device or host arrays); returns
        the batch's mean loss as a 0-d device array."""
        cp = cupy_module()
        if self.reason is not None:
            self.eager_steps += 1
            return self._step(x, y)
        x, y = cp.asarray(x), cp.asarray(y)
        caller = cp.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with self.stream:
            self._sync_scalars()
            if self.graph is None and self.reason is None and self._warmed >= self.warmup:
                self._capture(x, y)
            if self.graph is not None and (x.shape, x.dtype, y.shape) == self._shapes:
                self._x[...] = x
                self._y[...] = y
                self.graph.launch(self.stream)
                for name in self._stepped:
                    self.optimizer.state[name]["step"] += 1
                for p, grad in self._grads:  # an eager step since may have rebound them
                    p.grad = grad
                self.replays += 1
                value = self._loss.copy()
            elif self.graph is None and self.reason is None:  # warming up
                with cp.cuda.using_allocator(self.pool.malloc):
                    value = self._step(x, y)
                self._warmed += 1
                self.eager_steps += 1
            else:  # a batch of another shape, or capture failed: not from the private pool
                value = self._step(x, y)
                self.eager_steps += 1
        caller.wait_event(self.stream.record())
        return value

    def _capture(self, x, y):
        """Capture one step on fixed input arrays and run it once (the capture itself
        runs nothing); on failure, record the reason and stay eager."""
        cp = cupy_module()
        steps = {name: st["step"] for name, st in self.optimizer.state.items()}
        with cp.cuda.using_allocator(self.pool.malloc):
            self._x, self._y = x.copy(), y.copy()
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                loss = self._step(self._x, self._y, check_labels=False)
            except Exception as e:  # something in the step waited for the GPU
                try:
                    self.stream.end_capture()
                except Exception:
                    pass
                for name, st in self.optimizer.state.items():
                    st["step"] = steps.get(name, st["step"])
                self.optimizer.zero_grad()
                self._give_up(f"the step cannot be captured: {type(e).__name__}: {e}")
                return
            self.graph = self.stream.end_capture()
        self._loss = loss
        self._grads = [(p, p.grad) for p in self.optimizer.params.values()]
        self._shapes = (x.shape, x.dtype, y.shape)
        # the capture counted one update per parameter; the replays count theirs
        self._stepped = [name for name, st in self.optimizer.state.items()
                         if st["step"] != steps.get(name)]
        for name in self._stepped:
            self.optimizer.state[name]["step"] -= 1

    def __repr__(self):
        state = ("captured" if self.graph is not None else
                 f"eager ({self.reason})" if self.reason else "warming up")
        return f"GraphedStep({state}, {self.replays} replays, {self.eager_steps} eager steps)"

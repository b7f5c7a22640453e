"""Gradient-ready hooks: tell a listener which gradients a backward pass has finished.

Data parallelism starts a bucket's all-reduce as soon as its gradients are final, while
backward goes on; pipeline and ZeRO schedules will do the same. A gradient is final once
every layer that *uses* the parameter has run its backward in this pass, which with weight
tying (a transformer's embedding and output layer share one matrix) is not the moment the
first user finishes. So one ``GradReadyHook`` object per listener is installed on every
module under the layer it was added to; it knows, per parameter, how many modules hold it
(counted once, at registration) and counts down as each of them finishes
``Layer.backprop``; at zero the name is reported and the count starts over for the next
pass (no explicit "pass begins" call needed).

Limits, by construction: the count is taken at registration, so a model whose structure
changes afterwards needs a new hook; every user of a parameter must run its backprop once
per pass (a layer skipped in some passes would shift the count); a container that calls ``child.backward`` instead of
``child.backprop`` bypasses the hooks of that subtree (its gradients are still correct and
accumulated; the listener just hears nothing of them, so data parallelism packs them after
backward).
"""


class GradReadyHook:
    """Calls ``fn(names)`` with the dotted names (relative to ``root``) of the parameters
    whose gradient became final when a module under ``root`` finished its backprop."""

    def __init__(self, root, fn):
        if not callable(fn):
            raise TypeError(f"add_grad_ready_hook needs a callable fn(names), got {fn!r}")
        self.fn = fn
        # the first dotted name of each parameter, as named_parameters() reports it
        self.names = {id(p): name for name, p in root.named_parameters()}
        self.own = {}    # id(module) -> ids of the parameters it holds itself
        self.users = {}  # id(parameter) -> how many modules hold it
        modules = []
        for _, module in root.modules():
            if id(module) in self.own:  # one module instance reached twice: count it once
                continue
            ids = tuple(id(p) for p in module._params.values())
            self.own[id(module)] = ids
            for pid in ids:
                self.users[pid] = self.users.get(pid, 0) + 1
            modules.append(module)
        self.left = dict(self.users)
        for module in modules:
            module._grad_hooks.append(self)

    def layer_done(self, module):
        """``module``'s backprop finished: count down its parameters; report the finals."""
        names = None
        left = self.left
        for pid in self.own.get(id(module), ()):
            n = left[pid] - 1
            if n:
                left[pid] = n
                continue
            left[pid] = self.users[pid]  # final for this pass; armed for the next one
            if names is None:
                names = []
            names.append(self.names[pid])
        if names:
            self.fn(names)

    def __repr__(self):
        return f"GradReadyHook({self.fn!r}, {len(self.names)} parameters)"

"""2-byte working copies: under ``--precision bf16|fp16`` a parameter's working copy is
held in the format (float16, or bfloat16 words) and decoded into float32 only while its
layer computes.

ZeRO's formula counts a mixed-precision model's parameters at 2 bytes each (Rajbhandari
et al., SC20: (2 + 2 + 12)Ψ for Adam). On a CPU the layers compute in float32 (BLAS has
no 2-byte GEMM and NumPy no bfloat16), so a float32 array of each weight must exist
while its layer runs forward or backward, and at no other time: a pre-forward /
pre-backward hook on every layer that holds parameters (``Layer.add_pre_hook``) decodes
that layer's parameters into fresh float32 arrays (``Parameter.data``) and lets go of
the ones the pass has left behind; between passes each parameter's ``data`` is a
placeholder (``zero._Freed``) that names it and refuses any use. Values on the format's
grid decode exactly, so training is bitwise what float32 working copies holding the
same values gave.

Evaluation, checkpoints and ``--save`` read the parameters whole: ``materialize``
decodes all of them and keeps them (*pinned*, the hooks do nothing) until the next step,
whose ``unpin`` takes them back into the format (a value written into them meanwhile,
by a checkpoint's load, is rounded to the format as the optimizer's updates are) and
frees the float32 arrays. Set-up leaves them pinned.

ZeRO stage 3 keeps its own 2-byte chunks and gathers (``zero.ParamGathers``); this is
stages 0-2, where every rank holds the whole working copy: ``words`` come from the
caller (stages 1-2: views of each bucket's 2-byte buffer, which the shards' all-gather
fills directly; stage 0: arrays of their own).
"""

import numpy as np

from mpidl.backend import array_module


class WorkingCopies:
    """The 2-byte working copies ``words`` (``{name: array shaped like the parameter}``)
    of the model's parameters ``named`` and the hooks that decode them (module doc)."""

    def __init__(self, wire, model, named, words):
        from mpidl.runtime.zero import param_layers  # noqa: PLC0415

        self.wire = wire
        self.words = words
        self.params = {n: p for n, p in named if n in words}
        name_of = {id(p): n for n, p in self.params.items()}
        # id(layer) -> the names of its own parameters, which it computes with (a layer
        # that used another's would meet a placeholder: one clear error, ``_HINT``)
        self.needs = {}
        for m, ps in param_layers(model):
            names = [name_of[id(p)] for p in ps if id(p) in name_of]
            if names:
                self.needs[id(m)] = names
                m.add_pre_hook(self._before)
        self.decoded = {n: p.data for n, p in self.params.items()}  # set-up: all of them
        self.pinned = True

    # -- the hooks
    def _before(self, layer, phase):
        if self.pinned:
            return
        need = self.needs.get(id(layer))
        if need is None:
            return
        # (forward's last layer is backward's first: what it holds, it keeps)
        for n in [n for n in self.decoded if n not in need]:
            self._release(n)
        for n in need:
            if n not in self.decoded:
                self._decode(n)

    def _decode(self, n):
        w = self.words[n]
        out = array_module(w).empty(w.shape, dtype=np.float32)
        self.wire.decode(w, out=out)
        self.params[n].data = self.decoded[n] = out

    def _release(self, n):
        from mpidl.runtime.zero import _Freed  # noqa: PLC0415

        a = self.decoded.pop(n)
        self.params[n].data = _Freed(n, a.shape, a.dtype, hint=_HINT)

    def release_all(self):
        """Free every decoded array (backward is over)."""
        if self.pinned:
            return
        for n in list(self.decoded):
            self._release(n)

    # -- whole, for evaluation and checkpoints
    def materialize(self):
        """Every parameter decoded and kept until the next step's ``unpin``."""
        if self.pinned:
            return
        self.release_all()
        for n in self.params:
            self._decode(n)
        self.pinned = True

    def unpin(self):
        """The start of a step: the (possibly reloaded) decoded values back into the
        format, and every float32 array freed."""
        if not self.pinned:
            return
        for n, a in self.decoded.items():
            self.wire.encode(a, 1.0, self.words[n])
        self.pinned = False
        self.release_all()

    def store(self, n, values):
        """Parameter ``n``'s working copy becomes float32 ``values`` rounded to the format
        (an update's masters); a decoded copy too, if it is held."""
        self.wire.encode(values, 1.0, self.words[n])
        self.refresh(n)

    def refresh(self, n):
        """Decode ``words[n]`` again into the float32 array held for it, if any (its words
        were written directly: a ZeRO all-gather, a checkpoint's load)."""
        a = self.decoded.get(n)
        if a is not None:
            self.wire.decode(self.words[n], out=a)

    def memory(self, ledger):
        """The 2-byte working copies (parameters); the decoded arrays are the parameters'
        ``data``, which the runtime counts."""
        ledger.add("mem_params", list(self.words.values()))


_HINT = ("under --precision bf16/fp16 a parameter is held in the 2-byte format between "
         "passes and decoded only inside its layer's own forward (layer(x)) and backprop; "
         "it was used outside them (to read the parameters after training steps, call "
         "runtime.gather_params() first; in a layer of your own, call its children as "
         "layer(x) and layer.backprop(dy))")

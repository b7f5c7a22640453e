"""Gradient clipping by global norm: scale every gradient by ``min(1, max_norm / ||g||)``,
``||g||`` the L2 norm of all gradients together (DQN's guard against rare huge steps)."""

import math

from mpidl.backend import array_module
from mpidl.engine.module import SparseGrad


def clip_grad_norm(params, max_norm):
    """Clip the ``grad`` of ``params`` ((name, Parameter) pairs or Parameters) in place;
    returns the norm before clipping."""
    grads = []
    for item in params:
        p = item[1] if isinstance(item, tuple) else item
        if p.grad is not None:
            if isinstance(p.grad, SparseGrad):
                raise TypeError("clip_grad_norm takes dense gradients only")
            grads.append(p)
    total = 0.0
    for p in grads:
        total += float(array_module(p.grad).sum(p.grad * p.grad))
    norm = math.sqrt(total)
    if max_norm is not None and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-12)
        for p in grads:
            p.grad = p.grad * p.grad.dtype.type(scale)
    return norm

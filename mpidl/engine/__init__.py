"""The layer-based NN engine: layers with manual backward, losses, optimizers."""

from mpidl.engine.module import Layer, Parameter, Sequential, ShapeError, SparseGrad

__all__ = ["Layer", "Parameter", "Sequential", "ShapeError", "SparseGrad"]

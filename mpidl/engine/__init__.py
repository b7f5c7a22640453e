"""The layer-based NN engine: layers with manual backward, losses, optimizers.

Arrays are NumPy on CPU and CuPy on GPU (``mpidl.backend``); every layer dispatches on
its input's type. float32 by default, float64 supported (``dtype=`` on each layer).
"""

from mpidl.engine.activations import GELU, LeakyReLU, ReLU, Sigmoid, Tanh
from mpidl.engine.conv import Conv2d
from mpidl.engine.dropout import Dropout
from mpidl.engine.embedding import Embedding
from mpidl.engine.linear import Linear
from mpidl.engine.losses import MSELoss, SoftmaxCrossEntropy
from mpidl.engine.metrics import accuracy
from mpidl.engine.models import MODEL_DEFAULTS, MODELS, build_model
from mpidl.engine.module import Layer, Parameter, Sequential, ShapeError, SparseGrad
from mpidl.engine.normalization import (BatchNorm1d, BatchNorm2d, LayerNorm,
                                        convert_sync_batchnorm)
from mpidl.engine.optim import SGD, Adam, AdamW, make_optimizer
from mpidl.engine.placement import Placement
from mpidl.engine.pooling import AvgPool2d, GlobalAvgPool2d, MaxPool2d
from mpidl.engine.reshape import Flatten, Reshape
from mpidl.engine.residual import Residual, basic_block
from mpidl.engine.schedules import make_schedule

__all__ = [
    "Adam", "AdamW", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv2d", "Dropout",
    "Embedding", "Flatten", "GELU", "GlobalAvgPool2d", "Layer", "LayerNorm", "LeakyReLU",
    "Linear", "MODELS", "MODEL_DEFAULTS", "MSELoss", "MaxPool2d", "Parameter", "Placement",
    "ReLU", "Reshape", "Residual", "SGD", "Sequential", "ShapeError", "Sigmoid",
    "SoftmaxCrossEntropy", "SparseGrad", "Tanh", "accuracy", "basic_block", "build_model",
    "convert_sync_batchnorm", "make_optimizer", "make_schedule",
]

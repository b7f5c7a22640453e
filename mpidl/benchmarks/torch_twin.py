"""A PyTorch copy of an mpidl model: the same layers with the same weights.

The engine benchmark times both on the same device, and checks that they compute the
same loss on the same batch (a benchmark of two different computations proves nothing).
Covers the layers of the model zoo: Sequential, Flatten, Linear, ReLU, Conv2d,
BatchNorm1d/2d, MaxPool2d, AvgPool2d, GlobalAvgPool2d and Residual; anything else raises.
"""

from mpidl.backend import to_numpy


def torch_twin(model, torch, device="cpu"):
    """A ``torch.nn.Module`` computing what ``model`` computes, on ``device``."""
    return _twin(model, torch).to(device)


def _tensor(torch, a, transpose=False):
    t = torch.from_numpy(to_numpy(a).copy())
    return t.t().contiguous() if transpose else t


def _twin(layer, torch):
    from mpidl.engine.activations import ReLU  # noqa: PLC0415
    from mpidl.engine.conv import Conv2d  # noqa: PLC0415
    from mpidl.engine.linear import Linear  # noqa: PLC0415
    from mpidl.engine.module import Sequential  # noqa: PLC0415
    from mpidl.engine.normalization import _BatchNorm  # noqa: PLC0415
    from mpidl.engine.pooling import GlobalAvgPool2d, MaxPool2d  # noqa: PLC0415
    from mpidl.engine.reshape import Flatten  # noqa: PLC0415
    from mpidl.engine.residual import Residual  # noqa: PLC0415

    nn = torch.nn
    if isinstance(layer, Sequential):
        return nn.Sequential(*[_twin(child, torch) for child in layer.layers])
    if isinstance(layer, Flatten):
        return nn.Flatten()
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, Linear):
        t = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        with torch.no_grad():
            t.weight.copy_(_tensor(torch, layer.weight.data, transpose=True))
            if layer.bias is not None:
                t.bias.copy_(_tensor(torch, layer.bias.data))
        return t
    if isinstance(layer, Conv2d):
        t = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                      stride=layer.stride, padding=layer.padding, bias=layer.bias is not None)
        with torch.no_grad():
            t.weight.copy_(_tensor(torch, layer.weight.data))
            if layer.bias is not None:
                t.bias.copy_(_tensor(torch, layer.bias.data))
        return t
    if isinstance(layer, _BatchNorm):
        cls = nn.BatchNorm2d if layer.kind == "BatchNorm2d" else nn.BatchNorm1d
        t = cls(layer.num_features, eps=layer.eps, momentum=layer.momentum,
                affine=layer.weight is not None)
        with torch.no_grad():
            if layer.weight is not None:
                t.weight.copy_(_tensor(torch, layer.weight.data))
                t.bias.copy_(_tensor(torch, layer.bias.data))
        return t
    if isinstance(layer, MaxPool2d):
        return nn.MaxPool2d(layer.kernel_size, stride=layer.stride, padding=layer.padding)
    if isinstance(layer, GlobalAvgPool2d):
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    if isinstance(layer, Residual):
        return _Residual(torch, _twin(layer.body, torch),
                         None if layer.shortcut is None else _twin(layer.shortcut, torch),
                         layer.activation)
    raise TypeError(f"no PyTorch twin for {type(layer).__name__} ({layer!r})")


def _Residual(torch, body, shortcut, activation):  # noqa: N802 - a class factory
    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.shortcut = body, shortcut

        def forward(self, x):
            y = self.body(x) + (x if self.shortcut is None else self.shortcut(x))
            return torch.relu(y) if activation else y

    return Residual()

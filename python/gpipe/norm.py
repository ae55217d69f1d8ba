"""Deferred BatchNorm at any depth: BatchNorms inside a layer update their running statistics once
per mini-batch from all its rows, as on one device (the paper's rule, torchgpipe's
DeferredBatchNorm).

GPipe(model, batch_norm="deferred"), the default, compiles each BatchNorm that sits inside a layer
as a DeferredBatchNorm over the same parameters and buffers: in a pipeline stage, in training, it
normalizes each micro-batch by that micro-batch's statistics, as BatchNorm does, and adds them to
the stage's, which update the running statistics when the mini-batch ends; outside a pipeline it
is the BatchNorm it replaces. The user's model is left as it is.
"""
from typing import List, Optional

import torch

from . import _gpipe  # noqa: F401  (registers torch.ops.gpipe.batch_norm)

_BatchNorm = torch.nn.modules.batchnorm._BatchNorm
# The BatchNorms whose forward gpipe knows: torch.nn's own, not a subclass that changes it.
_STOCK_FORWARDS = (_BatchNorm.forward, torch.nn.SyncBatchNorm.forward)


class DeferredBatchNorm(torch.nn.Module):
    """A torch.nn.BatchNorm1d, 2d or 3d (or SyncBatchNorm) whose running statistics a pipeline stage
    updates once per mini-batch; it holds that BatchNorm's own weight, bias and buffers."""
    momentum: Optional[float]
    eps: float
    dims: List[int]

    def __init__(self, norm):
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.register_buffer("running_mean", norm.running_mean)
        self.register_buffer("running_var", norm.running_var)
        self.register_buffer("num_batches_tracked", norm.num_batches_tracked)
        self.momentum, self.eps = norm.momentum, norm.eps
        self.training = norm.training
        # The input's dimensions, as the BatchNorm checks them (SyncBatchNorm takes any from 2 on).
        self.dims = [5] if isinstance(norm, torch.nn.BatchNorm3d) else [4] if isinstance(norm, torch.nn.BatchNorm2d) \
            else [2, 3] if isinstance(norm, torch.nn.BatchNorm1d) else []
        self.kind = type(norm).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (len(self.dims) > 0 and x.dim() not in self.dims) or x.dim() < 2:
            raise ValueError("expected " + " or ".join([str(d) for d in self.dims]) + "D input to " + self.kind +
                             " (got " + str(x.dim()) + "D input)")
        return torch.ops.gpipe.batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var,
                                          self.num_batches_tracked, self.training, self.momentum, self.eps)


def _deferrable(module):
    return isinstance(module, _BatchNorm) and type(module).forward in _STOCK_FORWARDS and \
        module.track_running_stats and module.running_mean is not None and \
        not isinstance(module, torch.nn.modules.lazy.LazyModuleMixin)


def with_deferred_norms(module, top=True):
    """`module` with every BatchNorm that tracks running statistics and sits inside it (and, unless
    `top` is false, the module itself if it is one) compiled as a DeferredBatchNorm: a copy of the
    containers on the way (their own dicts of submodules, parameters and buffers, sharing every
    tensor and every other submodule); `module` itself where it holds none."""
    if top and _deferrable(module):
        return DeferredBatchNorm(module)
    changed = {}
    for name, child in module._modules.items():
        if child is not None:
            new = with_deferred_norms(child)
            if new is not child:
                changed[name] = new
    if not changed:
        return module
    # Not copy.copy, whose GraphModule recompiles the shared graph; nor GraphModule's __new__, which makes
    # a class of its own without the forward.
    copied = object.__new__(type(module))
    copied.__dict__ = dict(module.__dict__)
    copied._modules = dict(module._modules, **changed)
    copied._parameters = dict(module._parameters)
    copied._buffers = dict(module._buffers)
    return copied

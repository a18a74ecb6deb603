"""Which of PyTorch's kernels Laplace's derivatives run on: recurrent layers need PyTorch's own.

Laplace differentiates the network in eval mode: Jacobian rows by reverse mode (the curvature, the GLM predictive's
variances) and Jacobian-vector products by forward mode (the GLM's linearised samples, ``link_approx="mc"``). The
vendor kernels of ``nn.LSTM``/``nn.GRU``/``nn.RNN`` cannot do all of it: cuDNN's RNN has no backward in eval mode
("cudnn RNN backward can only be called in training mode") and neither cuDNN's nor oneDNN's RNN has a forward-mode
derivative; oneDNN's also keeps no backward workspace from a forward run without grad mode. PyTorch's own kernels
have all of these. So while Laplace differentiates a network with a recurrent layer, oneDNN (CPU) and cuDNN (GPU)
are switched off (:func:`native_kernels`); they are global switches, so its convolutions then run on PyTorch's own
kernels too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def has_recurrent(model: nn.Module) -> bool:
    """Whether ``model`` holds a recurrent layer (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``: :class:`torch.nn.RNNBase`)."""
    return any(isinstance(m, nn.RNNBase) for m in model.modules())


@contextlib.contextmanager
def native_kernels(on: bool = True):
    """With ``on``, oneDNN and cuDNN are off inside and restored after, so that PyTorch's own kernels run; without,
    nothing changes.
    """
    if not on:
        yield
        return
    before = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
    torch.backends.mkldnn.enabled = torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled = before

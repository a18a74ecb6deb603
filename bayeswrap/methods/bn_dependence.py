"""Whether a network's BatchNorm statistics depend on its Bayesian parameters (SWAG's BatchNorm update).

SWAG recomputes the running statistics of BatchNorm layers for each sampled θ (Maddox et al. 2019, §4). That is
needed only where a Bayesian parameter *feeds* a BatchNorm layer: where the input of some BatchNorm layer is a
function of it. With ``params="last_layer"`` on a convolutional network no Bayesian parameter does, every draw
has the same statistics, and one recomputation serves all draws.

The dependence is read from autograd, not from the order of the modules: one forward pass in eval mode (no
statistics are updated, no dropout is drawn) on one example, with only the Bayesian parameters requiring
gradients; a BatchNorm layer is fed exactly when its input requires a gradient. A parameter used outside any
module's forward (a class token added in the parent's forward), in a branch, or through a functional call is
seen as well. A dependence that passes only through non-differentiable operations (an ``argmax`` used as an
index) is not seen.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import nn

from bayeswrap.core.batches import take
from bayeswrap.core.functional import call, outside_inference_mode


@outside_inference_mode
def batchnorm_fed_by(model: nn.Module, tensors: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                     x, names: Collection[str], batchnorms: list[str], output_key: str = "logits",
                     dict_inputs: str = "auto") -> list[str]:
    """The BatchNorm layers of ``model`` whose input depends on the parameters ``names``.

    Args:
        model: the network used as a function (its own tensors are not read; its train/eval mode is restored).
        tensors: every parameter of ``model`` by name.
        buffers: every buffer of ``model`` by name (copied: nothing stored is updated).
        x: an input batch of the model (only its first example is used).
        names: the Bayesian parameter names.
        batchnorms: names of the BatchNorm modules to check.
        output_key, dict_inputs: as for :func:`bayeswrap.core.functional.call`.

    Returns:
        The names in ``batchnorms`` whose input requires a gradient when only ``names`` do, in the given order.
    """
    fed: list[str] = []

    def probe(name):
        def hook(module, args):
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) and name not in fed:
                fed.append(name)
        return hook

    chosen = set(names)
    handles = [model.get_submodule(n).register_forward_pre_hook(probe(n)) for n in batchnorms]
    was_training = model.training
    try:
        with torch.enable_grad():
            probe_tensors = {n: t.detach().requires_grad_(n in chosen and t.is_floating_point())
                             for n, t in tensors.items()}
            model.eval()
            call(model, probe_tensors, {n: b.clone() for n, b in buffers.items()}, take(x, slice(0, 1)), output_key,
                 dict_inputs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return [n for n in batchnorms if n in fed]

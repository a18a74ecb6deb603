"""The potential energy U(θ) that a full-batch sampler moves on, over flat parameter vectors, for every chain.

A kernel sees the Bayesian parameters of a wrapped model as one flat vector θ ∈ ℝ^P per chain, and the chains
as the rows of a (C, P) matrix. :class:`FlatLayout` converts between that layout and the model's named tensors
``{name: (*shape)}`` (in the order of the model's Bayesian parameters); :class:`Potential` evaluates U and ∇U for
all chains at once, as one ``torch.func.vmap`` over the chain axis, and falls back to one chain after another,
for good, the first time the model turns out to have an op without a batching rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.func import grad_and_value, vmap


class FlatLayout:
    """Named parameter tensors ↔ flat vectors, in a fixed name order.

    Args:
        template: ``{name: tensor}``, the parameters' shapes (their values are not used).
    """

    def __init__(self, template: Mapping[str, torch.Tensor]):
        self.shapes = {n: tuple(t.shape) for n, t in template.items()}
        self.sizes = [t.numel() for t in template.values()]

    @property
    def size(self) -> int:
        """P, the length of the flat vector."""
        return sum(self.sizes)

    def flatten(self, named: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``{name: (C, *shape)}`` -> (C, P)."""
        return torch.cat([named[n].reshape(named[n].shape[0], -1) for n in self.shapes], 1)

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """One flat vector (P,) -> ``{name: (*shape)}`` (views of ``vec``)."""
        return dict(zip(self.shapes, (part.reshape(shape) for part, shape in
                                      zip(vec.split(self.sizes), self.shapes.values()))))

    def split(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """(C, P) -> ``{name: (C, *shape)}`` (views of ``states``)."""
        return {n: part.reshape(states.shape[0], *shape) for (n, shape), part in
                zip(self.shapes.items(), states.split(self.sizes, 1))}


class Potential:
    """U(θ) of one chain, evaluated for every chain at once.

    Args:
        energy: U of one flat vector, ``(P,) -> ()`` in nats, differentiable with ``torch.func``.
        vmap_ok: whether to try one ``vmap`` over the chains first (False: one chain after another from the
            start, e.g. for a model already known to lack a batching rule).

    Attributes:
        energy: the single-chain function (kernels that run chain by chain, such as pyro's NUTS, call it).
        vmap_ok: False once some op of the model had no batching rule; from then on the chains run one
            after another.
    """

    def __init__(self, energy: Callable[[torch.Tensor], torch.Tensor], vmap_ok: bool = True):
        self.energy = energy
        self.vmap_ok = vmap_ok
        self._values = self._chainwise(energy)
        self._grad_and_values = self._chainwise(grad_and_value(energy))

    def values(self, states: torch.Tensor) -> torch.Tensor:
        """U of every chain: ``(C, P) -> (C,)``."""
        return self._values(states)

    def grad_and_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """∇U and U of every chain: ``(C, P) -> ((C, P), (C,))``, with gradients enabled."""
        with torch.enable_grad():
            return self._grad_and_values(states)

    def _chainwise(self, single):
        """``single`` over the chain axis: one vmap, or a loop over chains if the model has no batching rule."""
        batched = vmap(single)

        def fn(states):
            if self.vmap_ok:
                try:
                    return batched(states)
                except torch.OutOfMemoryError:
                    raise
                except Exception:  # an op without a batching rule: chains one by one from now on
                    self.vmap_ok = False
            outs = [single(s) for s in states]
            if isinstance(outs[0], tuple):
                return tuple(torch.stack(parts) for parts in zip(*outs))
            return torch.stack(outs)

        return fn

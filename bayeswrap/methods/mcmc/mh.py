"""Random-walk Metropolis–Hastings, every chain in one vmapped step.

θ' = θ + s · d ⊙ ε with ε ~ N(0, I), accepted with probability min(1, exp(U(θ) − U(θ'))) (the proposal is
symmetric). The scale s and shape d of each chain adapt during warm-up
(:class:`~bayeswrap.methods.mcmc.adaptation.ProposalAdaptation`); afterwards they are fixed, so the chain is a
valid Metropolis–Hastings chain. A proposal whose potential is NaN is rejected.
"""

from __future__ import annotations

import math

import torch

from bayeswrap.methods.mcmc.adaptation import ProposalAdaptation
from bayeswrap.methods.mcmc.kernel import ChainState, MCMCKernel
from bayeswrap.methods.mcmc.potential import Potential


class RandomWalkKernel(MCMCKernel):
    """Random-walk Metropolis–Hastings with an adaptive diagonal Gaussian proposal (module docstring).

    Args:
        init_scale: the starting proposal std s, in parameter units (> 0).
        target_accept: the acceptance rate the warm-up adapts s to; None: 0.234 (0.44 for one parameter).
    """

    def __init__(self, init_scale: float, target_accept: float | None = None):
        self.init_scale, self.target_accept = init_scale, target_accept

    def setup(self, potential: Potential, num_warmup: int, generator: torch.Generator | None,
              initial: ChainState) -> None:
        self.potential, self.num_warmup, self.t = potential, num_warmup, 0
        target = self.target_accept or (0.44 if initial.position.shape[1] == 1 else 0.234)
        self.adaptation = ProposalAdaptation(self.init_scale, target, num_warmup, initial.position)

    def step(self, state: ChainState, generator: torch.Generator | None) -> ChainState:
        states, values = state.position, state.potential
        eps = torch.randn(states.shape, generator=generator, device=states.device, dtype=states.dtype)
        proposal = states + self.adaptation.scale[:, None] * self.adaptation.shape * eps
        new_values = self.potential.values(proposal)
        log_ratio = torch.nan_to_num(values - new_values, nan=-math.inf)
        u = torch.rand(states.shape[0], generator=generator, device=states.device, dtype=states.dtype)
        accept = torch.log(u) < log_ratio
        states = torch.where(accept[:, None], proposal, states)
        values = torch.where(accept, new_values, values)
        if self.t < self.num_warmup:
            self.adaptation.update(self.t, log_ratio.clamp(max=0).exp(), states)
        self.t += 1
        return ChainState(states, accept, torch.zeros_like(accept), values)

    def diagnostics(self) -> dict:
        return {"proposal_scale": self.adaptation.scale.tolist()}

    def start_option(self) -> str:
        return f"init_scale={self.init_scale:g}"

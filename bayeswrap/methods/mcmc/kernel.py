"""The contract between the chain runner and a transition kernel, as pyro separates ``MCMCKernel`` from ``MCMC``.

A kernel is a Markov transition on the flat parameter vectors of C chains: it knows the potential U(θ)
(:class:`~bayeswrap.methods.mcmc.potential.Potential`), how many of its transitions are warm-up (when it may adapt
its step size, proposal scale or mass matrix) and nothing else. The runner
(:mod:`bayeswrap.methods.mcmc.runner`) owns the chains' starting points, the iteration loop, thinning, the
store of kept draws and the acceptance and divergence counts; it calls

1. :meth:`MCMCKernel.setup` once, with the starting :class:`ChainState`;
2. :meth:`MCMCKernel.step` ``num_warmup + num_samples`` times, each a transition of every chain at once;
3. :meth:`MCMCKernel.diagnostics` at the end, for the kernel's own statistics (final step size, ...).

The kernels: :class:`~bayeswrap.methods.mcmc.hmc.HMCKernel` and :class:`~bayeswrap.methods.mcmc.hmc.NUTSKernel`
(gradient-based), :class:`~bayeswrap.methods.mcmc.mh.RandomWalkKernel` (random-walk Metropolis–Hastings).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from bayeswrap.methods.mcmc.potential import Potential


@dataclass(frozen=True)
class ChainState:
    """Where every chain is after a transition.

    Attributes:
        position: θ of every chain, (C, P).
        accepted: (C,) bool: whether the transition that led here accepted its proposal (all False at the start).
        divergent: (C,) bool: whether that transition diverged (its energy error was too large).
        potential: U(θ) of every chain, (C,); None for a kernel that keeps its own (pyro's NUTS).
        grad: ∇U(θ), (C, P), for a gradient-based kernel that carries it; else None.
    """

    position: torch.Tensor
    accepted: torch.Tensor
    divergent: torch.Tensor
    potential: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    @classmethod
    def start(cls, position: torch.Tensor, potential: torch.Tensor, grad: torch.Tensor | None) -> ChainState:
        """The state before the first transition (nothing accepted, nothing divergent)."""
        none = torch.zeros(position.shape[0], dtype=torch.bool, device=position.device)
        return cls(position, none, none, potential, grad)


class MCMCKernel(ABC):
    """A transition kernel stepped by the chain runner (see the module docstring).

    A kernel holds its adaptation state between :meth:`setup` and the end of a run; a new run calls
    :meth:`setup` again.
    """

    @abstractmethod
    def setup(self, potential: Potential, num_warmup: int, generator: torch.Generator | None,
              initial: ChainState) -> None:
        """Prepares a run.

        Args:
            potential: U and ∇U over the chains.
            num_warmup: how many of the coming transitions are warm-up (adaptation allowed).
            generator: the run's ``torch.Generator`` (or None: the global RNG), for any random draw of the set-up
                (e.g. the step-size heuristic's momenta).
            initial: the chains' starting state (the runner checked that U is finite there).
        """

    @abstractmethod
    def step(self, state: ChainState, generator: torch.Generator | None) -> ChainState:
        """One transition of every chain (adapting during the first ``num_warmup`` calls after :meth:`setup`).

        Args:
            state: the state the previous call returned (or ``initial`` of :meth:`setup`).
            generator: the run's ``torch.Generator`` (or None), for every random draw.

        Returns:
            The new state, with the transition's ``accepted`` and ``divergent`` flags.
        """

    @abstractmethod
    def diagnostics(self) -> dict:
        """The kernel's statistics of the run, ``{name: value or per-chain list}`` (e.g. the final step size)."""

    def start_option(self) -> str:
        """The option that set the first step size or proposal scale, as ``name=value`` (named when chains stick)."""
        return "the method's starting values"

"""Hamiltonian Monte Carlo kernels: bayeswrap's vmapped HMC and pyro-ppl's No-U-Turn sampler.

* :class:`HMCKernel`: leapfrog trajectories of L steps with a diagonal mass matrix M (Neal 2011), every chain in
  one vmapped step. The momentum is p ~ N(0, M), the Hamiltonian H = U(θ) + ½ pᵀM⁻¹p, and the end of a
  trajectory is accepted with probability min(1, exp(H₀ − H₁)). With ``jitter`` the number of steps of each
  trajectory is drawn uniformly from {⌈L/2⌉, ..., ⌊3L/2⌋} (the same for every chain; Neal 2011, §5.4.2.2), so that
  no fixed trajectory length can be close to a period of the dynamics. The first step size comes from Hoffman &
  Gelman's Algorithm 4 heuristic (double or halve ε until the acceptance probability of one leapfrog step
  crosses ½); during warm-up ε follows dual averaging and M⁻¹ the windowed variance of the draws
  (:mod:`bayeswrap.methods.mcmc.adaptation`), the heuristic restarting ε after each mass-matrix update. A
  transition whose energy error H₁ − H₀ exceeds :data:`DIVERGENCE` nats is a divergence (Stan's threshold).
* :class:`NUTSKernel`: the No-U-Turn sampler of the optional ``pyro-ppl`` package (Hoffman & Gelman 2014,
  Algorithm 6, through its ``potential_fn`` interface), with pyro's own step-size and diagonal mass adaptation.
  Its trees are built with data-dependent control flow that ``vmap`` cannot batch, so a step moves one chain
  after another, each with its own pyro kernel and its own random-number stream.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from bayeswrap.methods.mcmc.adaptation import DualAveraging, WindowedMassAdaptation
from bayeswrap.methods.mcmc.kernel import ChainState, MCMCKernel
from bayeswrap.methods.mcmc.potential import Potential

#: energy error (nats) beyond which an HMC transition counts as divergent (Stan's threshold)
DIVERGENCE = 1000.0


class HMCKernel(MCMCKernel):
    """HMC with dual-averaging step size and windowed diagonal mass adaptation (module docstring).

    Args:
        num_leapfrog: leapfrog steps per trajectory L (integer ≥ 1).
        target_accept: the dual-averaging target δ in (0, 1).
        init_step_size: the step size the Algorithm 4 heuristic starts from (> 0).
        adapt_mass: adapt the diagonal inverse mass matrix in warm-up windows.
        jitter: draw each trajectory's number of steps from {⌈L/2⌉, ..., ⌊3L/2⌋}.
    """

    def __init__(self, num_leapfrog: int, target_accept: float, init_step_size: float, adapt_mass: bool = True,
                 jitter: bool = True):
        self.num_leapfrog, self.target_accept, self.init_step_size = num_leapfrog, target_accept, init_step_size
        self.adapt_mass, self.jitter = adapt_mass, jitter

    def setup(self, potential: Potential, num_warmup: int, generator: torch.Generator | None,
              initial: ChainState) -> None:
        self.potential, self.num_warmup, self.t = potential, num_warmup, 0
        self.inv_mass = torch.ones_like(initial.position)
        self.mass = WindowedMassAdaptation(num_warmup, self.adapt_mass)
        self.dual = DualAveraging(self._reasonable_step(initial, generator), self.target_accept)
        self._adapt_probs: list[torch.Tensor] = []  # acceptance probabilities since the last step-size restart

    def step(self, state: ChainState, generator: torch.Generator | None) -> ChainState:
        warm = self.t < self.num_warmup
        num_steps = self.num_leapfrog
        if self.jitter:  # L ~ U{⌈L/2⌉, ..., ⌊3L/2⌋}, the same for every chain
            low, high = (self.num_leapfrog + 1) // 2, self.num_leapfrog + self.num_leapfrog // 2
            num_steps = int(torch.randint(low, high + 1, (1,), generator=generator, device=state.position.device))
        step = self.dual.step if warm else self.dual.final
        proposal, error = self._trajectory(state, step, generator, num_steps)
        prob = torch.exp(-error.clamp(min=0))  # min(1, exp(H0 − H1))
        accept = torch.rand(prob.shape[0], generator=generator, device=prob.device, dtype=prob.dtype) < prob
        keep = accept[:, None]
        new = ChainState(torch.where(keep, proposal.position, state.position), accept, error > DIVERGENCE,
                         torch.where(accept, proposal.potential, state.potential),
                         torch.where(keep, proposal.grad, state.grad))
        if warm:
            self.dual.update(prob)
            self._adapt_probs.append(prob)
            inv_mass = self.mass.update(self.t, new.position)
            if inv_mass is not None:
                self.inv_mass = inv_mass
                self.dual = DualAveraging(self._reasonable_step(new, generator), self.target_accept)
                self._adapt_probs = []
        self.t += 1
        return new

    def diagnostics(self) -> dict:
        """The averaged step size ε̄, the mean acceptance probability of the second half of the last
        step-size adaptation (``warmup_acceptance``; NaN without warm-up), L and the mean of M⁻¹ per chain.
        """
        late = self._adapt_probs[len(self._adapt_probs) // 2:]
        chains = self.inv_mass.shape[0]
        return {"step_size": self.dual.final.tolist(),
                "warmup_acceptance": torch.stack(late).mean(0).tolist() if late else [math.nan] * chains,
                "num_leapfrog": self.num_leapfrog, "inverse_mass_mean": self.inv_mass.mean(1).tolist()}

    def start_option(self) -> str:
        return f"init_step_size={self.init_step_size:g}"

    def _trajectory(self, state: ChainState, step: torch.Tensor, generator: torch.Generator | None,
                    num_steps: int) -> tuple[ChainState, torch.Tensor]:
        """One leapfrog trajectory per chain from a fresh momentum: its end and the energy error H₁ − H₀ (C,)."""
        states, inv_mass = state.position, self.inv_mass
        momentum = torch.randn(states.shape, generator=generator, device=states.device,
                               dtype=states.dtype) / inv_mass.sqrt()
        h0 = state.potential + 0.5 * (inv_mass * momentum.square()).sum(1)
        q, p, g = states, momentum - 0.5 * step[:, None] * state.grad, state.grad
        u = state.potential
        for i in range(num_steps):
            q = q + step[:, None] * inv_mass * p
            g, u = self.potential.grad_and_values(q)
            if i < num_steps - 1:
                p = p - step[:, None] * g
        p = p - 0.5 * step[:, None] * g
        h1 = u + 0.5 * (inv_mass * p.square()).sum(1)
        end = ChainState(q, state.accepted, state.divergent, u, g)
        return end, torch.nan_to_num(h1 - h0, nan=math.inf)

    def _reasonable_step(self, state: ChainState, generator: torch.Generator | None) -> torch.Tensor:
        """Hoffman & Gelman 2014, Algorithm 4, per chain: double or halve ε until the acceptance crosses ½."""
        step = torch.full((state.position.shape[0],), self.init_step_size, dtype=state.position.dtype,
                          device=state.position.device)
        _, error = self._trajectory(state, step, generator, 1)
        direction = torch.where(-error > math.log(0.5), 1.0, -1.0).to(step.dtype)
        for _ in range(60):
            _, error = self._trajectory(state, step, generator, 1)
            crossing = direction * (-error) <= direction * math.log(0.5)
            if bool(crossing.all()):
                break
            step = torch.where(crossing, step, step * 2.0 ** direction)
        return step


class NUTSKernel(MCMCKernel):
    """pyro-ppl's NUTS on every chain, one after another (module docstring).

    Each chain gets its own ``pyro.infer.NUTS`` (diagonal mass matrix) and its own random-number stream, seeded
    from the run's generator at set-up; a step moves each chain by one NUTS transition inside its stream, so a
    chain's draws are those of a ``pyro.infer.MCMC`` run of that chain alone.

    Args:
        target_accept: pyro's ``target_accept_prob`` in (0, 1).
        adapt_mass: adapt pyro's diagonal mass matrix in warm-up.
    """

    def __init__(self, target_accept: float, adapt_mass: bool = True):
        self.target_accept, self.adapt_mass = target_accept, adapt_mass

    def setup(self, potential: Potential, num_warmup: int, generator: torch.Generator | None,
              initial: ChainState) -> None:
        from pyro.infer import NUTS

        self.num_warmup, self.t = num_warmup, 0
        device = initial.position.device
        self._devices = [device] if device.type == "cuda" else []
        self._kernels, self._params, self._rng, self._divergences = [], [], [], []
        for chain in initial.position:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)) \
                if generator is not None else int(torch.randint(0, 2**62, (1,)))
            nuts = NUTS(potential_fn=lambda params: potential.energy(params["theta"]),
                        target_accept_prob=self.target_accept, adapt_step_size=True,
                        adapt_mass_matrix=self.adapt_mass, full_mass=False)
            nuts.initial_params = {"theta": chain.detach().clone()}
            self._kernels.append(nuts)
            self._params.append(nuts.initial_params)
            self._rng.append(None)
            self._divergences.append(0)
            with self._stream(len(self._kernels) - 1, seed):
                nuts.setup(num_warmup)

    def step(self, state: ChainState, generator: torch.Generator | None) -> ChainState:
        divergent = []
        for c, nuts in enumerate(self._kernels):
            with self._stream(c):
                self._params[c] = nuts.sample(self._params[c])
            if self.t >= self.num_warmup:  # pyro counts divergences after warm-up only
                count = len(nuts.diagnostics()["divergences"])
                divergent.append(count > self._divergences[c])
                self._divergences[c] = count
            else:
                divergent.append(False)
        self.t += 1
        position = torch.stack([p["theta"].detach() for p in self._params]).to(state.position)
        moved = (position != state.position).any(1)  # pyro replaces θ only when it accepts a tree's proposal
        return ChainState(position, moved, torch.tensor(divergent, device=position.device))

    def diagnostics(self) -> dict:
        return {"step_size": [float(nuts.step_size) for nuts in self._kernels], "kernel": "nuts"}

    def start_option(self) -> str:
        return "pyro's NUTS step-size heuristic (init_step_size applies to kernel='hmc' only)"

    @contextmanager
    def _stream(self, chain: int, seed: int | None = None):
        """Runs pyro inside chain ``chain``'s random-number stream (seeded with ``seed`` the first time), with
        gradients on and pyro's distribution validation off (as ``pyro.infer.MCMC.run``).
        """
        import pyro
        from pyro import poutine

        with torch.random.fork_rng(devices=self._devices), torch.enable_grad(), poutine.block(), \
                pyro.validation_enabled(False):
            if seed is not None:
                torch.manual_seed(seed)
            else:
                torch.set_rng_state(self._rng[chain][0])
                for device, rng in zip(self._devices, self._rng[chain][1:]):
                    torch.cuda.set_rng_state(rng, device)
            yield
            self._rng[chain] = (torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in self._devices))

"""Stochastic-gradient Langevin dynamics with running moments (BayesDLL §2.3).

Training runs :class:`bayeswrap.optim.SGLD` (Welling & Teh 2011, BayesDLL eq. 12)
on the MAP objective. After ``burn_in`` optimizer steps, every ``thinning``-th
iterate is folded into a running mean and variance (Welford's algorithm); the
test-time posterior is the diagonal Gaussian N(mean, var) of those iterates.
"""

from __future__ import annotations

import torch

from .. import optim as bw_optim
from ..functional import NamedTensors
from .base import NotFittedError, register_method
from .map import MAP


@register_method("sgld")
class SGLD(MAP):
    """SGLD sampler over the Bayesian parameters; train it with ``bw.optim.SGLD``.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        burn_in: optimizer steps discarded before moments are collected (≥ 0).
            BayesDLL counts burn-in in epochs; multiply by steps per epoch.
        thinning: keep every ``thinning``-th iterate after burn-in (≥ 1;
            BayesDLL default 10).

    Attributes:
        theta: the current Langevin iterate.
        moment_mean, moment_m2: Welford accumulators of the kept iterates.
        num_steps, num_kept: step and kept-sample counters (0-d int64 buffers).
    """

    required_optimizer = bw_optim.SGLD

    def __init__(self, model, *, burn_in: int = 0, thinning: int = 10, **kwargs):
        if isinstance(burn_in, bool) or int(burn_in) != burn_in or burn_in < 0:
            raise ValueError(f"burn_in={burn_in!r} must be an integer >= 0 (optimizer steps)")
        if isinstance(thinning, bool) or int(thinning) != thinning or thinning < 1:
            raise ValueError(f"thinning={thinning!r} must be an integer >= 1 (optimizer steps)")
        self.burn_in, self.thinning = int(burn_in), int(thinning)
        super().__init__(model, **kwargs)

    def _init_posterior(self, init):
        super()._init_posterior(init)
        zeros = {n: torch.zeros_like(t) for n, t in init.items()}
        self.moment_mean = NamedTensors(zeros, trainable=False)
        self.moment_m2 = NamedTensors(zeros, trainable=False)
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("num_kept", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def after_step(self) -> None:
        """Counts the step and, past burn-in on the thinning grid, updates the moments."""
        self.num_steps += 1
        past = int(self.num_steps) - self.burn_in
        if past <= 0 or past % self.thinning:
            return
        self.num_kept += 1
        theta, mean, m2 = self.theta.values(), self.moment_mean.values(), self.moment_m2.values()
        delta = torch._foreach_sub(theta, mean)
        torch._foreach_add_(mean, torch._foreach_div(delta, float(self.num_kept)))
        torch._foreach_addcmul_(m2, delta, torch._foreach_sub(theta, mean))

    def is_ready(self) -> bool:
        return int(self.num_kept) > 0

    def _not_ready_message(self):
        return (f"no SGLD sample has been kept yet ({int(self.num_steps)} steps taken, burn_in={self.burn_in}, "
                f"thinning={self.thinning}); train for more steps or lower burn_in")

    def _point_estimate(self):
        return self.theta.as_dict()

    def posterior_mean(self):
        """Running mean of the kept iterates, ``{name: tensor}``.

        Raises:
            NotFittedError: if no iterate has been kept yet.
        """
        self._check_ready()
        return self.moment_mean.as_dict()

    def posterior_std(self):
        """Running std sqrt(M2 / n) of the kept iterates, ``{name: tensor}``.

        Raises:
            NotFittedError: if no iterate has been kept yet.
        """
        self._check_ready()
        n = float(self.num_kept)
        return {k: (v / n).sqrt() for k, v in self.moment_m2.items()}

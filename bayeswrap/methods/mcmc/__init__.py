"""Full-batch MCMC for small models: a sampler protocol, its kernels, one chain runner and the posteriors.

* :mod:`~bayeswrap.methods.mcmc.posterior`: the registered methods ``"mh"`` (:class:`MetropolisHastings`) and
  ``"hmc"`` (:class:`HMC`), posteriors over the kept draws, with ``run_chains``, ``diagnostics`` and
  ``chain_draws``;
* :mod:`~bayeswrap.methods.mcmc.runner`: the one runner (chains, warm-up, thinning, the draw store, diagnostics);
* :mod:`~bayeswrap.methods.mcmc.kernel`: the :class:`MCMCKernel` contract (``setup``, ``step`` of every chain,
  ``diagnostics``) and :class:`ChainState`;
* :mod:`~bayeswrap.methods.mcmc.hmc` (HMC, pyro's NUTS), :mod:`~bayeswrap.methods.mcmc.mh` (random-walk MH):
  the kernels; :mod:`~bayeswrap.methods.mcmc.adaptation`: their warm-up adaptation;
* :mod:`~bayeswrap.methods.mcmc.potential`: U(θ) over the chains' flat vectors, vmapped.
"""

from bayeswrap.methods.mcmc.hmc import DIVERGENCE, HMCKernel, NUTSKernel
from bayeswrap.methods.mcmc.kernel import ChainState, MCMCKernel
from bayeswrap.methods.mcmc.mh import RandomWalkKernel
from bayeswrap.methods.mcmc.posterior import HMC, MAX_PARAMETERS, FullBatchMCMC, MetropolisHastings
from bayeswrap.methods.mcmc.potential import FlatLayout, Potential
from bayeswrap.methods.mcmc.runner import LOW_ACCEPTANCE, MAX_ITERATIONS, MIN_KEPT_DRAWS, kept_draws

__all__ = ["DIVERGENCE", "HMC", "LOW_ACCEPTANCE", "MAX_ITERATIONS", "MAX_PARAMETERS", "MIN_KEPT_DRAWS",
           "ChainState", "FlatLayout", "FullBatchMCMC", "HMCKernel", "MCMCKernel", "MetropolisHastings",
           "NUTSKernel", "Potential", "RandomWalkKernel", "kept_draws"]

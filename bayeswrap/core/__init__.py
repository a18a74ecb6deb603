"""The functional substrate: knows no inference method and no run config.

* :mod:`~bayeswrap.core.functional`: named tensors, parameter selection, the functional call on a storage-free copy.
* :mod:`~bayeswrap.core.modules`: storage-free copies of a module, their materialised copies, unwrapping ``torch.compile``.
* :mod:`~bayeswrap.core.batches`: ``(inputs, targets)`` batches and input checks.
* :mod:`~bayeswrap.core.priors`, :mod:`~bayeswrap.core.likelihoods`: the Gaussian prior and the likelihoods.
* :mod:`~bayeswrap.core.fused`: bucketed sample/penalty kernels and parallel CPU noise.
* :mod:`~bayeswrap.core.layers`: local-reparameterisation (LRT) layers.
* :mod:`~bayeswrap.core.samples`: the memory-bounded store of posterior draws.
* :mod:`~bayeswrap.core.schedules`: KL annealing and cyclical step sizes.
* :mod:`~bayeswrap.core.checks`: the scalar validators every layer uses.
* :mod:`~bayeswrap.core.io`: atomic writes and safe checkpoint loading.
* :mod:`~bayeswrap.core.distributed`: torchrun helpers.
"""

"""Local reparameterisation for a method: layers that sample their pre-activations instead of their weights.

A method that passes, for a Bayesian ``nn.Linear``/``nn.Conv2d`` weight, the mean under the parameter's name and the
variance under ``name + "_var"`` gets pre-activations b ~ N(x m, x² v) sampled per example (Kingma et al. 2015,
"Variational Dropout and the Local Reparameterization Trick"), evaluated on a second storage-free copy whose
supported layers are :mod:`bayeswrap.core.layers`' LRT layers; see :meth:`bayeswrap.BayesianModel.forward_with`.
"""

from __future__ import annotations

from bayeswrap.core.layers import LRTLayer, find_lrt_layers, lrt_copy


class LocalReparamMixin:
    """Adds :meth:`enable_local_reparam` to a :class:`~bayeswrap.BayesianModel` (VI, LBBNN)."""

    def enable_local_reparam(self) -> list[LRTLayer]:
        """Switches supported layers to pre-activation sampling (see :mod:`bayeswrap.core.layers`).

        Builds a second storage-free copy of the model in which each ``nn.Linear`` /
        ``nn.Conv2d`` whose weight is Bayesian samples its pre-activations from
        moments that the method passes as ``theta[name]`` (mean) and
        ``theta[name + "_var"]`` (variance); see :meth:`~bayeswrap.BayesianModel.forward_with`.

        Returns:
            The layers that got a local-reparameterisation forward.

        Raises:
            ValueError: if no Bayesian parameter is the weight of an ``nn.Linear`` or
                ``nn.Conv2d`` (every other layer type falls back to weight sampling).
        """
        layers = find_lrt_layers(self.model, self.bayesian_names)
        if not layers:
            raise ValueError(f"local_reparam=True needs an nn.Linear or nn.Conv2d (padding_mode='zeros') whose "
                             f"weight is Bayesian; the Bayesian parameters {self.bayesian_names[:6]} include none. "
                             f"Accepted: local_reparam=False, or params= selecting such a layer's weight")
        self._lrt = layers
        self._skeleton = [self._skeleton[0], lrt_copy(self._skeleton[0], layers)]
        self._lrt_var_names = {n for layer in layers for n in (layer.weight_var, layer.bias_var) if n}
        return layers

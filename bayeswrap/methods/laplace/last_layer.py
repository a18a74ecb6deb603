"""Last-layer KFAC Laplace with the marginal-likelihood prior precision: laplace-torch's recommended setting.

Daxberger et al. (2021, §4 and §5, "Laplace Redux") recommend, as laplace-torch's defaults, a Laplace
approximation over the last layer only (``subset_of_weights="last_layer"``), with a Kronecker-factored GGN
(``hessian_structure="kron"``), fitted post hoc on a MAP network, its prior precision δ chosen after training by
maximising the Laplace evidence (``optimize_prior_precision(method="marglik")``; Immer et al. 2021, §3; MacKay
1992), and the linearised predictive with the probit link (``pred_type="glm"``, ``link_approx="probit"``):

    p(y | x, D) ≈ softmax(f(x; θ*) / sqrt(1 + π/8 · diag(J P⁻¹ Jᵀ))),   P = G ⊗ A (+ G for the bias) + δ I,

    δ = argmax_δ log p(D | δ) = argmax_δ log p(D | θ*) − ½ [Σ_i log(1 + λ_i/δ) + δ |θ* − θ̄|²],

with λ_i the eigenvalues of the head's Kronecker factors (see :mod:`bayeswrap.methods.laplace.structures` and
:mod:`bayeswrap.methods.laplace.marglik`). :class:`LastLayerLaplace` is :class:`~bayeswrap.Laplace` with those
defaults and with δ set by the marginal likelihood as soon as the curvature is fitted
(:meth:`LastLayerLaplace.after_fit`), so that ``bayeswrap compare`` scores that setting as a row of its own:
its prior std is tuned by validation NLL as MAP's is, its δ never by validation data.

References:
    E. Daxberger, A. Kristiadi, A. Immer, R. Eschenhagen, M. Bauer, P. Hennig 2021, "Laplace Redux —
    effortless Bayesian deep learning", NeurIPS (§4, §5: last-layer, KFAC, marglik, probit as the defaults).
    A. Immer, M. Bauer, V. Fortuin, G. Rätsch, M. E. Khan 2021, "Scalable marginal likelihood estimation for
    model selection in deep learning", ICML (the Laplace evidence for δ). D. MacKay 1992, "A practical Bayesian
    framework for backpropagation networks".
"""

from __future__ import annotations

from bayeswrap.methods.base import register_method
from bayeswrap.methods.laplace.laplace import Laplace
from bayeswrap.methods.map import MAP


@register_method("laplace_ll_kfac", order=75)
class LastLayerLaplace(Laplace):
    """Last-layer KFAC Laplace with the marginal-likelihood prior precision and the probit GLM predictive
    (laplace-torch's recommended setting; Daxberger et al. 2021).

    Exactly ``bw.wrap(model, "laplace", subset_of_weights="last_layer", hessian_structure="kron", ...)`` followed by
    ``bnn.optimize_prior_precision("marglik")`` once the curvature is fitted (:meth:`after_fit`); registered under
    its own name so that ``bayeswrap compare`` lists it. Takes the arguments of :class:`~bayeswrap.Laplace`, with
    these defaults:

    Args:
        hessian_structure: ``"kron"`` (KFAC; Ritter et al. 2018).
        subset_of_weights: ``"last_layer"`` (the classifier's weight and bias; see :class:`~bayeswrap.Laplace`).

    Every other option keeps :class:`~bayeswrap.Laplace`'s default (``curvature="ggn"``, ``pred_type="glm"``,
    ``link_approx="probit"``); all of them may be changed.

    Raises:
        ValueError: as :class:`~bayeswrap.Laplace`.
    """

    #: compare tunes the training prior std by validation NLL, as MAP's (the network is a MAP network); δ is the
    #: marginal likelihood's, set in after_fit, never chosen on validation data
    tuning = MAP.tuning
    #: its one operating point is its own row: the evidence's δ
    operating_points = ()
    in_default_comparison = True

    def __init__(self, model, *, hessian_structure: str = "kron", subset_of_weights: str = "last_layer", **kwargs):
        super().__init__(model, hessian_structure=hessian_structure, subset_of_weights=subset_of_weights, **kwargs)

    def after_fit(self, train_loader) -> None:
        """Fits the curvature on the training data (as :class:`~bayeswrap.Laplace`), then sets the prior precision
        to the maximiser of the marginal likelihood (scalar δ; a learned noise std jointly with it), see
        :meth:`~bayeswrap.Laplace.optimize_prior_precision`.
        """
        super().after_fit(train_loader)
        self.optimize_prior_precision("marglik")

"""The Laplace approximation, one concept per module.

:mod:`.laplace` (the method), :mod:`.fitting` (its curvature fit), :mod:`.glm` (its linearised predictive),
:mod:`.marglik` (its evidence and prior-precision searches), :mod:`.structures` and :mod:`.curvature` (the
posterior structures and the per-layer curvature it is built on).
"""

from bayeswrap.methods.laplace.glm import GLM
from bayeswrap.methods.laplace.laplace import Laplace
from bayeswrap.methods.laplace.marglik import validation_search

__all__ = ["GLM", "Laplace", "validation_search"]

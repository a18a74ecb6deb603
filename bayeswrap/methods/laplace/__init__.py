"""The Laplace approximation: the method (:mod:`.laplace`) and the curvature it is built on (:mod:`.curvature`)."""

from bayeswrap.methods.laplace.laplace import Laplace

__all__ = ["Laplace"]

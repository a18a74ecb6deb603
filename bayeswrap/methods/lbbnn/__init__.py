"""Latent binary BNNs: the method (:mod:`.lbbnn`) and its multiplicative normalizing flows (:mod:`.flows`)."""

from bayeswrap.methods.lbbnn.lbbnn import LBBNN

__all__ = ["LBBNN"]

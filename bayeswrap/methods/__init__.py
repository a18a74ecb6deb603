"""Inference methods and the registry from method name to class.

Every module of this package (and of its subpackages) is imported here by a walk of the package
(:func:`~bayeswrap.methods.registry.discover_methods`), so a method registered with
:func:`~bayeswrap.methods.registry.register_method` in any of them is in :data:`METHODS`, and its class is a
name of this package; no list of method modules is kept. ``bayeswrap.wrap(model, method, ...)`` looks the class
up in :data:`METHODS`.
"""

from bayeswrap.methods.base import BayesianModel, LossOutput, NotFittedError
from bayeswrap.methods.registry import (
    METHODS,
    TUNING,
    discover_methods,
    method_option_defaults,
    method_options,
    method_table,
    register_method,
    tuning_bounds,
    tuning_option,
    wrap,
)

discover_methods(__name__)

#: the method classes, one public name each, derived from the registry
globals().update({cls.__name__: cls for cls in METHODS.values()})

__all__ = ["METHODS", "BayesianModel", "LossOutput", "NotFittedError", "register_method", "wrap", "method_options",
           "method_option_defaults", "method_table", "TUNING", "tuning_option", "tuning_bounds",
           *dict.fromkeys(cls.__name__ for cls in METHODS.values())]

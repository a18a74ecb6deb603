"""The public API of :mod:`bayeswrap`, imported on first use of a name of the package (see its ``__getattr__``).

``import bayeswrap`` itself imports neither torch nor any method, so that ``bayeswrap --help`` (whose console
script lives in this package) starts in a fraction of a second; the first ``bw.wrap`` (or any other public name)
imports this module, which imports the library.
"""

from bayeswrap import calibration, evaluation, optim, uncertainty
from bayeswrap._version import __version__
from bayeswrap.core import samples, schedules
from bayeswrap.core.schedules import KLSchedule
from bayeswrap.evaluation import convergence as diagnostics
from bayeswrap.evaluation import tuning
from bayeswrap.methods import (
    METHODS,
    BayesianModel,
    LossOutput,
    NotFittedError,
    method_options,
    predictives,
    sparsity,
    wrap,
)
from bayeswrap.methods.persistence import load, save
from bayeswrap.predictive import evaluate, predict_loader, sample_probs_loader
from bayeswrap.training import fit

#: the method classes, one public name each, derived from the registry
CLASSES = {cls.__name__: cls for cls in dict.fromkeys(METHODS.values())}
globals().update(CLASSES)

__all__ = ["wrap", "fit", "save", "load", "evaluate", "predict_loader", "sample_probs_loader", "BayesianModel",
           "LossOutput", "NotFittedError", "METHODS", "method_options", *CLASSES,
           "optim", "schedules", "KLSchedule", "sparsity", "calibration", "diagnostics", "evaluation",
           "uncertainty", "samples", "tuning", "predictives", "__version__"]  # and load_run, which bayeswrap imports itself

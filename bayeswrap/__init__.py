"""bayeswrap: any PyTorch ``nn.Module`` as a Bayesian neural network, in one line.

>>> import bayeswrap as bw
>>> bnn = bw.wrap(model, "vi", num_data=len(train_set), prior_std=1.0)
>>> history = bw.fit(bnn, train_loader, epochs=10, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-2))
>>> probs = bnn.predict(x, num_samples=5)   # posterior predictive, (B, K)

The package is layered; imports point down this list only (checked by
import-linter in CI): ``app`` → ``training`` → ``methods`` → ``predictive`` →
``optim``, ``data``, ``evaluation`` → ``core``.
"""

from bayeswrap import _compat

_compat.install()  # old module paths (bayeswrap.core.functional, bayeswrap.app.cli, ...) keep working

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
for _cls in dict.fromkeys(METHODS.values()):
    globals()[_cls.__name__] = _cls
del _cls

__all__ = ["wrap", "fit", "save", "load", "evaluate", "predict_loader", "sample_probs_loader", "BayesianModel",
           "LossOutput", "NotFittedError", "METHODS", "method_options", *(c.__name__ for c in dict.fromkeys(METHODS.values())),
           "optim", "schedules", "KLSchedule", "sparsity", "calibration", "diagnostics", "evaluation",
           "uncertainty", "samples", "tuning", "predictives", "load_run", "__version__"]


def __getattr__(name: str):
    """``bw.load_run``, imported on first use: ``import bayeswrap`` loads no module of the application layer."""
    if name == "load_run":
        from bayeswrap.app.runs import load_run

        return load_run
    raise AttributeError(f"module 'bayeswrap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "load_run"})

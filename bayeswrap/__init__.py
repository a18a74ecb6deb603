"""bayeswrap: any PyTorch ``nn.Module`` as a Bayesian neural network, in one line.

>>> import bayeswrap as bw
>>> bnn = bw.wrap(model, "vi", num_data=len(train_set), prior_std=1.0)
>>> history = bw.fit(bnn, train_loader, epochs=10, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-2))
>>> probs = bnn.predict(x, num_samples=5)   # posterior predictive, (B, K)
"""

from . import optim
from .methods import (
    IVON,
    MAP,
    METHODS,
    SGLD,
    VI,
    BayesianModel,
    KingmaVD,
    Laplace,
    LossOutput,
    MCDropout,
    NotFittedError,
    SparseVD,
    method_options,
    wrap,
)
from . import calibration, diagnostics, evaluation, samples, schedules, sparsity, tuning, uncertainty  # isort: skip  (after .methods: sparsity imports methods.base)
from .schedules import KLSchedule  # isort: skip
from .predictive import evaluate, predict_loader, sample_probs_loader
from .runs import load_run
from .training import fit

__version__ = "0.1.0"

__all__ = ["wrap", "fit", "evaluate", "predict_loader", "sample_probs_loader", "BayesianModel", "LossOutput", "NotFittedError", "METHODS",
           "method_options", "MAP", "VI", "MCDropout", "SGLD", "Laplace", "IVON", "SparseVD", "KingmaVD", "optim", "schedules", "KLSchedule",
           "sparsity", "calibration", "diagnostics", "evaluation", "uncertainty", "samples", "tuning", "load_run", "__version__"]

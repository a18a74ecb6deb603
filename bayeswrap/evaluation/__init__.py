"""Evaluation of predictive distributions, shared by every method and every CLI run.

* :mod:`~bayeswrap.evaluation.calibration`: ECE, MCE, NLL, Brier, temperature scaling.
* :mod:`~bayeswrap.evaluation.uncertainty`: per-example uncertainty measures over
  posterior samples (entropy, mutual information, variation ratio, ...), the γ-metric.
* :mod:`~bayeswrap.evaluation.ood`: out-of-distribution detection metrics (AUROC, AUPR, FPR95).
* :mod:`~bayeswrap.evaluation.selective`: selective prediction (risk-coverage, AURC).
* :mod:`~bayeswrap.evaluation.conformal`: split conformal prediction sets (LAC, APS, RAPS), coverage and set size.
* :mod:`~bayeswrap.data.shift`: dataset shift (rotation, Gaussian noise) and held-out-class splits.

Figures live in :mod:`bayeswrap.evaluation.plots`, which imports these modules (never the reverse).
"""

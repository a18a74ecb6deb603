"""``bw.uncertainty``: per-example uncertainty, OOD detection and selective prediction under one name.

A facade; the functions live in :mod:`bayeswrap.evaluation`:

* :mod:`bayeswrap.evaluation.uncertainty`: :func:`predictive_entropy`,
  :func:`expected_entropy`, :func:`mutual_information`, :func:`variation_ratio`,
  :func:`predictive_std`, :func:`ga_uncertainty`, :func:`ga_cutoff`,
  :func:`gamma_curve`, :func:`regression_uncertainty` (and
  :class:`RegressionUncertainty`, ``PREDICTIVE_STD_REDUCTIONS``).
* :mod:`bayeswrap.evaluation.ood`: :func:`ood_metrics` (and ``FPR_AT_TPR``).
* :mod:`bayeswrap.evaluation.selective`: :func:`risk_coverage`, :func:`aurc`,
  :func:`aurc_optimal`, :func:`excess_aurc`.

``predictive_entropy`` here takes per-sample probabilities ``(S, B, K)`` and
returns a ``(B,)`` tensor; ``bw.calibration.predictive_entropy`` takes an
averaged ``(N, K)`` predictive.
"""

from bayeswrap.evaluation.ood import *  # noqa: F401,F403
from bayeswrap.evaluation.ood import __all__ as _ood_names
from bayeswrap.evaluation.selective import *  # noqa: F401,F403
from bayeswrap.evaluation.selective import __all__ as _selective_names
from bayeswrap.evaluation.uncertainty import *  # noqa: F401,F403
from bayeswrap.evaluation.uncertainty import __all__ as _uncertainty_names

__all__ = [*_uncertainty_names, *_ood_names, *_selective_names]

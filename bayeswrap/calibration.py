"""``bw.calibration``: the calibration metrics and their figures under one name.

An alias kept for existing code and for short examples. The metrics live
in :mod:`bayeswrap.evaluation.calibration`; the figures
(:func:`reliability_diagram`, :func:`temperature_curve`) in :mod:`bayeswrap.evaluation.plots`,
which imports the metrics (never the reverse).
"""

from bayeswrap.evaluation.calibration import *  # noqa: F401,F403
from bayeswrap.evaluation.calibration import __all__ as _metric_names
from bayeswrap.evaluation.plots import reliability_diagram, temperature_curve

__all__ = [*_metric_names, "reliability_diagram", "temperature_curve"]

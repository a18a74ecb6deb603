"""The experiment scripts, importable as modules (``from scripts import posterior_quality``) by the tests.

Each script also runs from the command line (``python scripts/<name>.py ...``); what they share with the
application lives in :mod:`bayeswrap.app.experiments`, what only the scripts share in :mod:`scripts.common`.
A long script keeps its experiment and CLI in ``<name>.py`` and its report (or a part of its own) in a sibling
module, e.g. ``sparsity_mnist5k_report.py`` or ``mcmc_logistic.py``.
"""

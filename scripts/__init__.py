"""The experiment scripts, importable as modules (``from scripts import posterior_quality``) by the tests.

Each script also runs from the command line (``python scripts/<name>.py ...``); what they share lives in
:mod:`bayeswrap.app.experiments`. A script with several parts keeps them in a package of its own, one part per
module (``scripts/benchmarks/``, ``scripts/lbbnn_experiments/``, ``scripts/bayesdll_side_by_side/``), and the
script itself runs them and writes the report.
"""

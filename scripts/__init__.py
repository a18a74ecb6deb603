"""The experiment scripts, importable as modules (``from scripts import posterior_quality``) by the tests.

Each script also runs from the command line (``python scripts/<name>.py ...``); what they share lives in
:mod:`bayeswrap.app.experiments`.
"""

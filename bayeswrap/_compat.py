"""Old module paths, kept working after the move to the layered layout.

``import bayeswrap.functional`` (and every other path the flat layout had) gives
the module at its new home, the same module object, so monkeypatching and
``isinstance`` checks keep working. New code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module path -> new module path
MOVED: dict[str, str] = {
    "bayeswrap.functional": "bayeswrap.core.functional",
    "bayeswrap.priors": "bayeswrap.core.priors",
    "bayeswrap.likelihoods": "bayeswrap.core.likelihoods",
    "bayeswrap.fused": "bayeswrap.core.fused",
    "bayeswrap.layers": "bayeswrap.core.layers",
    "bayeswrap.samples": "bayeswrap.core.samples",
    "bayeswrap.checks": "bayeswrap.core.checks",
    "bayeswrap.distributed": "bayeswrap.core.distributed",
    "bayeswrap.io": "bayeswrap.core.io",
    "bayeswrap.schedules": "bayeswrap.core.schedules",
    "bayeswrap.diagnostics": "bayeswrap.evaluation.convergence",
    "bayeswrap.plots": "bayeswrap.evaluation.plots",
    "bayeswrap.tuning": "bayeswrap.evaluation.tuning",
    "bayeswrap.evaluation.shift": "bayeswrap.data.shift",
    "bayeswrap.sparsity": "bayeswrap.methods.sparsity",
    "bayeswrap.curvature": "bayeswrap.methods.laplace.curvature",
    "bayeswrap.flows": "bayeswrap.methods.lbbnn.flows",
    "bayeswrap.cli": "bayeswrap.app.cli",
    "bayeswrap.config": "bayeswrap.app.config",
    "bayeswrap.experiment": "bayeswrap.app.build",
    "bayeswrap.runs": "bayeswrap.app.runs",
    "bayeswrap.models": "bayeswrap.app.backbones",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path in :data:`MOVED` to the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        """Nothing to run (the module ran at its new path); its own spec is put back."""
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Puts the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())

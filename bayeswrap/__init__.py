"""bayeswrap: any PyTorch ``nn.Module`` as a Bayesian neural network, in one line.

>>> import bayeswrap as bw
>>> bnn = bw.wrap(model, "vi", num_data=len(train_set), prior_std=1.0)
>>> history = bw.fit(bnn, train_loader, epochs=10, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-2))
>>> probs = bnn.predict(x, num_samples=5)   # posterior predictive, (B, K)

The package is layered; imports point down this list only (checked by
import-linter in CI): ``app`` → ``training`` → ``methods`` → ``predictive`` →
``optim``, ``data``, ``evaluation`` → ``core``.

The public names are imported on first use (:mod:`bayeswrap._api`): ``import bayeswrap`` imports neither
torch nor the application layer, so the ``bayeswrap`` command line answers ``--help`` and refuses a bad option
without the library's import time.
"""

import importlib
import importlib.util

from bayeswrap import _compat

_compat.install()  # old module paths (bayeswrap.core.functional, bayeswrap.app.cli, ...) keep working

from bayeswrap._version import __version__  # noqa: F401 (public)

_loading = False


def _load_api() -> None:
    """Puts the public names of :mod:`bayeswrap._api` (and the method classes) into this module."""
    global _loading
    _loading = True  # while _api imports submodules, ``from bayeswrap import x`` must not come back here
    try:
        api = importlib.import_module("bayeswrap._api")
    finally:
        _loading = False
    globals().update({name: getattr(api, name) for name in api.__all__})
    globals()["__all__"] = [*api.__all__[:-1], "load_run", "__version__"]


def __getattr__(name: str):
    """The public names, imported on first use; ``bw.load_run`` imports the application layer only then."""
    if name == "load_run":
        from bayeswrap.app.runs import load_run

        return load_run
    if not _loading and "__all__" not in globals() and (name == "__all__" or not name.startswith("_")):
        if name != "__all__" and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # a submodule (``from bayeswrap import optim``)
        _load_api()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'bayeswrap' has no attribute {name!r}")


def __dir__() -> list[str]:
    if "__all__" not in globals():
        _load_api()
    return sorted({*globals(), "load_run"})

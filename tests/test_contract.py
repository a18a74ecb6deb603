"""The method contract: the public template methods live on BayesianModel only.

``loss``, ``sample``, ``sample_logits`` and ``predict`` validate their arguments once on the base; a method
plugs in through hooks (``_draw``, ``default_predictive``, ...), never by overriding them. The one documented
exception is the ensemble's composite ``loss``, which vmaps its members' training hooks.
"""

import pytest

import bayeswrap as bw
from bayeswrap.methods.base import BayesianModel

TEMPLATE = ("loss", "sample", "sample_logits", "predict", "_sample_logits")
#: (class name, member) pairs allowed to define a template method
EXCEPTIONS = {("Ensemble", "loss")}


@pytest.mark.parametrize("method", sorted(bw.METHODS))
def test_no_registered_class_defines_a_template_method(method):
    defined = [f"{klass.__name__}.{member}" for klass in bw.METHODS[method].__mro__
               if issubclass(klass, BayesianModel) and klass is not BayesianModel
               for member in TEMPLATE if member in vars(klass) and (klass.__name__, member) not in EXCEPTIONS]
    assert not defined, f"{method}: {defined} override the base's template methods; implement _draw or " \
                        "default_predictive instead"


def test_the_one_exception_is_the_ensembles_composite_loss():
    assert "loss" in vars(bw.METHODS["ensemble"]) and "loss" not in vars(bw.METHODS["multiswag"])

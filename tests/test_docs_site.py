"""The documentation site builds with warnings as errors and has the pages the registry and the API imply."""

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bayeswrap import METHODS, method_options

ROOT = Path(__file__).resolve().parents[1]
API_PAGES = {  # page -> anchors (the objects' paths) that it must document
    "api/bayeswrap.html": ["bayeswrap.methods.registry.wrap", "bayeswrap.training.fit",
                           "bayeswrap.methods.persistence.save", "bayeswrap.methods.persistence.load"],
    "api/model.html": ["bayeswrap.methods.base.BayesianModel", "bayeswrap.methods.base.BayesianModel.predict"],
    "api/predictives.html": ["bayeswrap.methods.predictives.Sampled", "bayeswrap.methods.laplace.glm.GLM"],
    "api/optim.html": ["bayeswrap.optim.SGLD", "bayeswrap.optim.IVON"],
    "api/evaluation/calibration.html": ["bayeswrap.evaluation.calibration.fit_temperature"],
    "api/evaluation/uncertainty.html": ["bayeswrap.evaluation.uncertainty.mutual_information"],
    "api/lightning.html": ["bayeswrap.lightning.BayesianModule", "bayeswrap.lightning.BayesianCallback"],
    "api/hf.html": ["bayeswrap.hf.BayesianTrainer", "bayeswrap.hf.BayesianHooks", "bayeswrap.hf.load_state"],
    "api/accelerate.html": ["bayeswrap.accelerate.TrainingStep", "bayeswrap.accelerate.FitHooks"],
}


def _text(path: Path) -> str:
    return html.unescape(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return out


def test_one_page_per_registered_method(site):
    pages = {p.stem for p in (site / "methods").glob("*.html")} - {"index"}
    assert pages == set(METHODS)
    overview = _text(site / "methods" / "index.html")
    for name, cls in METHODS.items():
        page = _text(site / "methods" / f"{name}.html")
        assert f"{name}.html" in overview
        assert cls.__name__ in page
        options = re.search(r'id="options".*?id="background"', page, re.S)
        assert options, f"the {name} page has no Options section before its Background"
        for option in method_options(name):  # each option is a row of the table, with its default
            assert re.search(rf"<td><code>{option}</code></td>\s*<td>", options.group(0)), (name, option)


def test_api_pages_document_the_public_objects(site):
    for page, anchors in API_PAGES.items():
        text = _text(site / page)
        for anchor in anchors:
            assert f'id="{anchor}"' in text, (page, anchor)
    # the docstrings' LaTeX as MathML: ECE's ``.. math::`` block and the ``:math:`` roles
    calibration = _text(site / "api" / "evaluation" / "calibration.html")
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">' in calibration
    assert ".. math::" not in calibration and ":math:" not in calibration
    # wrap's docstring as imported: the registry fills in every registered method
    wrap = _text(site / "api" / "bayeswrap.html")
    assert "{methods}" not in wrap
    for name in METHODS:
        assert f'"{name}"' in wrap, name


def test_index_cli_and_nothing_fetched(site):
    index = _text(site / "index.html")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for heading in re.findall(r"^## (.+)$", readme, re.MULTILINE):  # the README, included as it is
        assert html.unescape(heading.replace("`", "")) in re.sub(r"<[^>]+>", "", index), heading
    cli = _text(site / "cli.html")
    for command in ("fit", "compare", "evaluate", "predict"):
        assert f"$ bayeswrap {command} --help" in cli
    assert "--method" in cli and "usage:" in cli
    for page in site.rglob("*.html"):  # no fonts, scripts or images from elsewhere (theme.font: false)
        assert "fonts.googleapis" not in page.read_text(encoding="utf-8"), page
    assert (site / "figures" / "index.html").exists() and (site / "CONTRIBUTING.html").exists()


def test_grouped_google_arguments_are_expanded():
    spec = importlib.util.spec_from_file_location("griffe_napoleon", ROOT / "docs" / "griffe_napoleon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Summary.\n\nArgs:\n    a, b: the pair,\n        continued.\n    c: alone.\n\nReturns:\n    x, y: kept."
    assert module._expand_grouped_args(text) == (
        "Summary.\n\nArgs:\n    a: the pair,\n        continued.\n    b: the pair,\n        continued.\n"
        "    c: alone.\n\nReturns:\n    x, y: kept.")

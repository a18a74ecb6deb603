"""The BayesDLL experiment configs: one file per dataset and backbone, a ``per_method`` block for the methods.

They replaced one file per (dataset, backbone, method) at commit e4ef897; every one of the 20 runs resolves to
the run configuration its old file gave.
"""

import subprocess
from pathlib import Path

import pytest

from bayeswrap.app.config import load_yaml, resolve, resolve_values

ROOT = Path(__file__).parents[1]
#: the commit that last held one config file per (dataset, backbone, method)
OLD_LAYOUT = "e4ef897"
DATASETS = ("pets", "flowers102")
BACKBONES = ("resnet101", "vit_l_32")
METHODS = ("laplace", "map", "mc_dropout", "sgld", "vi")


def _old_config(name: str) -> str:
    try:
        return subprocess.run(["git", "show", f"{OLD_LAYOUT}:configs/{name}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"the repository's history (commit {OLD_LAYOUT}) is not available here: {err}")


def test_one_config_file_per_dataset_and_backbone():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(
        ["digits.yaml", "digits_bayesdll.yaml", *(f"{d}_{b}.yaml" for d in DATASETS for b in BACKBONES)])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("dataset", DATASETS)
def test_the_composed_config_resolves_as_the_old_file(dataset, backbone, method, tmp_path):
    old_file = tmp_path / f"{dataset}_{backbone}_{method}.yaml"
    old_file.write_text(_old_config(old_file.name))
    old = resolve(str(old_file), {})
    new_file = ROOT / "configs" / f"{dataset}_{backbone}.yaml"
    new = resolve(str(new_file), {"method": method})
    assert old.method == new.method == method
    # every setting the same; per_method records the mapping the run was resolved with (the old files had none,
    # so they recorded the built-in one), and is read only while resolving
    assert {**new.to_dict(), "per_method": None} == {**old.to_dict(), "per_method": None}
    assert new.per_method == resolve(str(new_file), {}).per_method and method in new.per_method
    # and the same in ``compare --methods ...``, which resolves each method from the file's values
    compared = resolve_values(load_yaml(new_file), {"method": method}, foreign_flags="drop")
    assert {**compared.to_dict(), "per_method": None} == {**old.to_dict(), "per_method": None}

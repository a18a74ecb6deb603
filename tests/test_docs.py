"""The README stays short and runnable; figures/README.md indexes every results file with its command."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_readme_is_at_most_15_kb_and_starts_with_the_ci_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 15_000
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = ci[ci.index(next(line for line in ci if "verbatim" in line)) + 1]
    setup = readme[:readme.index("## Quick start")]
    assert test_command in setup
    assert ".venv/bin/pip install -q -e . && .venv/bin/bayeswrap compare" in setup


def test_figures_readme_has_one_line_per_results_file_with_its_command():
    index = (ROOT / "figures" / "README.md").read_text(encoding="utf-8")
    lines = [line for line in index.splitlines() if line.startswith("- ")]
    linked = {re.match(r"- \[([^\]]+)\]\(\1\)", line).group(1) for line in lines}
    assert linked == {p.name for p in (ROOT / "figures").glob("*.md")} - {"README.md"}
    assert all("Regenerate:" in line for line in lines)
    for line in lines:  # a command given verbatim names a script that exists
        for script in re.findall(r"scripts/\w+\.py", line):
            assert (ROOT / script).is_file(), script

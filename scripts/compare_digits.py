"""Regenerates the README's bundled comparison: ``bayeswrap compare`` with its defaults, copied into ``figures/``.

Runs the main job (every BayesDLL method on the bundled digits, classes 8 and 9
held out as out-of-distribution, rotation and noise shift) into a temporary
folder and copies its table and figures::

    figures/compare_digits.md, compare_digits.csv       the comparison table
    figures/compare_digits_reliability.png              reliability diagrams, one panel per method
    figures/compare_digits_shift.png                    error/NLL/ECE against shift intensity, with MAP + TS
    figures/compare_digits_risk_coverage.png            selective prediction
    figures/compare_digits_gamma.png                    γ(α) of the uncertainty measures
    figures/reliability_digits_vi_T1.png, reliability_digits_vi_Topt.png, temperature_curve_digits_vi.png

Usage (from the repository root)::

    .venv/bin/python scripts/compare_digits.py [--out figures]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bayeswrap import cli

COPIES = {
    "comparison.md": "compare_digits.md",
    "comparison.csv": "compare_digits.csv",
    "reliability.png": "compare_digits_reliability.png",
    "shift.png": "compare_digits_shift.png",
    "risk_coverage.png": "compare_digits_risk_coverage.png",
    "gamma.png": "compare_digits_gamma.png",
    "vi/reliability_T1.png": "reliability_digits_vi_T1.png",
    "vi/reliability_Topt.png": "reliability_digits_vi_Topt.png",
    "vi/temperature_curve.png": "temperature_curve_digits_vi.png",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="figures", help="folder the table and figures are copied into")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        status = cli.main(["compare", "--out-dir", tmp, "--progress", "false"])
        if status:
            return status
        seconds = time.perf_counter() - start
        base = Path(tmp) / "compare-digits-mlp"
        for src, dst in COPIES.items():
            shutil.copyfile(base / src, out / f".{dst}.tmp")
            (out / f".{dst}.tmp").replace(out / dst)
    print(f"bayeswrap compare took {seconds:.0f} s; copied {len(COPIES)} files into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

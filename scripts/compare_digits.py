"""Regenerates the README's bundled comparison: ``bayeswrap compare`` with its defaults, copied into ``figures/``.

Runs the main job (every BayesDLL method on the bundled digits, classes 8 and 9
held out as out-of-distribution, rotation and noise shift) into a temporary
folder and copies its table and figures::

    figures/compare_digits.md, compare_digits.csv       the comparison table (compact; every row and column: CSV)
    figures/compare_digits_full.md                      every row and column as Markdown
    figures/compare_digits_reliability.png              reliability diagrams, one panel per method
    figures/compare_digits_shift.png                    error/NLL/ECE against shift intensity, with MAP + TS
    figures/compare_digits_risk_coverage.png            selective prediction
    figures/compare_digits_gamma.png                    γ(α) of the uncertainty measures
    figures/reliability_digits_vi_T1.png, reliability_digits_vi_Topt.png, temperature_curve_digits_vi.png

Usage (from the repository root)::

    .venv/bin/python scripts/compare_digits.py [--out figures]
    .venv/bin/python scripts/compare_digits.py --from-run runs/compare-digits-mlp   # copy the main job's output
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box

from bayeswrap.app import cli

COPIES = {
    "comparison.md": "compare_digits.md",
    "comparison.csv": "compare_digits.csv",
    "comparison_full.md": "compare_digits_full.md",
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
    parser.add_argument("--from-run", default=None,
                        help="copy from this finished 'bayeswrap compare' folder (the main job's) instead of running it")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_run:
        _copy(Path(args.from_run), out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        status = cli.main(["compare", "--out-dir", tmp, "--progress", "false"])
        if status:
            return status
        print(f"bayeswrap compare took {time.perf_counter() - start:.0f} s")
        _copy(Path(tmp) / "compare-digits-mlp", out)
    return 0


def _copy(base: Path, out: Path) -> None:
    missing = [src for src in COPIES if not (base / src).is_file()]
    if missing:
        raise SystemExit(f"{base} is not a finished digits comparison: missing {missing}")
    for src, dst in COPIES.items():
        shutil.copyfile(base / src, out / f".{dst}.tmp")
        (out / f".{dst}.tmp").replace(out / dst)
    print(f"copied {len(COPIES)} files from {base} into {out}")


if __name__ == "__main__":
    sys.exit(main())

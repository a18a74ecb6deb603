"""``bayeswrap compare`` on digits alone and beside another torch process, under each OpenMP wait policy.

torch's CPU kernels run on OpenMP threads. With ``OMP_WAIT_POLICY=ACTIVE`` (and, for a while after each parallel
region, with libgomp's default) idle threads spin instead of sleeping, so two multi-threaded torch processes on the
same cores steal each other's time slices while neither does useful work; with ``PASSIVE`` they sleep at once, which
costs a run alone the wake-up latency of every parallel region. Unless the environment sets the variable, the CLI
sets ``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=1000`` (a short spin, then sleep:
:data:`bayeswrap.app.cli.OPENMP_SPIN_COUNT`), and every script of this folder sets ``PASSIVE`` before torch is
imported (a test checks it).

This script measures what that buys, in one run: it times ``bayeswrap compare`` (a subprocess, the command a user
types, with torch's default thread count) alone and beside a *hog* (another torch process, 2 threads, square
matrix products in a loop, with torch's own default wait policy, as a user's training job would have), for each
wait policy given to the compare, in interleaved rounds; medians are reported, with the ratio of the time beside the
hog to the time alone and the hog's own throughput beside the compare against alone.

Writes ``<out>.json`` and ``<out>.md``. The comparison's run folders go to a temporary folder that is removed.

Example::

    python scripts/thread_contention.py --out figures/thread_contention
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # this process imports torch only at the end; kept so every script sets it

if __package__ in (None, ""):  # run as a file: ``scripts`` is a package of the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bayeswrap.core.io import write_json, write_text  # noqa: E402

__all__ = ["COMPARE_ARGS", "HOG_SOURCE", "POLICIES", "main", "parse_args", "summarise"]

#: the comparison timed: digits, the CLI's defaults except fewer methods, epochs and shift levels (about 40 s alone
#: on the 2-core development machine)
COMPARE_ARGS = ("--dataset digits --methods map,vi,swag --epochs 10 --num-samples 0,5 "
                "--shift-rotations 0,45,90 --shift-noise 0,0.3 --progress false")

#: wait policies given to the compare: ``default`` leaves the variable unset, so the CLI's own choice applies
POLICIES = ("default", "ACTIVE")

#: the other torch process: 2 threads of matrix products; it prints ``ready`` once warm and, on SIGTERM or when its
#: duration has passed, its matrix products per second
HOG_SOURCE = r"""
import signal, sys, time, torch
torch.set_num_threads(2)
a = torch.randn(384, 384)
stop = [False]
signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
for _ in range(20):
    a @ a
print("ready", flush=True)
n, t0, end = 0, time.perf_counter(), time.perf_counter() + float(sys.argv[1])
while not stop[0] and time.perf_counter() < end:
    a @ a
    n += 1
print(n / (time.perf_counter() - t0), flush=True)
"""


_SPIN = re.compile(r"spin=\d+")


def parse_args(argv=None) -> argparse.Namespace:
    """The script's options: ``--repeats``, ``--policies``, ``--compare-args``, ``--hog-seconds``, ``--out``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="OMP_WAIT_POLICY values given to the compare: default (unset: the CLI's choice), PASSIVE, "
                        "ACTIVE, or spin=N (PASSIVE after N busy-wait spins: GOMP_SPINCOUNT=N) (default: "
                        "default,ACTIVE)")
    p.add_argument("--compare-args", default=COMPARE_ARGS, help="arguments of bayeswrap compare")
    p.add_argument("--hog-seconds", type=float, default=20.0, help="length of the hog's run alone (default 20)")
    p.add_argument("--out", default="figures/thread_contention", help="output path without suffix")
    args = p.parse_args(argv)
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = [s for s in args.policies if s not in ("default", "PASSIVE", "ACTIVE") and not _SPIN.fullmatch(s)]
    if bad or not args.policies:
        p.error(f"--policies {bad or args.policies!r}: accepted values are default, PASSIVE, ACTIVE, spin=N")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be at least 1")
    return args


def _env(policy: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("OMP_NUM_THREADS", None)  # torch's default thread count, as a user gets it
    env.pop("GOMP_SPINCOUNT", None)
    if policy is not None and _SPIN.fullmatch(policy):
        env["GOMP_SPINCOUNT"] = policy.split("=")[1]
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif policy not in (None, "default"):
        env["OMP_WAIT_POLICY"] = policy
    return env


def _start_hog(seconds: float) -> subprocess.Popen:
    hog = subprocess.Popen([sys.executable, "-c", HOG_SOURCE, str(seconds)], stdout=subprocess.PIPE, text=True,
                           env=_env(None))
    line = hog.stdout.readline().strip()
    if line != "ready":
        hog.kill()
        raise RuntimeError(f"the hog process did not start (printed {line!r})")
    return hog


def _hog_rate(hog: subprocess.Popen) -> float:
    out, _ = hog.communicate(timeout=60)
    return float(out.strip().splitlines()[-1])


def _compare(args: argparse.Namespace, policy: str, beside: bool, tmp: Path, tag: str) -> dict:
    cmd = [sys.executable, "-m", "bayeswrap", "compare", *shlex.split(args.compare_args),
           "--out-dir", str(tmp), "--run-name", tag]
    hog = _start_hog(1e9) if beside else None
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=_env(policy), capture_output=True, text=True)
    finally:
        seconds = time.perf_counter() - t0
        rate = None
        if hog is not None:
            hog.terminate()
            rate = _hog_rate(hog)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    return {"policy": policy, "beside_hog": beside, "seconds": seconds, "hog_rate": rate}


def summarise(runs: list[dict], hog_alone: list[float], policies: list[str]) -> list[dict]:
    """Median compare time alone and beside the hog per policy, their ratio, and the hog's throughput ratio.

    Args:
        runs: one dict per compare run: ``policy``, ``beside_hog`` (bool), ``seconds``, ``hog_rate`` (matrix
            products per second of the hog during the run, ``None`` alone).
        hog_alone: the hog's matrix products per second alone, one per round.
        policies: the policies, in the order of the rows.

    Returns:
        One row per policy: ``policy``, ``alone_s``, ``beside_s`` (medians, seconds), ``ratio``
        (``beside_s / alone_s``), ``hog_ratio`` (the hog's median rate beside the compare over its median rate
        alone; 1 = not slowed) and ``n`` (rounds).
    """
    rows = []
    for policy in policies:
        alone = [r["seconds"] for r in runs if r["policy"] == policy and not r["beside_hog"]]
        beside = [r for r in runs if r["policy"] == policy and r["beside_hog"]]
        a, b = statistics.median(alone), statistics.median(r["seconds"] for r in beside)
        hog = statistics.median(r["hog_rate"] for r in beside) / statistics.median(hog_alone)
        rows.append({"policy": policy, "alone_s": a, "beside_s": b, "ratio": b / a, "hog_ratio": hog,
                     "n": len(alone)})
    return rows


def _markdown(rows: list[dict], args: argparse.Namespace, meta: dict) -> str:
    lines = ["# `bayeswrap compare` beside another torch process", "",
             f"`bayeswrap compare {args.compare_args}` with torch's default thread count, alone and beside a "
             "2-thread torch process doing matrix products (the *hog*, at torch's own default wait policy), "
             f"median of {args.repeats} interleaved rounds; {meta['cpus']} CPUs, torch {meta['torch']}. "
             "`default` leaves `OMP_WAIT_POLICY` unset, so the CLI's own choice applies (`PASSIVE` with "
             "`GOMP_SPINCOUNT=1000`: a short spin, then sleep); `PASSIVE` alone sleeps at once; `ACTIVE` spins "
             "(libgomp's default, which the CLI had before, spins 300,000 times before sleeping); `spin=N` is "
             "`PASSIVE` with `GOMP_SPINCOUNT=N`.", "",
             "| OMP_WAIT_POLICY | alone (s) | beside the hog (s) | ratio | hog throughput beside / alone |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['alone_s']:.1f} | {r['beside_s']:.1f} | {r['ratio']:.2f}× | "
                     f"{r['hog_ratio']:.2f} |")
    lines += ["", f"Regenerate: `{meta['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """Run the rounds and write ``<out>.json`` and ``<out>.md``; returns :func:`summarise`'s rows."""
    args = parse_args(argv)
    configs = [(p, beside) for p in args.policies for beside in (False, True)]
    runs, hog_alone = [], []
    with tempfile.TemporaryDirectory(prefix="bw-contention-") as tmp:
        for k in range(args.repeats):
            hog_alone.append(_hog_rate(_start_hog(args.hog_seconds)))
            order = configs[k % len(configs):] + configs[:k % len(configs)]  # rotate to cancel drift
            for i, (policy, beside) in enumerate(order):
                run = _compare(args, policy, beside, Path(tmp), f"r{k}-{i}")
                runs.append(run)
                print(f"round {k + 1}/{args.repeats}: policy={policy} beside_hog={beside} "
                      f"{run['seconds']:.1f} s" + (f", hog {run['hog_rate']:.1f}/s" if beside else ""), flush=True)
    rows = summarise(runs, hog_alone, args.policies)
    import torch  # only for its version, after every subprocess has run

    meta = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "command": shlex.join(["python", "scripts/thread_contention.py", *(argv or sys.argv[1:])])}
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"rows": rows, "runs": runs, "hog_alone": hog_alone, "meta": meta,
                                          "compare_args": args.compare_args})
    write_text(out.with_suffix(".md"), _markdown(rows, args, meta))
    print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

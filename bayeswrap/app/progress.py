"""What ``bayeswrap compare`` shows while it works: method k of n, the tuning candidate, an overall ETA, and its
warnings counted once per method.

:class:`CompareProgress` counts a comparison's *fits*, the networks it trains: every tuning candidate and every final
run, an ensemble's counted once per member (it trains M networks). On a terminal it draws one ``tqdm`` bar over all
of them, whose text names the method (``vi 2/9``) and the candidate (``kl_weight 3/5 = 0.01, prior_std 0.333``), and
whose ETA is the whole comparison's (the average time per fit so far, ``smoothing=0``, times the fits left). Lines
(the start of each method and each tuning stage, summaries) are written above the bar. On a stream that is not a
terminal (a log file, a pipe, a test) no bar is drawn: the same lines are written, each with the fit count, elapsed
time and ETA, so a log gets a bounded number of lines (a few per method) however long the comparison runs.

:func:`counted_warnings` and :func:`warning_summary` turn the warnings of a method's many candidates (Laplace warns
once per fitted curvature) into one line per warning site with its count.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

#: the overall bar: what is being done, the fits done and the comparison's elapsed time and ETA
BAR_FORMAT = "{desc} |{bar}| {n_fmt}/{total_fmt} fits [{elapsed}<{remaining}]"


class CompareProgress:
    """The progress of one comparison over its methods, in the order they run.

    Args:
        plan: ``{method: (tuning fits, final fits)}``, in run order: the fits each method is expected to train
            (see the module docstring); a tuning stage that extends its grid adds fits as it goes
            (:meth:`fit_done` raises the total), and a method that trains fewer than planned lowers it when it ends
            (:meth:`end_method`).
        done: methods already finished (a resumed comparison): counted as done from the start, not in the rate.
        bar: draw the live bar; None: when ``file`` is a terminal.
        file: where lines and the bar go (default ``sys.stderr``).

    Use it as a context manager: while open, log records of the ``bayeswrap`` logger are written above the bar.
    """

    def __init__(self, plan: dict[str, tuple[int, int]], *, done: tuple[str, ...] = (), bar: bool | None = None,
                 file=None):
        self.file = sys.stderr if file is None else file
        self.plan = {m: (int(t), int(f)) for m, (t, f) in plan.items()}
        self.methods = list(self.plan)
        unknown = [m for m in done if m not in self.plan]
        if unknown:
            raise ValueError(f"done={list(done)}: {unknown} not in the plan; accepted: some of {self.methods}")
        self.total = sum(t + f for t, f in self.plan.values())
        self.initial = sum(sum(self.plan[m]) for m in done)
        self.n = self.initial
        self.start = time.perf_counter()
        self.method: str | None = None
        self.tuning_left = 0  # the current method's planned tuning fits not yet trained
        self._stage: tuple | None = None  # the (method, stage) of the last candidate
        if bar is None:
            bar = bool(getattr(self.file, "isatty", lambda: False)())
        self.bar = tqdm(total=self.total, initial=self.initial, file=self.file, disable=not bar, leave=True,
                        smoothing=0, dynamic_ncols=True, bar_format=BAR_FORMAT, desc="compare")
        self._redirect = contextlib.ExitStack()

    # --------------------------------------------------------------------------------------------- context
    def __enter__(self) -> CompareProgress:
        if not self.bar.disable:
            self._redirect.enter_context(logging_above_bars())
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ends the bar (left on the terminal at its last state) and the redirection of log records."""
        if not self.bar.disable and self.n >= self.total:
            self.bar.set_description_str(f"compare: {len(self.methods)} methods", refresh=False)
        self.bar.close()
        self._redirect.close()

    # --------------------------------------------------------------------------------------------- text
    def counter(self, method: str | None = None) -> str:
        """``"vi 2/9"``: the method and its place in the run order."""
        method = method or self.method
        return f"{method} {self.methods.index(method) + 1}/{len(self.methods)}"

    def status(self) -> str:
        """``"fits 12/57, 03:02 elapsed, ETA 10:15"`` (no ETA before the first fit of this session ends)."""
        elapsed = time.perf_counter() - self.start
        done = self.n - self.initial
        text = f"fits {self.n}/{self.total}, {tqdm.format_interval(elapsed)} elapsed"
        if done > 0:
            text += f", ETA {tqdm.format_interval(elapsed / done * max(self.total - self.n, 0))}"
        return text

    def write(self, line: str) -> None:
        """A line above the bar (or a plain line without one)."""
        tqdm.write(line, file=self.file)

    def say(self, text: str) -> None:
        """A line about the current method: ``compare vi 2/9: <text>``, with the status where no bar shows it."""
        status = f" [{self.status()}]" if self.bar.disable else ""
        self.write(f"compare {self.counter()}: {text}{status}")

    # --------------------------------------------------------------------------------------------- events
    def start_method(self, method: str, text: str) -> None:
        """``method`` begins (``text``: what it will do, e.g. its tuning grid)."""
        self.method = method
        self.tuning_left = self.plan[method][0]
        self._describe("")
        self.say(text)

    def candidate(self, point: dict) -> None:
        """A tuning candidate is about to be trained: ``point`` is the ``on_score`` record of
        :func:`bayeswrap.evaluation.tuning.tune_with_prior` (``stage``, ``option``, ``value``, ``index``,
        ``total``, ``fixed``).
        """
        fixed = ", ".join(f"{k} {v:g}" for k, v in point["fixed"].items())
        self._describe(f"tuning {point['option']} {point['index']}/{point['total']} = {point['value']:g}"
                       + (f", {fixed}" if fixed else ""))
        stage = (self.method, point["stage"])
        if stage != self._stage:  # a log without the bar gets a line per later stage, not per candidate
            first = self._stage is None or self._stage[0] != self.method  # the method's own line announced it
            self._stage = stage
            if self.bar.disable and not first:
                self.say(f"tuning {point['option']}" + (f" at {fixed}" if fixed else "")
                         + f" over {point['total']} candidates")

    def final_run(self) -> None:
        """The method's final run is about to start."""
        self._describe("final run")
        if self.bar.disable:
            self.say("final run")

    def fit_done(self, units: int = 1, *, tuning: bool = False) -> None:
        """``units`` fits finished; a tuning fit beyond the plan (a grid extension) raises the total."""
        if tuning:
            extra = max(units - self.tuning_left, 0)
            self.tuning_left = max(self.tuning_left - units, 0)
            if extra:
                self.total += extra
                self.bar.total = self.total
        self.n += units
        self.bar.update(units)

    def end_method(self) -> None:
        """The current method is finished: tuning fits planned but not trained leave the total."""
        if self.tuning_left:
            self.total -= self.tuning_left
            self.bar.total = self.total
            self.tuning_left = 0
            self.bar.refresh()

    def _describe(self, what: str) -> None:
        self.bar.set_description_str(f"{self.counter()}" + (f": {what}" if what else ""), refresh=True)


class _AboveBars(logging.Handler):
    """A console handler's stand-in that writes each record with ``tqdm.write`` (above any bar)."""

    def __init__(self, original: logging.StreamHandler):
        super().__init__(original.level)
        self.setFormatter(original.formatter)
        for f in original.filters:
            self.addFilter(f)
        self.stream = original.stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # as logging.StreamHandler: a broken stream never stops the run
            self.handleError(record)


@contextlib.contextmanager
def logging_above_bars() -> Iterator[None]:
    """While open, the root logger's console handlers (stdout/stderr) write above tqdm's bars, each keeping its
    level, formatter and filters (``tqdm.contrib.logging.logging_redirect_tqdm`` drops the level, so the records
    a run writes only to its ``train.log`` would reach the terminal); file handlers are left alone.
    """
    root = logging.getLogger()
    swapped = [(i, h) for i, h in enumerate(root.handlers) if type(h) is logging.StreamHandler
               and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]
    for i, h in swapped:
        root.handlers[i] = _AboveBars(h)
    try:
        yield
    finally:
        for i, h in swapped:
            root.handlers[i] = h


class _Silent:
    """A progress that shows nothing (:data:`SILENT`), for a method run outside a comparison's progress."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


#: the progress of a method tuned or run on its own (e.g. by a test): every event is ignored
SILENT = _Silent()


@contextlib.contextmanager
def counted_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Records every warning raised inside, each occurrence, instead of showing it.

    Python's filters still apply (an ``ignore`` or ``error`` filter, ``-W``, keeps its effect); a warning that no
    filter matches, which Python would show once per site and message, is recorded every time, so that it can
    be counted (:func:`warning_summary`). Yields the list the records are appended to.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", append=True)
        yield caught


def _sites(caught: list[warnings.WarningMessage]) -> dict[tuple, list[str]]:
    """``{(category, file, line): [message, ...]}`` in the order the sites first warned; messages on one line."""
    sites: dict[tuple, list[str]] = {}
    for w in caught:
        sites.setdefault((w.category.__name__, _short_path(w.filename), w.lineno), []).append(
            " ".join(str(w.message).split()))
    return sites


def warning_summary(caught: list[warnings.WarningMessage], max_chars: int | None = None) -> list[str]:
    """One line per warning site (category, file and line) with its count and its last message.

    E.g. ``"7 × RuntimeWarning at bayeswrap/methods/laplace/fitting.py:84 (6 different messages), the last: ..."``.
    Sites in the order they first warned; a multi-line message is joined into one line, and cut after
    ``max_chars`` characters (marked with "…") when given: :func:`warning_details` keeps every message whole.
    """
    lines = []
    for (category, path, lineno), messages in _sites(caught).items():
        distinct = len(set(messages))
        count = f"{len(messages)} × " if len(messages) > 1 else ""
        variety = f" ({distinct} different messages), the last" if distinct > 1 else ""
        last = messages[-1]
        if max_chars is not None and len(last) > max_chars:
            last = last[:max_chars].rstrip() + " …"
        lines.append(f"{count}{category} at {path}:{lineno}{variety}: {last}")
    return lines


def warning_details(caught: list[warnings.WarningMessage]) -> str:
    """Every distinct message of every warning site, whole, with how often it was raised (for a log file)."""
    blocks = []
    for (category, path, lineno), messages in _sites(caught).items():
        counts: dict[str, int] = {}
        for message in messages:
            counts[message] = counts.get(message, 0) + 1
        blocks.append(f"{category} at {path}:{lineno}, {len(messages)} ×:\n" + "".join(
            f"  {n} × {message}\n" for message, n in counts.items()))
    return "".join(blocks)


def _short_path(filename: str) -> str:
    """A warning's file from its package folder on (``bayeswrap/...``, ``torch/...``), else relative to the working
    folder when inside it, else as given.
    """
    parts = filename.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return "/".join(parts[i + 1:])
    if "bayeswrap" in parts[:-1]:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("bayeswrap"):])
    try:
        relative = Path(filename).resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError):
        return filename
    return relative.as_posix()

"""Run folders: where a run writes, who may write there, and what may replace or continue it.

A run folder is ``out_dir/<run_name>`` with ``run_name`` a single path
component. It carries a marker file (:data:`MARKER`) that says bayeswrap made
it, and while a process writes to it, a lock file (:data:`LOCK`) holding that
process's pid and host. The rules:

* a new run creates its folder (refusing an existing one) and takes the lock;
* ``--overwrite`` empties only a bayeswrap run folder inside ``out_dir`` that no
  live process holds; the folder itself (and so its lock) stays in place;
* a lock whose process is gone (same host, pid not alive) is stale and is
  taken over; temporary files (``.*.tmp``) a killed writer left are removed
  by whoever takes the lock.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bayeswrap._version import __version__
from bayeswrap.app.build import DataInfo, build_model, data_info, input_transform, load_splits
from bayeswrap.app.config import check_data_json, load_run_config, read_json_file
from bayeswrap.app.input_range import check_input_range
from bayeswrap.app.outputs import output_error, write_text
from bayeswrap.core.checks import check_int
from bayeswrap.core.io import CheckpointError, UnsafePathError, file_kind, load_checkpoint, pid_alive
from bayeswrap.predictive import model_device, predictive_loader, sample_probs_loader

MARKER = ".bayeswrap-run"
LOCK = ".lock"


class RunFolderError(ValueError):
    """A run folder that cannot be created, replaced, locked or continued; the message names it."""


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` is a folder bayeswrap wrote: it has the marker, or (older runs) a config.yaml and a train.log."""
    path = Path(path)
    return path.is_dir() and not path.is_symlink() and (
        (path / MARKER).is_file() or ((path / "config.yaml").is_file() and (path / "train.log").is_file()))


class RunLock:
    """An exclusive lock on a run folder: a ``.lock`` file created with ``O_EXCL`` holding ``pid host``.

    Use as a context manager, or :meth:`acquire` / :meth:`release`.

    Raises:
        RunFolderError: from :meth:`acquire`, if a live process (or one on
            another host, whose liveness cannot be checked) holds the lock.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.held = False

    def owner(self) -> tuple[int, str] | None:
        """``(pid, host)`` of a live holder, or None if the folder is not locked or the lock is stale."""
        try:
            text = self.path.read_text(encoding="utf-8").split()
            pid, host = int(text[0]), text[1]
        except FileNotFoundError:
            return None
        except (ValueError, IndexError, OSError, UnicodeDecodeError):
            return None  # half-written or garbled lock: its writer died between create and write
        if host == socket.gethostname() and not pid_alive(pid):
            return None
        return pid, host

    def check_free(self) -> None:
        """Raises RunFolderError, naming the process, if a live process holds the lock."""
        holder = self.owner()
        if holder is not None:
            raise RunFolderError(
                f"run folder {self.run_dir} is in use by process {holder[0]} on {holder[1]} (lock file "
                f"{self.path}); wait for that run to finish, or remove the lock file if that process is "
                f"gone") from None

    def acquire(self) -> RunLock:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self.check_free()
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            try:
                data = f"{os.getpid()} {socket.gethostname()}\n".encode()
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as err:  # a full disk: no empty lock file is left behind
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise output_error(err, self.path, "taking the lock: writing") from err
            os.close(fd)
            self.held = True
            remove_stale_tmp(self.run_dir)
            return self
        raise RunFolderError(f"could not take the lock {self.path}: another process keeps re-creating it")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def remove_stale_tmp(run_dir: Path) -> list[Path]:
    """Removes the temporary files (``.*.tmp``) a killed writer left in ``run_dir`` (call only under its lock)."""
    removed = []
    for tmp in Path(run_dir).glob(".*.tmp"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _write_marker(run_dir: Path, kind: str) -> None:

    write_text(run_dir / MARKER, json.dumps({"bayeswrap": __version__, "kind": kind}) + "\n")


def _inside(out_dir: Path, run_dir: Path) -> bool:
    return run_dir.resolve().parent == out_dir.resolve()


def open_new(out_dir: str | os.PathLike, name: str, *, overwrite: bool = False, kind: str = "run") -> RunLock:
    """Creates (or, with ``overwrite``, empties) ``out_dir/name`` and returns its held lock.

    Args:
        out_dir: the parent folder (created if missing).
        name: a single path component (see :func:`bayeswrap.app.config.check_run_name`).
        overwrite: replace the contents of an existing folder, if it is a
            bayeswrap run folder inside ``out_dir`` and no live process holds it.
        kind: ``"run"`` or ``"compare"``, written into the marker.

    Raises:
        RunFolderError: if the folder exists (without ``overwrite``), is not a
            bayeswrap run folder, is a symlink, lies outside ``out_dir``, or is locked.
    """
    run_dir = check_new(out_dir, name, overwrite=overwrite)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if not (run_dir.exists() or run_dir.is_symlink()):
        try:
            run_dir.mkdir()
        except FileExistsError:
            raise RunFolderError(f"run folder {run_dir} was created by another process just now") from None
        lock = RunLock(run_dir).acquire()
        try:
            _write_marker(run_dir, kind)
        except BaseException:  # a full disk: the lock goes with the failed run
            lock.release()
            raise
        return lock
    lock = RunLock(run_dir).acquire()  # refuses a live run
    try:
        clear(run_dir)
        _write_marker(run_dir, kind)
    except BaseException:
        lock.release()
        raise
    return lock


def check_new(out_dir: str | os.PathLike, name: str, *, overwrite: bool = False) -> Path:
    """The checks of :func:`open_new`, which change nothing: run before any data or weights are loaded.

    Returns:
        ``out_dir/name``, a path that does not exist or (with ``overwrite``) a replaceable run folder.

    Raises:
        RunFolderError: if the folder exists (without ``overwrite``), is not a bayeswrap run folder, is a
            symlink, lies outside ``out_dir``, or a live process holds it.
    """
    out_dir, run_dir = Path(out_dir), Path(out_dir) / name
    if not name or Path(name).name != name or name in (".", ".."):
        raise RunFolderError(f"run name {name!r} is not a single folder name")
    if not (run_dir.exists() or run_dir.is_symlink()):
        return run_dir
    refuse_symlink(run_dir, f"run folder {run_dir}", "Not writing into it, nor removing it with --overwrite; choose "
                   "another --run-name or --out-dir, or remove the link yourself")
    hint = f"pass --resume {run_dir} to continue it"
    if not overwrite:
        raise RunFolderError(f"run folder {run_dir} exists; {hint} or --overwrite to replace it")
    if not _inside(out_dir, run_dir):
        raise RunFolderError(f"--overwrite: {run_dir} lies outside out_dir={str(out_dir)!r}; not removing it")
    if not is_run_folder(run_dir):
        raise RunFolderError(f"--overwrite: {run_dir} is not a bayeswrap run folder (no {MARKER} file); not "
                             f"removing it. Choose another --run-name or --out-dir")
    RunLock(run_dir).check_free()
    return run_dir


def clear(run_dir: Path) -> None:
    """Removes everything in a run folder except its lock file (the caller holds the lock)."""
    for entry in Path(run_dir).iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def enclosing_run_folder(path: str | os.PathLike) -> Path | None:
    """The bayeswrap run or comparison folder that ``path`` (resolved) lies in, or None."""
    for folder in Path(os.path.realpath(path)).parents:
        if is_run_folder(folder):
            return folder
    return None


def check_user_output(path: str | os.PathLike, *, overwrite: bool, flag: str = "--out") -> Path:
    """A file the user asked bayeswrap to write (``predict --out``), checked before any work starts.

    Args:
        path: the destination.
        overwrite: whether an existing regular file may be replaced.
        flag: the option's name, for the messages.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        UnsafePathError: if ``path`` is a symbolic link, a device, a pipe or a folder, or lies inside a
            bayeswrap run folder (whose files only the run writes).
        ValueError: if its folder does not exist or is not a folder, or it exists without ``overwrite``.
    """
    path = Path(path)
    kind = file_kind(path)
    if kind is not None:
        raise UnsafePathError(f"{flag} {path} is {kind}; accepted: a path for a new or regular CSV file")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise ValueError(f"{flag} {path}: its folder {parent} {what}; accepted: a file path in an existing folder")
    run = enclosing_run_folder(path)
    if run is not None:
        raise UnsafePathError(f"{flag} {path} lies inside the bayeswrap run folder {run}, whose files only its run "
                              "writes; accepted: a path outside run folders")
    if path.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it")
    return path


def open_existing(run_dir: str | os.PathLike, what: str = "--resume") -> RunLock:
    """Takes the lock of an existing run folder, to continue it (``--resume``) or write into it (``evaluate``).

    Args:
        run_dir: the run folder.
        what: the command or flag that named it, for the messages.

    Raises:
        RunFolderError: if ``run_dir`` is a symbolic link (naming where it points, :func:`refuse_symlink`), is not a
            bayeswrap run folder, or is locked.
    """
    run_dir = Path(run_dir)
    refuse_symlink(run_dir, f"{what} {run_dir}: the run folder")
    if not run_dir.is_dir():
        raise RunFolderError(f"{what} {run_dir}: no such run folder")
    if not is_run_folder(run_dir):
        raise RunFolderError(f"{what} {run_dir}: not a bayeswrap run folder (no {MARKER} or config.yaml)")
    return RunLock(run_dir).acquire()


def refuse_symlink(path: str | os.PathLike, what: str, advice: str | None = None) -> None:
    """Refuses a run or method folder that is a symbolic link, saying so, where it points and what to do.

    bayeswrap writes a run folder only by its real path: through a link, a run, its lock and an ``--overwrite``
    would reach another folder's files under a name that hides them.

    Args:
        path: the folder as given.
        what: what it is, e.g. ``"--resume runs/x: the run folder"``, for the message.
        advice: what to do instead (default: pass the real path, which the message names).

    Raises:
        RunFolderError: if ``path`` is a symbolic link (a dangling one included).
    """
    path = Path(path)
    if not path.is_symlink():
        return
    target, real = os.readlink(path), os.path.realpath(path)
    exists = "" if os.path.exists(real) else ", which does not exist"
    raise RunFolderError(f"{what} is a symbolic link to {target} (resolved: {real}{exists}); bayeswrap reads and "
                         f"writes run folders only by their real path, never through a link. "
                         f"{advice or f'Pass the real path instead: {real}'}")


# --------------------------------------------------------------------------- a saved run, for prediction


@dataclass
class LoadedRun:
    """A finished run, rebuilt from its folder by :func:`load_run`.

    Attributes:
        run_dir: the run folder.
        config: its :class:`~bayeswrap.app.config.RunConfig`.
        model: the trained :class:`~bayeswrap.BayesianModel` (best checkpoint,
            finalised; eval mode, on the config's device).
        transform: PIL image -> one model input, float32 of shape ``input_shape``
            (the run's eval transform).
        class_names: the K names of the outputs, in output order.
        input_shape: the shape of one model input.
        input_range: ``[min, max]`` of the training inputs (``data.json``), or None where the run recorded none;
            new inputs are compared with it (:mod:`bayeswrap.app.input_range`).
    """

    run_dir: Path
    config: Any
    model: Any
    transform: Callable[[Any], torch.Tensor]
    class_names: list[str]
    input_shape: tuple[int, ...]
    input_range: tuple[float, float] | None = None

    @torch.no_grad()
    def sample_probs(self, inputs: torch.Tensor, num_samples: int | None = None, *, batch_size: int = 128,
                     seed: int = 0, allow_out_of_range: bool = False, source: str = "inputs") -> torch.Tensor:
        """Class probabilities under each posterior sample.

        Args:
            inputs: (N, *input_shape) model inputs (see :attr:`transform`): a tensor or a
                numpy array (or nested lists) of real numbers; integer and float64 values
                are converted, as they are, to the model's dtype.
            num_samples: S >= 0 (default: the run's ``num_samples``); 0 is the posterior mean.
                Python or numpy integers (and integral floats) are accepted.
            batch_size: inputs per forward pass, an integer >= 1 (numpy integers accepted).
            seed: seed of the posterior samples (the same seed gives the same output).
            allow_out_of_range: predict inputs far outside the training inputs' range (:attr:`input_range`)
                with a warning instead of refusing them (:func:`~bayeswrap.app.input_range.check_input_range`).
            source: what the inputs are (e.g. their file), named in the messages.

        Returns:
            (max(S, 1), N, K) float32 probabilities on the CPU.

        Raises:
            ValueError: naming the value, for inputs of the wrong shape or with
                non-finite values, or a bad ``num_samples``/``batch_size``.
            bayeswrap.app.input_range.InputRangeError: for inputs far outside the training inputs' range
                (without ``allow_out_of_range``); a modest excursion warns (``InputRangeWarning``).
        """
        s, batches, gen = self._batches(inputs, num_samples, batch_size, seed, allow_out_of_range, source)
        return sample_probs_loader(self.model, batches, s, generator=gen)[0]

    @torch.no_grad()
    def predictive(self, inputs: torch.Tensor, num_samples: int | None = None, *, batch_size: int = 128,
                   seed: int = 0, allow_out_of_range: bool = False, source: str = "inputs",
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The run's posterior predictive, as its ``metrics.json`` scored it, and the per-sample probabilities.

        The predictive is the model's own (:meth:`~bayeswrap.BayesianModel.default_predictive`: Laplace's GLM
        with its probit link, else the average over the S samples), see
        :func:`bayeswrap.predictive.predictive_loader`.

        Args:
            inputs, num_samples, batch_size, seed, allow_out_of_range, source: as :meth:`sample_probs`.

        Returns:
            ``(probs, sample_probs)``: (N, K) float64 predictive probabilities and the (max(S, 1), N, K)
            per-sample probabilities (None for a closed-form predictive at S < 2), on the CPU.

        Raises:
            ValueError: as :meth:`sample_probs`.
        """
        s, batches, gen = self._batches(inputs, num_samples, batch_size, seed, allow_out_of_range, source)
        probs, samples, _ = predictive_loader(self.model, batches, s, generator=gen)
        return probs, samples

    def _batches(self, inputs, num_samples, batch_size, seed, allow_out_of_range=False, source="inputs",
                 ) -> tuple[int, list, torch.Generator]:
        """S, the checked inputs as ``(inputs, dummy labels)`` batches, and the seeded generator of the samples."""
        s = check_int("num_samples", self.config.num_samples if num_samples is None else num_samples, minimum=0)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        if not isinstance(inputs, torch.Tensor):
            try:  # a numpy array is copied first: torch cannot view negative strides or read-only memory
                inputs = torch.as_tensor(inputs.copy() if hasattr(inputs, "__array_interface__") else inputs)
            except (TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"inputs of type {type(inputs).__name__} cannot be read as numbers ({err}); "
                                 "accepted: a tensor or numpy array of real numbers, shape (N, "
                                 f"{', '.join(map(str, self.input_shape))})") from None
        if inputs.dtype == torch.bool or inputs.is_complex():
            raise ValueError(f"inputs of dtype {inputs.dtype} are not model inputs; accepted: real numbers")
        if inputs.ndim < 1 or tuple(inputs.shape[1:]) != tuple(self.input_shape):
            raise ValueError(f"inputs of shape {tuple(inputs.shape)} do not fit this run; accepted: "
                             f"(N, {', '.join(map(str, self.input_shape))})")
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        inputs = inputs.to(dtype)  # integer or float64 arrays (numpy's default) in the model's dtype
        if not torch.isfinite(inputs).all():
            raise ValueError("inputs hold NaN or infinite values; accepted: finite numbers")
        check_input_range(inputs, self.input_range, source, allow=allow_out_of_range,
                          where=f"{self.run_dir / 'data.json'}")
        batches = [(chunk, torch.zeros(len(chunk), dtype=torch.long)) for chunk in inputs.split(batch_size)]
        gen = torch.Generator(device=model_device(self.model)).manual_seed(seed)
        return s, batches, gen


def load_run(run_dir: str | os.PathLike, *, device: str | None = None) -> LoadedRun:
    """The trained model of a finished run folder, with its input transform and class names.

    >>> run = bw.load_run("runs/digits-mlp-vi")
    >>> x = torch.stack([run.transform(img) for img in images])
    >>> probs = run.sample_probs(x, num_samples=10).mean(0)   # (N, K) posterior predictive

    The model is rebuilt from ``config.yaml`` and ``data.json`` (so the
    training data need not be present) and ``best.pt`` is loaded with
    ``weights_only=True`` and checked against its digest. No pretrained weights are downloaded.

    Args:
        run_dir: a folder written by ``bayeswrap fit`` or ``compare``.
        device: overrides the run's device (e.g. ``"cpu"``).

    Raises:
        RunFolderError: if ``run_dir`` is not a run folder, or its run has not
            finished (it has no ``metrics.json``).
        bayeswrap.core.io.CheckpointError: naming the file, if ``best.pt`` is damaged
            or does not match the config; ``bayeswrap.core.io.IntegrityError`` (a subclass),
            naming the tensor and both digests, if its contents differ from its digest.
        ValueError: if ``config.yaml`` or ``data.json`` is not valid.
    """
    from dataclasses import replace


    run_dir = Path(run_dir)
    for name in ("config.yaml", "best.pt"):
        if not (run_dir / name).is_file():
            raise RunFolderError(f"{run_dir} is not a finished run folder: it has no {name}")
    holder = RunLock(run_dir).owner()
    if holder is not None and holder != (os.getpid(), socket.gethostname()):
        raise RunFolderError(f"run folder {run_dir} is being written by process {holder[0]} on {holder[1]} (e.g. "
                             f"a fit --resume replacing best.pt); wait for it to finish")
    if not (run_dir / "metrics.json").is_file():  # best.pt is final (a fitted curvature, kept draws) only then
        raise RunFolderError(f"the run in {run_dir} has not finished (no metrics.json); finish it first: "
                             f"bayeswrap fit --resume {run_dir}")
    cfg = load_run_config(run_dir / "config.yaml")
    if device is not None:
        cfg = replace(cfg, device=device).validate()
    if (run_dir / "data.json").is_file():
        try:
            info = DataInfo(**check_data_json(read_json_file(run_dir / "data.json", what="data record"),
                                              run_dir / "data.json"))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{run_dir / 'data.json'} is not valid ({err})") from None
    else:  # runs written before data.json existed: read the data once
        info = data_info(load_splits(cfg)[0], cfg)
    bnn, _, _, backbone = build_model(cfg, info, for_evaluation=True)
    state = load_checkpoint(run_dir / "best.pt", inside=run_dir)
    try:
        bnn.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {run_dir / 'best.pt'} does not match the run's config: {err}") from None
    bnn.eval()
    return LoadedRun(run_dir=run_dir, config=cfg, model=bnn, transform=input_transform(cfg, info, backbone),
                     class_names=list(info.class_names), input_shape=tuple(info.input_shape),
                     input_range=None if info.input_range is None else tuple(info.input_range))

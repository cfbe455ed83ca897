"""Run folders, read as data (`src.records`) for `src.report`, `src.scaling` and `src.eval`; and the command-line
shell those commands share."""

import argparse
import csv
import errno
import io
import logging
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from omegaconf import DictConfig, OmegaConf

from src import records
from src.errors import UsageError
from src.folders import copied, read_bytes
from src.launch.console import print_error

RESOLVED_CONFIG = "config.yaml"
EVENT_FILES = "events.out.tfevents.*"
EVENTS_LIMIT = 64 * 2**20  # bytes of a run's event files the readers read; a long ResNet-18 run's are under 1 MiB
CSV_METRICS, CSV_HPARAMS = Path("csv", "metrics.csv"), Path("csv", "hparams.yaml")  # conf/logger/csv.yaml

T = TypeVar("T")


@contextmanager
def event_files(folder: Path) -> Iterator[Path]:
    """A copy of the run's event files, read through the folders layer (never a link or a FIFO, at most
    `EVENTS_LIMIT`), where TensorBoard's readers, which open files by their path, read them."""
    held = ExitStack()
    try:
        copy = held.enter_context(copied(folder, EVENT_FILES, EVENTS_LIMIT))
    except UsageError:
        raise UsageError(f"one of its event files ({EVENT_FILES}) is a link or not a regular file; the readers "
                         "read only files of the run's own") from None
    except OSError as error:
        if error.errno != errno.EFBIG:
            raise
        raise UsageError(f"its event files hold more than {EVENTS_LIMIT // 2**20} MiB, far more than a run's "
                         "scalars take; move them away, or read them in TensorBoard") from None
    with held:
        yield copy


def median(values: Iterable[float]) -> float | None:
    """None when there are no values (a scalar the run did not log)."""
    values = list(values)
    return statistics.median(values) if values else None


class RunFolder:
    def __init__(self, path: Path, root: Path) -> None:
        self.path = path
        relative = path.relative_to(root).as_posix()
        self.name = relative if relative != "." else path.name  # how tables name the run
        self.config: DictConfig = OmegaConf.create(records.config(path / RESOLVED_CONFIG))

    @cached_property
    def hydra(self) -> Any:
        hydra_yaml = self.path / ".hydra" / "hydra.yaml"
        return records.select(records.load(hydra_yaml, root=self.path), "hydra") if hydra_yaml.is_file() else None

    @property
    def evaluation(self) -> bool:
        """A folder of `python -m src.eval`: it scored a checkpoint and trained nothing."""
        return records.select(self.hydra, "job.name") == "eval"

    def value(self, key: str) -> Any:
        return OmegaConf.select(self.config, key)

    @cached_property
    def _events(self) -> Any:
        from tensorboard.backend.event_processing import event_accumulator

        with event_files(self.path) as copy:
            events = event_accumulator.EventAccumulator(str(copy), size_guidance={event_accumulator.SCALARS: 0,
                                                                                 event_accumulator.TENSORS: 0})
            events.Reload()
        return events

    @cached_property
    def _series(self) -> dict[str, list[tuple[int, float]]]:
        """Every scalar's (step, value) points: from the event files, else from the CSV logger's metrics.csv."""
        if any(self.path.glob(EVENT_FILES)):
            return {tag: [(int(e.step), e.value) for e in self._events.Scalars(tag)]
                    for tag in self._events.Tags()["scalars"]}
        if not (self.path / CSV_METRICS).is_file():
            raise UsageError(f"its scalars are read from TensorBoard event files or {CSV_METRICS.as_posix()}, and "
                             "it has neither: a run logged only to MLflow or W&B is read in their own tools "
                             "(logger=[mlflow,csv] logs to both)")
        series: dict[str, list[tuple[int, float]]] = {}
        metrics = read_bytes(self.path / CSV_METRICS, records.LIMIT * 64, root=self.path).decode(errors="replace")
        with io.StringIO(metrics, newline="") as file:
            for row in csv.DictReader(file):
                for tag, value in row.items():
                    if tag != "step" and value:
                        series.setdefault(tag, []).append((int(row["step"]), float(value)))
        return series

    def scalars(self, *tags: str) -> list[tuple[int, float]]:
        """(step, value) of the first of `tags` that the run logged; runs made before `xfer/` logged it as `comm/`."""
        names = [name for tag in tags for name in (tag, tag.replace("xfer/", "comm/", 1)) if name in self._series]
        return self._series[names[0]] if names else []

    def values(self, *tags: str) -> list[float]:
        return [value for _, value in self.scalars(*tags)]

    def tags(self, prefix: str) -> list[str]:
        """The scalars whose tag starts with `prefix` (`time/to_val_acc_`)."""
        return sorted(tag for tag in self._series if tag.startswith(prefix))

    def hparams(self) -> dict[str, Any]:
        """The run's HParams summary, or the CSV logger's record of it where the run has no event files."""
        if not any(self.path.glob(EVENT_FILES)):
            saved = self.path / CSV_HPARAMS
            return dict(records.load(saved, root=self.path) or {}) if saved.is_file() else {}
        try:
            content = self._events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        except KeyError:
            return {}
        from tensorboard.plugins.hparams import plugin_data_pb2

        values = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        return {name: setting(value) for name, value in values.items() if value.WhichOneof("kind")}


def setting(value: Any) -> Any:
    """An HParams value; whole numbers, recorded as text (`src.hparams.session_start`), read as numbers."""
    read = getattr(value, value.WhichOneof("kind"))
    return int(read) if isinstance(read, str) and re.fullmatch(r"-?\d+", read) else read


def find_run_dirs(root: Path) -> list[Path]:
    """Folders below `root` (itself included) with a run's config and its scalars, or its result (said when read)."""
    configs = sorted(root.glob(f"**/{RESOLVED_CONFIG}"))
    return [c.parent for c in configs if any(c.parent.glob(EVENT_FILES))
            or any((c.parent / name).is_file() for name in (CSV_METRICS, records.RESULT))]


def require_folder(root: Path) -> None:
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder; give a run folder, a sweep folder or outputs/")


def read_runs(root: Path, read: Callable[[RunFolder], T | None],
              opened: dict[Path, RunFolder] | None = None) -> list[T]:
    """`read` of every run folder below `root`, leaving out None; one that cannot be read (a damaged or hand-edited
    record) is left out with one `warning:` line, and only where none can be read is it a UsageError. `opened` is
    shared between readings of the same folders, so that each folder's event files are read once; a reading that
    finds it filled is a second one, whose warnings the first said."""
    warn = not opened
    require_folder(root)
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise UsageError(f"{root}: no run folders below it "
                         "(a run folder holds config.yaml and event files or metrics.csv)")
    # It logs every event file it opens, and at length each purge a resume asked for (the points it replays): the
    # report reads what TensorBoard shows, and its own lines are the only ones it prints.
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    found, unreadable = [], []
    for run_dir in run_dirs:
        try:
            folder = opened[run_dir] if opened is not None and run_dir in opened else RunFolder(run_dir, root)
            if opened is not None:
                opened[run_dir] = folder
            item = read(folder)
        except Exception as error:
            reason = str(error) if isinstance(error, UsageError) else \
                f"{type(error).__name__}: {' '.join(str(error).split())}"
            unreadable.append(records.shown(f"{run_dir}: left out ({reason})"))
            continue
        if item is not None:
            found.append(item)
    if warn:
        for line in unreadable[0 if found else 1:]:  # where none can be read, the first is the command's error line
            print(f"warning: {line}", file=sys.stderr, flush=True)
    if unreadable and not found:
        raise UsageError(unreadable[0])
    return found


def resolved_config_file(ckpt_path: object) -> Path:
    """`ckpt_path`: a checkpoint in its run's `checkpoints/`, or the run folder."""
    path = Path(str(ckpt_path))
    return (path if path.is_dir() else path.parent.parent) / RESOLVED_CONFIG


def resolved_config(ckpt_path: object | None) -> DictConfig | None:
    if ckpt_path is None:
        return None
    config = resolved_config_file(ckpt_path)
    return OmegaConf.create(records.config(config)) if config.is_file() else None


def output_folder(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    return out


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)  # to end as every other bad input does


@contextmanager
def usage_errors_exit() -> Iterator[None]:
    """A UsageError inside ends the command with one `error: ...` line and exit status 2; an OSError (a full disk)
    with one line and exit status 1."""
    try:
        yield
    except UsageError as error:
        print_error(records.shown(error))  # it may name a folder, or quote a record
        sys.exit(2)
    except OSError as error:  # a full disk, a folder not writable: what stopped a valid command
        print_error(records.shown(f"{error.filename}: {error.strerror}" if error.filename and error.strerror
                                  else f"{type(error).__name__}: {error}"))
        sys.exit(1)

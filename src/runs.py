"""Run folders, read: what the report (`src.report`), the scaling model (`src.scaling`) and `src.eval` know of a run.

A run folder (`outputs/runs/<run>`, or one job's folder in a sweep) holds:

- `.hydra/config.yaml`: the config as Hydra composed it; `.hydra/hydra.yaml`: Hydra's own, with the
  option chosen in each config group;
- `config.yaml`: the config resolved, as the run used it (`src.train` writes it);
- `events.out.tfevents.*`: TensorBoard's scalars and the run's HParams summary;
- `checkpoints/`: its checkpoints (`src.checkpoints`).

Also here: the command-line shell that `python -m src.report` and `python -m src.scaling` share.
"""

import argparse
import logging
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from omegaconf import DictConfig, OmegaConf

from src.errors import UsageError
from src.launch.console import print_error

COMPOSED_CONFIG = Path(".hydra", "config.yaml")
HYDRA_CONFIG = Path(".hydra", "hydra.yaml")
RESOLVED_CONFIG = "config.yaml"
EVENT_FILES = "events.out.tfevents.*"

T = TypeVar("T")


def legacy_names(tag: str) -> tuple[str, ...]:
    """Older names of a scalar: `xfer/<name>` was `comm/<name>`."""
    return ("comm/" + tag.removeprefix("xfer/"),) if tag.startswith("xfer/") else ()


def median(values: Iterable[float]) -> float | None:
    """The median; None when there are no values (a scalar the run did not log)."""
    values = list(values)
    return statistics.median(values) if values else None


class RunFolder:
    """One run folder; its events and Hydra's choices are read when first asked for."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path = path
        relative = path.relative_to(root).as_posix()
        self.name = relative if relative != "." else path.name  # how tables name the run
        self.config: DictConfig = OmegaConf.load(path / COMPOSED_CONFIG)  # type: ignore[assignment]

    @cached_property
    def choices(self) -> DictConfig | None:
        """The option chosen in each config group, as hydra.yaml recorded it; None without hydra.yaml."""
        hydra_yaml = self.path / HYDRA_CONFIG
        return OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.choices") if hydra_yaml.is_file() else None

    @cached_property
    def evaluation(self) -> bool:
        """Whether `python -m src.eval` made this folder: it scored a checkpoint and trained nothing."""
        hydra_yaml = self.path / HYDRA_CONFIG
        return hydra_yaml.is_file() and OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.job.name") == "eval"

    def value(self, key: str, group: str | None = None) -> Any:
        """A config value; `${hydra:runtime.choices.<group>}` resolves only inside the run, so it is read from hydra.yaml."""
        if group and self.choices is not None and group in self.choices and OmegaConf.is_interpolation(self.config, key):
            return self.choices[group]
        return OmegaConf.select(self.config, key)

    @cached_property
    def _events(self) -> Any:
        """TensorBoard's reader of the folder's event files (imported here: commands answer mistakes before it loads)."""
        from tensorboard.backend.event_processing import event_accumulator

        events = event_accumulator.EventAccumulator(
            str(self.path), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
        )
        events.Reload()
        return events

    def scalars(self, *tags: str) -> list[tuple[int, float]]:
        """(step, value) of the first of `tags` that the run logged; empty when it logged none of them.
        Runs made before the transfer scalars moved to `xfer/` logged them as `comm/`: read as the same."""
        logged = set(self._events.Tags()["scalars"])
        for tag in (name for tag in tags for name in (tag, *legacy_names(tag))):
            if tag in logged:
                return [(int(e.step), e.value) for e in self._events.Scalars(tag)]
        return []

    def values(self, *tags: str) -> list[float]:
        return [value for _, value in self.scalars(*tags)]

    def hparams(self) -> dict[str, Any]:
        """The run's HParams summary (`precision_used`, `world_size`, ...), empty when it has none."""
        try:
            content = self._events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        except KeyError:
            return {}
        from tensorboard.plugins.hparams import plugin_data_pb2

        values = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        return {name: getattr(value, value.WhichOneof("kind")) for name, value in values.items() if value.WhichOneof("kind")}


def find_run_dirs(root: Path) -> list[Path]:
    """Folders below `root` (itself included) that hold both a Hydra config and event files."""
    configs = sorted(root.glob(f"**/{COMPOSED_CONFIG.as_posix()}"))
    return [c.parent.parent for c in configs if any(c.parent.parent.glob(EVENT_FILES))]


def require_folder(root: Path) -> None:
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder; give a run folder, a sweep folder or outputs/")


def read_runs(root: Path, read: Callable[[RunFolder], T | None]) -> list[T]:
    """`read` of every run folder below `root`, in path order, leaving out those it returns None for.

    A folder that cannot be read (a hand-edited or truncated config) is a UsageError naming it, not a traceback.
    """
    require_folder(root)
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise UsageError(f"{root}: no run folders below it (a run folder holds .hydra/config.yaml and event files)")
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # it logs every event file it opens at INFO
    found = []
    for run_dir in run_dirs:
        try:
            item = read(RunFolder(run_dir, root))
        except Exception as error:
            reason = " ".join(str(error).split())
            raise UsageError(f"{run_dir}: cannot read this run ({type(error).__name__}: {reason})") from error
        if item is not None:
            found.append(item)
    return found


def resolved_config_file(ckpt_path: object) -> Path:
    """Where the run that wrote `ckpt_path` (a checkpoint in its `checkpoints/`, or the run folder) keeps its resolved config."""
    path = Path(str(ckpt_path))
    return (path if path.is_dir() else path.parent.parent) / RESOLVED_CONFIG


def resolved_config(ckpt_path: object | None) -> DictConfig | None:
    """The resolved config of the run that wrote `ckpt_path` (a checkpoint or a run folder), if it is there."""
    if ckpt_path is None:
        return None
    config = resolved_config_file(ckpt_path)
    return OmegaConf.load(config) if config.is_file() else None  # type: ignore[return-value]


def output_folder(out: Path) -> Path:
    """`out`, where a command writes its tables and plots; it may not exist yet, but may not be a file."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    return out


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are UsageErrors, so that they end as every other bad input does."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@contextmanager
def usage_errors_exit() -> Iterator[None]:
    """A UsageError inside ends the command with one `error: ...` line and exit status 2."""
    try:
        yield
    except UsageError as error:
        print_error(str(error))
        sys.exit(2)

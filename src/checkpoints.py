"""A run's checkpoints: `last.ckpt` (the last finished epoch), `step.ckpt` (mid-epoch, with
`checkpoint.every_n_train_steps=N`) and `best-epoch<k>.ckpt` (the best `val/acc`, of epoch k counted from 1 as train.log
counts, tested unless `test_weights=last`; folders written before name it by the epoch from 0)."""

import errno
import io
import logging
import os
import pickle
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from src.errors import UsageError
from src.folders import remove, write_file
from src.launch.console import counted
from src.launch.stops import held
from src.records import CKPT_WORDS, has_checkpoints

log = logging.getLogger(__name__)

RESUMABLE = ("last.ckpt", "step.ckpt")  # in order of preference when both hold the same step


def read_checkpoint(path: str | Path, mmap: bool = False) -> Any:
    """Tensors and plain values only: reading a file never runs code it carries (`RunState` keeps RNGs as tensors)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Written beside its final name, then renamed: Lightning's moves it from /tmp, a copy a kill can cut short.
    Read with `weights_only=True`: torch's default is unsafe under `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`."""

    def load_checkpoint(self, path: str | Path, map_location: Callable | None = lambda storage, location: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return moved(super().load_checkpoint(path, map_location=map_location, weights_only=True), Path(path).parent)

    @held()  # a stop signal during a save lets it finish: last.ckpt then holds the epoch that just ended
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        saved = io.BytesIO()  # serialized first: a full disk is then the OSError it is, not torch's zip writer's
        torch.save(checkpoint, saved)
        try:  # no half-written copy left; a linked checkpoints/ followed only where the user linked it to their own
            write_file(Path(path), saved.getbuffer(), root=Path(path).parent.parent, durable=True)
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(path)) from None

    def remove_checkpoint(self, path: str | Path) -> None:
        """A file or a link itself, never a folder's tree (Lightning's removes recursively, following a link)."""
        if not os.path.isdir(path) or os.path.islink(path):
            remove(Path(path))


def moved(checkpoint: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The callbacks' paths in the folder it is read from now, so that a moved run folder keeps its best checkpoint."""
    for state in checkpoint.get("callbacks", {}).values():
        old = state.get("dirpath") if isinstance(state, dict) else None
        if not isinstance(old, str) or old == str(folder):
            continue

        def here(value: Any) -> Any:
            return str(folder) + value[len(old):] if isinstance(value, str) and value.startswith(old) else value
        state.update({key: {here(k): v for k, v in value.items()} if isinstance(value, dict) else here(value)
                      for key, value in state.items()})
    return checkpoint


class RunCheckpoint(ModelCheckpoint):
    """Takes from a checkpoint only the paths of files this callback writes in its own folder: Lightning deletes a
    "worse" best model and the previous last one by the paths in its restored state, and a checkpoint is input."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(own_paths(state_dict, self.dirpath, self.filename, self.FILE_EXTENSION))

    @property
    def state_key(self) -> str:
        """Lightning's key for its own class: a folder saved under `ModelCheckpoint` resumes into this one."""
        return super().state_key.replace(RunCheckpoint.__qualname__, ModelCheckpoint.__qualname__, 1)


def own_paths(state: dict[str, Any], dirpath: str | None, filename: str | None, extension: str) -> dict[str, Any]:
    """A checkpoint callback's state as recorded where every path in it is `<dirpath>/<filename's fixed start>...
    <extension>` (no `..`, no other folder, no URL, no other callback's file) and its best models agree; else the
    state without paths: a callback then deletes nothing it did not write in this attempt."""
    start = (filename or "").partition("{")[0]

    def own(path: Any) -> bool:
        if not (isinstance(path, str) and dirpath and "\0" not in path):
            return False
        folder, name = os.path.split(path)
        return folder == str(dirpath) and name.startswith(start) and name.endswith(extension) and name != extension

    models = state.get("best_k_models", {})
    paths = [value for key, value in state.items() if key.endswith("_path") and value]
    if isinstance(models, dict) and all(map(own, [*paths, *models])) and (
            not models or state.get("kth_best_model_path") in models):
        return state
    return {**state, "best_k_models": {}, **{key: "" for key in ("best_model_path", "kth_best_model_path",
                                                                 "last_model_path")}}


class StepCheckpoint(RunCheckpoint):
    """`step.ckpt` every N steps, except at an epoch's last batch: a resume from it would skip the epoch's validation,
    which comes right after; one saved earlier replays the last steps."""

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if not trainer.is_last_batch:
            super().on_train_batch_end(trainer, *args)


class BestCheckpoint(RunCheckpoint):
    """Names its file by the epoch counted from 1, as train.log counts (Lightning's `{epoch}` counts from 0); readers
    find a best file by its `best-` prefix, never by that number, so folders named either way read alike."""

    def format_checkpoint_name(self, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> str:
        if "epoch" in metrics:
            metrics = {**metrics, "epoch": metrics["epoch"] + 1}
        return super().format_checkpoint_name(metrics, *args, **kwargs)


@dataclass(frozen=True)
class Saved:
    """One safe read of a checkpoint file, its contents or the error that stopped it."""

    path: Path
    contents: Any = None
    error: Exception | None = None

    @property
    def step(self) -> int:
        """-1 for a file that is no Lightning checkpoint or not a safe one."""
        step = self.contents.get("global_step") if isinstance(self.contents, dict) else None
        return int(step) if isinstance(step, int) else -1


def is_own(checkpoint: str | Path, run_dir: str | Path) -> bool:
    """A checkpoint of this run folder (a resume), not one another run left (a new run that starts from it)."""
    return Path(checkpoint).resolve().is_relative_to(Path(run_dir).resolve())


def epochs_done(saved: Saved) -> int:
    """The epochs a Lightning checkpoint has trained to their end (a mid-epoch one: those before it)."""
    loops = saved.contents.get("loops") if isinstance(saved.contents, dict) else None
    progress = (loops or {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    done = progress.get("processed")
    return done if isinstance(done, int) else -1


def check_something_left(saved: Saved | None, given: object, run_dir: Path, max_epochs: int, max_steps: int) -> None:
    """A new run from another folder's checkpoint must train: else it would test and report that run's weights and
    figures as its own. A resume of this folder may have only its test left."""
    if saved is None or is_own(saved.path, run_dir):
        return
    done, step = epochs_done(saved), saved.step
    if 0 <= max_epochs <= done or 0 < max_steps <= step:
        limit = f"max_epochs={max_epochs}" if 0 <= max_epochs <= done else f"trainer.max_steps={max_steps}"
        raise UsageError(f"ckpt_path={given}: it holds {counted(done, 'finished epoch')} ({counted(step, 'step')}), and {limit} leaves nothing "
                         f"to train; raise {limit.split('=')[0]}, or score it with src.eval ckpt_path={given}")


def open_checkpoint(path: Path) -> Saved:
    try:  # mapped: the tensors' bytes are read only where they are used
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read, a device never end it
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return Saved(path, contents=read_checkpoint(path, mmap=True))
    except Exception as error:  # kept for the check that names what is wrong with the file
        return Saved(path, error=error)


def newest(run_dir: Path) -> Saved | None:
    """The resumable checkpoint saved at the latest step; `last.ckpt` on a tie."""
    found = [open_checkpoint(path) for name in RESUMABLE if (path := run_dir / "checkpoints" / name).is_file()]
    return max(found, key=lambda saved: saved.step, default=None)  # max keeps the first of equal steps


def no_checkpoint(ckpt_path: object, run_dir: Path, hint: str = "") -> UsageError:
    """`ckpt_path` names `run_dir`, which holds no resumable checkpoint."""
    return UsageError(f"ckpt_path={ckpt_path}: no checkpoint in {run_dir / 'checkpoints'} "
                      f"(looked for {' and '.join(RESUMABLE)}){hint}")


def clean_partial(run_dir: Path) -> None:
    """The `.partial` files of an attempt killed while writing: the run holding the folder is its only writer."""
    for partial in [*(run_dir / "checkpoints").glob(".*.ckpt.*.partial"), *run_dir.glob(".*.*.partial")]:
        if re.fullmatch(r"\..+\.\d+\.partial", partial.name):
            remove(partial, root=run_dir)


def check_new_run(run_dir: Path) -> None:
    """A new run (no `ckpt_path`) in a folder that holds another run's checkpoints is refused: it would overwrite them."""
    if has_checkpoints(run_dir):
        raise UsageError(f"hydra.run.dir={run_dir} already holds a run's checkpoints; resume it with "
                         "ckpt_path=last (or ckpt_path=auto), or leave hydra.run.dir out to start a new run in a "
                         "new folder")


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> Saved | None:
    """The checkpoint a run starts from: none (in a folder without checkpoints), the newest resumable one (`last`; with
    `auto`, none where there is none, for launchers that restart a run), or a file."""
    if ckpt_path is None:
        check_new_run(run_dir)
        return None
    value = str(ckpt_path)
    if value in CKPT_WORDS:
        found = newest(run_dir)
        if found is None and value == "last":  # `auto`: a new run where there is none
            raise no_checkpoint(value, run_dir, "; name the run folder with hydra.run.dir=<run folder>")
        return found
    path = Path(value)
    if not path.is_file():
        raise UsageError(f"ckpt_path={value}: no checkpoint at {path}; give a .ckpt file, `last` or `auto`")
    return open_checkpoint(path)


def tested_weights(path: Path | None) -> str:
    """`best` or `last` for the weights a run tested (None: those training ended with); another file by its name."""
    if path is None or path.name in RESUMABLE:
        return "last"
    return "best" if path.name.startswith("best-") else path.name


def checkpoint_to_evaluate(ckpt_path: str | None, test_weights: str = "best") -> Saved:
    """A file, or a run folder's best checkpoint (`test_weights=best`, where it has one) or newest one."""
    if ckpt_path is None:
        raise UsageError("ckpt_path is required: give a .ckpt file or a run folder, e.g. ckpt_path=outputs/runs/<run>")
    path = Path(str(ckpt_path))
    if path.is_dir():
        # The one written last: each new best val/acc replaces the one before.
        best = max((path / "checkpoints").glob("best-*.ckpt"), key=lambda file: file.stat().st_mtime, default=None)
        if best and test_weights == "best":
            return open_checkpoint(best)
        found = newest(path)
        if found is None:
            raise no_checkpoint(ckpt_path, path)
        if test_weights == "best":
            log.info(f"test_weights=best: {path} holds no best-*.ckpt (it ran without validation); "
                     f"scoring its last weights, {found.path.name}")
        return found
    if not path.is_file():
        raise UsageError(f"ckpt_path={ckpt_path}: no checkpoint at {path}; give a .ckpt file or a run folder")
    return open_checkpoint(path)


def unreadable(error: Exception) -> str:
    """Why torch could not read a file, in words: torch's own messages advise calling torch.save differently."""
    text = str(error)
    if "mmap can only be used" in text:
        return "it is not in the format torch.save writes"
    if "zip archive" in text or "inline_container" in text:
        return "it is damaged or cut short, or a zip archive that torch did not write"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def check_readable(saved: Saved | None, given: object) -> None:
    """Only tensors and plain values (unpickling anything else could run code the file carries), in a readable file."""
    if saved is None or saved.error is None:
        return
    if isinstance(saved.error, pickle.UnpicklingError) and str(saved.error).startswith("Weights only load failed"):
        named = re.search(r"GLOBAL (\S+)", str(saved.error))  # what torch's weights-only unpickler refused
        refused = named.group(1) if named else "an object that is no tensor or plain value"
        raise UsageError(f"ckpt_path={given} is not allowed; {saved.path} is not a safe checkpoint: it holds objects "
                         f"that cannot be loaded safely ({refused}); a checkpoint is read as tensors and plain values "
                         "only, so that loading it cannot run code")
    others = sorted(p.name for p in saved.path.parent.glob("*.ckpt") if p != saved.path)
    beside = f"; beside it: {', '.join(others)}, which ckpt_path=<file> takes" if others else ""
    raise UsageError(f"ckpt_path={given} is not allowed; {saved.path} is not a checkpoint file "
                     f"({unreadable(saved.error)}){beside}")


def check_checkpoint(saved: Saved | None, given: object, module: torch.nn.Module, model_name: str) -> None:
    """A safe, readable Lightning checkpoint of this very model."""
    check_readable(saved, given)
    if saved is None:
        return
    weights = saved.contents.get("state_dict") if isinstance(saved.contents, dict) else None
    if not isinstance(weights, dict):
        raise UsageError(f"ckpt_path={given} is not allowed; {saved.path} is not a Lightning checkpoint "
                         "(it holds no state_dict)")
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    if expected == found:
        check_optimizer_state(saved, given, [tuple(p.shape) for p in module.parameters()])
        return
    differences = [f"{k} {found[k]} here {expected[k]}" for k in expected.keys() & found.keys()
                   if expected[k] != found[k]]
    differences += [f"{k} missing" for k in expected.keys() - found.keys()]
    differences += [f"{k} not in model={model_name}" for k in found.keys() - expected.keys()]
    raise UsageError(f"ckpt_path={given} is not allowed; it holds another model than model={model_name} "
                     f"({len(differences)} weights differ, e.g. {sorted(differences)[0]}); "
                     "use the model it was trained with")


def check_optimizer_state(saved: Saved, given: object, shapes: list[tuple[int, ...]]) -> None:
    """The optimizer's state (momentum, Adam's moments) shaped as the parameters it belongs to, in their order (the
    Classifier hands the optimizer `parameters()`): else the resume failed at its first step with torch's traceback."""
    for optimizer in saved.contents.get("optimizer_states") or []:
        state = optimizer.get("state") if isinstance(optimizer, dict) else None
        for index, values in (state or {}).items() if isinstance(state, dict) else ():
            for name, value in (values or {}).items() if isinstance(values, dict) else ():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and (
                        not isinstance(index, int) or not 0 <= index < len(shapes) or tuple(value.shape) != shapes[index]):
                    here = shapes[index] if isinstance(index, int) and 0 <= index < len(shapes) else "no such parameter"
                    raise UsageError(f"ckpt_path={given} is not allowed; {saved.path}'s optimizer state {name} of "
                                     f"parameter {index} is shaped {tuple(value.shape)}, the parameter {here}: it is "
                                     "damaged or of another model; resume from another checkpoint")

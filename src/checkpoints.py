"""Where a run's checkpoints live, how they are written, and which one `ckpt_path` resumes.

A run folder's `checkpoints/` holds:

- `last.ckpt`: the end of the last finished epoch, rewritten after every epoch;
- `step.ckpt`: with `checkpoint.every_n_train_steps=N`, the newest mid-epoch state, every N steps;
- `best-epoch<k>.ckpt`: the epoch with the best `val/acc`.

A run tests, and `python -m src.eval` given a run folder scores, the best checkpoint unless
`test_weights=last`; a run that saved none (validation off) tests its last weights instead.
"""

import io
import logging
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from src.errors import UsageError
from src.launch.stops import held

log = logging.getLogger(__name__)

RESUMABLE = ("last.ckpt", "step.ckpt")  # in order of preference when both hold the same step
CKPT_WORDS = ("last", "auto")


def read_checkpoint(path: str | Path, mmap: bool = False) -> Any:
    """A checkpoint's contents, unpickled as tensors and plain values only, so that reading a file never runs
    code it carries. A run's own checkpoints hold nothing else (`RunState` keeps its generators as tensors)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def unsafe_content(error: BaseException) -> str | None:
    """What torch's weights-only unpickler refused in a file, e.g. `getattr`; None for any other failure
    (a truncated or foreign file), which says nothing about what the file would run."""
    message = str(error)
    if not isinstance(error, pickle.UnpicklingError) or not message.startswith("Weights only load failed"):
        return None
    named = re.search(r"GLOBAL (\S+)", message)
    return named.group(1) if named else "an object that is no tensor or plain value"


def keep_storage(storage: Any, location: str) -> Any:
    """Lightning's default `map_location`: every tensor stays where it was saved."""
    return storage


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint beside its final name, then renames it into place; reads one as tensors and
    plain values only.

    Lightning's own save goes through a temporary file in /tmp and a move, which is a copy when
    /tmp is another filesystem: a run killed during that copy would leave a truncated `last.ckpt`.
    Lightning's own load (`trainer.fit(ckpt_path=...)`, a SLURM requeue's `hpc_ckpt_*.ckpt`) leaves
    `weights_only` to torch, whose default turns unsafe under `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`.
    """

    def load_checkpoint(
        self, path: str | Path, map_location: Callable | None = keep_storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return moved(super().load_checkpoint(path, map_location=map_location, weights_only=True), Path(path).parent)

    @held()  # a stop signal during a save lets it finish: last.ckpt then holds the epoch that just ended
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        saved = io.BytesIO()  # serialized first: a full disk is then the OSError it is, not torch's zip writer's
        torch.save(checkpoint, saved)
        try:
            with open(partial, "wb") as file:
                file.write(saved.getbuffer())
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, path)
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(path)) from None
        finally:  # no half-written copy left in the run folder
            partial.unlink(missing_ok=True)


def moved(checkpoint: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A checkpoint of a run folder moved or copied since: its checkpoint callbacks' paths (their folder, the best
    checkpoint's file) in the folder it is read from now, so that the resumed run keeps its best checkpoint as it was."""
    for state in checkpoint.get("callbacks", {}).values():
        old = state.get("dirpath") if isinstance(state, dict) else None
        if not isinstance(old, str) or old == str(folder):
            continue
        def here(value: Any) -> Any:
            return str(folder) + value[len(old):] if isinstance(value, str) and value.startswith(old) else value
        state.update({key: {here(k): v for k, v in value.items()} if isinstance(value, dict) else here(value)
                      for key, value in state.items()})
    return checkpoint


class StepCheckpoint(ModelCheckpoint):
    """`checkpoints/step.ckpt` every `checkpoint.every_n_train_steps` steps, except at an epoch's last batch: the epoch's
    validation and last.ckpt come right after it, and a resume from a step saved before them would skip that validation
    (its best checkpoint, its val/* scalars): one saved earlier in the epoch replays the last steps instead."""

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if not trainer.is_last_batch:
            super().on_train_batch_end(trainer, *args)


@dataclass(frozen=True)
class Saved:
    """A checkpoint file and what one safe read of it gave: its contents, or the error that stopped the read.

    Read once before a run starts, it serves every question asked of the file then (which is newest,
    is it safe, does it fit the model, at which step was it saved); Lightning reads it again to resume.
    """

    path: Path
    contents: Any = None
    error: Exception | None = None

    @property
    def step(self) -> int:
        """The optimizer step it was saved at; -1 for a file that is no Lightning checkpoint or not a safe one."""
        step = self.contents.get("global_step") if isinstance(self.contents, dict) else None
        return int(step) if isinstance(step, int) else -1


def open_checkpoint(path: Path) -> Saved:
    """One safe read of `path`, mapped: the tensors' bytes are read only where they are used."""
    try:
        return Saved(path, contents=read_checkpoint(path, mmap=True))
    except Exception as error:  # kept for the check that names what is wrong with the file
        return Saved(path, error=error)


def newest(run_dir: Path) -> Saved | None:
    """The resumable checkpoint of `run_dir` saved at the latest step; `last.ckpt` on a tie."""
    found = [open_checkpoint(path) for name in RESUMABLE if (path := run_dir / "checkpoints" / name).is_file()]
    return max(found, key=lambda saved: saved.step, default=None)  # max keeps the first of equal steps


def clean_partial(run_dir: Path) -> None:
    """Remove what an attempt killed while writing left half-written (`AtomicCheckpointIO`'s `.partial` files): the
    run that holds the folder now is its only writer."""
    for partial in [*(run_dir / "checkpoints").glob(".*.partial"), *run_dir.glob(".*.partial")]:
        partial.unlink(missing_ok=True)


def has_checkpoints(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(folder.glob("*.ckpt"))


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> Saved | None:
    """The checkpoint a run starts from, read once.

    - null: none; a run folder that already holds checkpoints is not overwritten by a new run;
    - `last`: the newest of the run folder's `last.ckpt` and `step.ckpt`, which must exist;
    - `auto`: the same if there is one, else a fresh start (for launchers that restart a run);
    - a file: that checkpoint.
    """
    if ckpt_path is None:
        if has_checkpoints(run_dir):
            raise UsageError(
                f"hydra.run.dir={run_dir} already holds a run's checkpoints; resume it with ckpt_path=last "
                "(or ckpt_path=auto), or leave hydra.run.dir out to start a new run in a new folder"
            )
        return None
    value = str(ckpt_path)
    if value in CKPT_WORDS:
        found = newest(run_dir)
        if found is None and value == "last":
            raise UsageError(
                f"ckpt_path=last: no checkpoint in {run_dir / 'checkpoints'} (looked for {' and '.join(RESUMABLE)}); "
                "name the run folder with hydra.run.dir=<run folder>"
            )
        return found
    path = Path(value)
    if not path.is_file():
        raise UsageError(f"ckpt_path={value}: no checkpoint at {path}; give a .ckpt file, `last` or `auto`")
    return open_checkpoint(path)


def best_checkpoint(run_dir: Path) -> Path | None:
    """The run's `best-*.ckpt` written last: one is kept, and each new best `val/acc` replaces the one before."""
    found = sorted((run_dir / "checkpoints").glob("best-*.ckpt"), key=lambda path: path.stat().st_mtime)
    return found[-1] if found else None


def tested_weights(path: Path | None) -> str:
    """`best` or `last` for the weights a run tested (None: those training ended with); another file by its name."""
    if path is None or path.name in RESUMABLE:
        return "last"
    return "best" if path.name.startswith("best-") else path.name


def checkpoint_to_evaluate(ckpt_path: str | None, test_weights: str = "best") -> Saved:
    """A checkpoint file, or a run folder standing for its best checkpoint (`test_weights=best`, when it
    has one) or its newest resumable one, read once."""
    if ckpt_path is None:
        raise UsageError("ckpt_path is required: give a .ckpt file or a run folder, e.g. ckpt_path=outputs/runs/<run>")
    path = Path(str(ckpt_path))
    if path.is_dir():
        best = best_checkpoint(path) if test_weights == "best" else None
        if best is not None:
            return open_checkpoint(best)
        found = newest(path)
        if found is None:
            raise UsageError(f"ckpt_path={ckpt_path}: no checkpoint in {path / 'checkpoints'} (looked for {' and '.join(RESUMABLE)})")
        if test_weights == "best":
            log.info(f"test_weights=best: {path} holds no best-*.ckpt (it ran without validation); scoring its last weights, {found.path.name}")
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
    """A checkpoint to resume or score holds only tensors and plain values (unpickling anything else could run code the
    file carries), and is one torch can read."""
    if saved is None or saved.error is None:
        return
    if (refused := unsafe_content(saved.error)) is not None:
        raise UsageError(f"ckpt_path={given} is not allowed; {saved.path} is not a safe checkpoint: it holds objects that "
                         f"cannot be loaded safely ({refused}); a checkpoint is read as tensors and plain values only, so "
                         "that loading it cannot run code")
    others = sorted(p.name for p in saved.path.parent.glob("*.ckpt") if p != saved.path)
    beside = f"; beside it: {', '.join(others)}, which ckpt_path=<file> takes" if others else ""
    raise UsageError(f"ckpt_path={given} is not allowed; {saved.path} is not a checkpoint file "
                     f"({unreadable(saved.error)}){beside}")


def check_checkpoint(saved: Saved | None, given: object, module: torch.nn.Module, model_name: str) -> None:
    """A checkpoint to resume or score must be a safe, readable Lightning checkpoint of this very model."""
    check_readable(saved, given)
    if saved is None:
        return
    weights = saved.contents.get("state_dict") if isinstance(saved.contents, dict) else None
    if not isinstance(weights, dict):
        raise UsageError(f"ckpt_path={given} is not allowed; {saved.path} is not a Lightning checkpoint (it holds no state_dict)")
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    if expected == found:
        return
    differences = [f"{k} {found[k]} here {expected[k]}" for k in expected.keys() & found.keys() if expected[k] != found[k]]
    differences += [f"{k} missing" for k in expected.keys() - found.keys()]
    differences += [f"{k} not in model={model_name}" for k in found.keys() - expected.keys()]
    raise UsageError(f"ckpt_path={given} is not allowed; it holds another model than model={model_name} "
                     f"({len(differences)} weights differ, e.g. {sorted(differences)[0]}); use the model it was trained with")


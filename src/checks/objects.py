"""Checks of what the config built and of this machine: the hardware asked for, the model, the checkpoint to
resume from, and Lightning's own refusals of a Trainer argument, each as one line. They need torch and
Lightning, which the command line's checks (`src.checks`) leave unimported."""

import importlib.util
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning import LightningModule
from lightning.fabric.utilities.exceptions import MisconfigurationException

from src.checkpoints import Saved, unsafe_content
from src.checks import not_allowed
from src.checks.lightning_names import trainer_arguments
from src.errors import UsageError
from src.launch.console import counted


def check_hardware(accelerator: str, precision: str, devices: int) -> None:
    """The requested accelerator, device count and precision exist on this machine."""
    cuda = torch.cuda.is_available()
    if accelerator in ("gpu", "cuda") and not cuda:
        raise UsageError(f"accelerator={accelerator} but this machine has no CUDA device; use accelerator=cpu")
    on_gpu = cuda and accelerator != "cpu"
    if on_gpu and devices > torch.cuda.device_count():
        raise UsageError(f"devices={devices} but this machine has {counted(torch.cuda.device_count(), 'CUDA device')}")
    if precision.startswith("transformer-engine") and (not on_gpu or not importlib.util.find_spec("transformer_engine")):
        raise UsageError(f"precision={precision} is not allowed here; it needs a CUDA GPU and the transformer_engine package")


@contextmanager
def trainer_input_errors() -> Iterator[None]:
    """Lightning's own refusals of a Trainer argument that only the data can judge, as one line.

    E.g. `trainer.val_check_interval=500` with 4 training batches, or a `limit_train_batches`
    fraction that leaves no batch. Only errors that name a Trainer argument are translated.
    """
    try:
        yield
    except (MisconfigurationException, ValueError) as error:
        named = [name for name in re.findall(r"`(?:Trainer\()?(\w+)", str(error)) if name in trainer_arguments()]
        if not named:
            raise
        raise UsageError(f"trainer.{named[0]}: {' '.join(str(error).split())}") from error


# --- the objects the config names -----------------------------------------------------------------------------


def check_model(module: object, target: object) -> None:
    """What `model=<option>` built must be a LightningModule: the Trainer takes nothing else."""
    if not isinstance(module, LightningModule):
        raise not_allowed("model._target_", target,
                          "it must name a LightningModule, e.g. src.models.module.Classifier with the network under model.net")


# --- what a run resumes from ---------------------------------------------------------------------------------


def unreadable_checkpoint(error: Exception) -> str:
    """Why torch could not read a file, in words: torch's own messages advise calling torch.save differently."""
    text = str(error)
    if "mmap can only be used" in text:
        return "it is not in the format torch.save writes"
    if "zip archive" in text or "inline_container" in text:
        return "it is damaged or cut short, or a zip archive that torch did not write"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def check_checkpoint(saved: Saved | None, given: object, module: torch.nn.Module, model_name: str) -> None:
    """A checkpoint to resume must be a Lightning checkpoint of this very model, known before training starts,
    and hold only tensors and plain values: unpickling anything else could run code the file carries."""
    if saved is None:
        return
    path = saved.path
    if saved.error is not None:
        if (refused := unsafe_content(saved.error)) is not None:
            raise not_allowed(
                "ckpt_path", given,
                f"{path} is not a safe checkpoint: it holds objects that cannot be loaded safely ({refused}); "
                "a checkpoint is read as tensors and plain values only, so that loading it cannot run code",
            )
        raise not_allowed("ckpt_path", given, f"{path} is not a checkpoint file ({unreadable_checkpoint(saved.error)})")
    weights = saved.contents.get("state_dict") if isinstance(saved.contents, dict) else None
    if not isinstance(weights, dict):
        raise not_allowed("ckpt_path", given, f"{path} is not a Lightning checkpoint (it holds no state_dict)")
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    if expected == found:
        return
    differences = [f"{k} {found[k]} here {expected[k]}" for k in expected.keys() & found.keys() if expected[k] != found[k]]
    differences += [f"{k} missing" for k in expected.keys() - found.keys()]
    differences += [f"{k} not in model={model_name}" for k in found.keys() - expected.keys()]
    raise not_allowed(
        "ckpt_path", given,
        f"it holds another model than model={model_name} ({len(differences)} weights differ, e.g. {sorted(differences)[0]}); "
        "use the model it was trained with",
    )

"""Checks of user input, done once and early, each failing with one line that names the option."""

import inspect
import logging
import typing
from pathlib import Path

import lightning
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from src.errors import UsageError

log = logging.getLogger(__name__)
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PRECISIONS = list(dict.fromkeys(str(p) for arg in typing.get_args(_PRECISION_INPUT) for p in typing.get_args(arg)))
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
# Trainer arguments that the top-level keys own; `trainer.<name>` may not set them.
OWNED_BY_TOP_LEVEL = {"accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks",
                      "max_epochs", "sync_batchnorm", "default_root_dir", "use_distributed_sampler", "plugins"}


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_overrides(args: list[str]) -> None:
    """Reject `group=unknown` and `trainer.unknown=...` in one line, before Hydra prints its multi-line error."""
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:
        return  # not ours to judge: Hydra reports syntax errors itself
    for override in overrides:
        group = override.key_or_group
        if group.startswith("trainer.") and not override.is_delete():
            check_trainer_args({group.removeprefix("trainer."): None})
        if override.is_delete() or not (CONF_DIR / group).is_dir() or group.split("/")[0] == "hydra":
            continue
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        allowed = group_options(group)
        for value in values:
            if value is not None and str(value) not in allowed:
                raise UsageError(f"{group}={value} is not an option; choose one of: {', '.join(allowed)}")


def positive_int(cfg: DictConfig, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{key}={value} is not allowed; {key} must be a whole number of at least 1")
    return value


def resolve_accelerator(requested: str) -> str:
    """`auto` becomes `gpu` when CUDA is there, else `cpu`; asking for a missing GPU is an error."""
    requested = str(requested)
    if requested not in ACCELERATORS:
        raise UsageError(f"accelerator={requested} is not allowed; choose one of: {', '.join(ACCELERATORS)}")
    if requested == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if requested in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UsageError(f"accelerator={requested} but this machine has no CUDA device; use accelerator=cpu")
    return "gpu" if requested == "cuda" else requested


def resolve_precision(requested: object, accelerator: str) -> str:
    """The precision Lightning will really use: fp16 autocast exists only on CUDA, so CPU gets bf16."""
    precision = str(requested)
    if precision not in PRECISIONS:
        raise UsageError(f"precision={precision} is not allowed; choose one of: {', '.join(PRECISIONS)}")
    if accelerator == "cpu" and precision in ("16", "16-mixed"):
        if rank_zero_only.rank == 0:
            log.warning(f"precision={precision} needs a CUDA GPU; this CPU run uses bf16-mixed instead")
        return "bf16-mixed"
    return precision


def check_devices(accelerator: str, devices: int) -> None:
    if accelerator == "gpu" and devices > torch.cuda.device_count():
        raise UsageError(f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_trainer_args(trainer_cfg: dict) -> None:
    known = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    for key in trainer_cfg:
        if key in OWNED_BY_TOP_LEVEL:
            raise UsageError(f"trainer.{key} is set by the top-level key; use {key}=... instead")
        if key not in known:
            raise UsageError(f"trainer.{key} is not a lightning.Trainer argument")

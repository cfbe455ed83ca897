"""Hydra's `instantiate` for what a config group names, its failure as one line naming the group.

A model file whose class cannot be found, or a strategy whose hook state refuses its arguments,
ends in one `error:` line with Hydra's reason instead of a traceback.
"""

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.errors import UsageError


def build(group: str, cfg: DictConfig, **kwargs: Any) -> Any:
    try:
        return instantiate(cfg, **kwargs)
    except InstantiationException as error:
        raise UsageError(f"{group}: {' '.join(str(error).split())}") from None

"""The optimizer of a run, from the `optim` config group, with its learning rate scaled to the global batch.

`conf/optim/<name>.yaml` names an optimizer class as a Hydra partial (`_target_`, `_partial_: true`)
and its arguments; `optim.lr_scaling=none|linear` and `optim.base_batch_size` are read here and
never reach the optimizer. With more processes the global batch grows and SGD takes fewer,
larger-batch steps per epoch. The linear rule (Goyal et al., 2017) keeps the update per sample
about the same by scaling the learning rate with the batch: lr_used = lr * global_batch / base_batch_size.
"""

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from src.errors import UsageError

LR_SCALINGS = ("none", "linear")
SCALING_KEYS = ("lr_scaling", "base_batch_size")


def scaled_lr(lr: float, global_batch: int, lr_scaling: str = "none", base_batch_size: int = 256) -> float:
    """`lr` as given (`none`) or times global_batch / base_batch_size (`linear`)."""
    if lr_scaling not in LR_SCALINGS:
        raise UsageError(f"optim.lr_scaling={lr_scaling} is not an option; choose one of: {', '.join(LR_SCALINGS)}")
    if isinstance(base_batch_size, bool) or not isinstance(base_batch_size, int) or base_batch_size < 1:
        raise UsageError(
            f"optim.base_batch_size={base_batch_size} is not allowed; it must be a whole number of at least 1"
        )
    if lr_scaling == "linear":
        return lr * global_batch / base_batch_size
    return lr


def optimizer_config(optim: Mapping[str, Any], global_batch: int) -> dict[str, Any]:
    """The `optim` config as the optimizer takes it: scaling keys consumed, `lr` the one used."""
    args = OmegaConf.to_container(optim, resolve=True) if OmegaConf.is_config(optim) else dict(optim)
    assert isinstance(args, dict)
    lr_scaling = args.pop("lr_scaling", "none")
    base_batch_size = args.pop("base_batch_size", 256)
    args["lr"] = scaled_lr(args["lr"], global_batch, lr_scaling, base_batch_size)
    return args


def build_optimizer(optim: Mapping[str, Any], global_batch: int) -> functools.partial:
    """The optimizer as a partial that takes the parameters, as the Classifier calls it."""
    args = optimizer_config(optim, global_batch)
    if not args.get("_partial_"):
        raise UsageError(f"optim: the optimizer config must have `_partial_: true` (the Classifier passes its parameters); "
                         f"add it to conf/optim/<file> beside _target_: {args.get('_target_')}")
    try:
        return instantiate(args, _convert_="all")
    except InstantiationException as error:
        raise UsageError(f"optim._target_={args.get('_target_')}: {str(error).splitlines()[0]}") from None


def check_optimizer(factory: functools.partial, params: Iterable[nn.Parameter]) -> None:
    """Build the optimizer once, before any process starts, so a bad argument is one line, not a traceback in fit."""
    try:
        factory(params)
    except (TypeError, ValueError) as error:
        target = getattr(factory.func, "__qualname__", str(factory.func))
        raise UsageError(f"optim: {target} refuses its arguments ({str(error).splitlines()[0]}); "
                         "see conf/optim/ and the optimizer's documentation") from None

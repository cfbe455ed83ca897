"""The optimizer of a run (`conf/optim/`, a Hydra partial), its learning rate scaled to the global batch and scheduled.
`optim.lr_scaling`, `base_batch_size`, `schedule` and `warmup` are read here and never reach the optimizer."""

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from src.errors import UsageError


def scaled_lr(lr: float, global_batch: int, lr_scaling: str = "none", base_batch_size: int = 256) -> float:
    """The linear rule (Goyal et al., 2017) keeps the update per sample about the same."""
    return lr * global_batch / base_batch_size if lr_scaling == "linear" else lr


def build_optimizer(optim: Mapping[str, Any], global_batch: int) -> functools.partial:
    args = OmegaConf.to_container(optim, resolve=True) if OmegaConf.is_config(optim) else dict(optim)
    assert isinstance(args, dict)
    scaling = [args.pop(name, default) for name, default in (("lr_scaling", "none"), ("base_batch_size", 256))]
    for name in ("schedule", "warmup"):
        args.pop(name, None)
    args["lr"] = scaled_lr(args["lr"], global_batch, *scaling)
    try:
        return instantiate(args, _convert_="all")
    except InstantiationException as error:
        raise UsageError(f"optim._target_={args.get('_target_')}: {str(error).splitlines()[0]}") from None


def check_optimizer(factory: functools.partial, params: Iterable[nn.Parameter]) -> None:
    """Build the optimizer once before fitting, so that a bad argument is one line, not a traceback inside fit."""
    try:
        factory(params)
    except (TypeError, ValueError) as error:
        target = getattr(factory.func, "__qualname__", str(factory.func))
        raise UsageError(f"optim: {target} refuses its arguments ({str(error).splitlines()[0]}); "
                         "see conf/optim/ and the optimizer's documentation") from None


def fused_under_a_scaler(factory: Callable[..., Optimizer], trainer: Any) -> Callable[..., Optimizer]:
    """The fused kernel where 16-mixed scales the loss on CUDA: it reads the found-inf flag on the GPU, where
    GradScaler.step would wait for it. Not under gradient clipping (unscaled first), nor where the config chose."""
    chosen = getattr(factory, "keywords", {}).keys() & {"fused", "foreach"}
    if (getattr(trainer.precision_plugin, "scaler", None) is None or trainer.strategy.root_device.type != "cuda"
            or trainer.gradient_clip_val or chosen or "fused" not in inspect.signature(factory).parameters):
        return factory
    return functools.partial(factory, fused=True)


class Schedule:
    """A factor of `lr` per optimizer step: `none`, or `cosine`, rising over the first `warmup` share of the steps, then
    falling along a half cosine to zero. Not a dataclass: Hydra's `instantiate` would turn one into a config."""

    def __init__(self, name: str = "none", warmup: float = 0.0) -> None:
        self.name, self.warmup = name, warmup

    def factor(self, step: int, total_steps: int) -> float:
        if self.name == "none":
            return 1.0
        warmup_steps = round(self.warmup * total_steps)
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def scheduler(self, optimizer: Optimizer, total_steps: int) -> LambdaLR:
        """A partial, not a lambda, so that its state is saved in checkpoints."""
        return LambdaLR(optimizer, functools.partial(self.factor, total_steps=total_steps))


def build_schedule(optim: Mapping[str, Any]) -> Schedule:
    return Schedule(optim.get("schedule", "none"), float(optim.get("warmup", 0.0)))

"""The learning rate used for a global batch: `optim.lr_scaling=none|linear` with `optim.base_batch_size`.

With more processes the global batch grows and SGD takes fewer, larger-batch steps per epoch.
The linear rule (Goyal et al., 2017) keeps the update per sample about the same by scaling
the learning rate with the batch: lr_used = lr * global_batch / base_batch_size.
"""

from collections.abc import Mapping
from typing import Any

from src.errors import UsageError

LR_SCALINGS = ("none", "linear")


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


def optimizer_args(optim: Mapping[str, Any], global_batch: int) -> dict[str, Any]:
    """The `optim` config as keyword arguments of Classifier: scaling keys consumed, `lr` the one used."""
    args = dict(optim)
    lr_scaling = args.pop("lr_scaling", "none")
    base_batch_size = args.pop("base_batch_size", 256)
    args["lr"] = scaled_lr(args["lr"], global_batch, lr_scaling, base_batch_size)
    return args

"""How far two trainings ended apart, in units of one SGD step, so one tolerance fits every model."""

from pathlib import Path
from typing import Any

import torch

BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
METRIC_STATES = ("val_acc_best.",)  # the Classifier's metric kept in checkpoints


def checkpoint(run_dir: Path) -> dict[str, Any]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def parameters(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The network's trained weights: not BatchNorm's buffers, nor the metric states saved beside them."""
    return {k: v for k, v in state_dict.items() if not k.startswith(METRIC_STATES) and not k.endswith(BATCHNORM_BUFFERS)}


def running_stats(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state_dict.items() if k.endswith(("running_mean", "running_var"))}


def last_step_norm(optimizer_state: dict[str, Any]) -> float:
    """Length of the last SGD update, lr x |momentum buffer| (weight decay included): the unit of `deviation`."""
    lr = optimizer_state["param_groups"][0]["lr"]
    buffers = [s["momentum_buffer"].flatten() for s in optimizer_state["state"].values()]
    return lr * torch.cat(buffers).norm().item()


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return torch.cat([(a[k].double() - b[k].double()).flatten() for k in a]).norm().item()


def deviation(run: dict[str, Any], reference: dict[str, Any]) -> float:
    """|theta_run - theta_reference| over all parameters, in lengths of the reference's last SGD step."""
    return distance(parameters(run["state_dict"]), parameters(reference["state_dict"])) / last_step_norm(
        reference["optimizer_states"][0]
    )

"""What a checkpoint needs beyond Lightning's own state to resume a run exactly."""

import logging
import random
from typing import Any

import numpy as np
import torch
from lightning import Callback, LightningModule, Trainer

from src.launch.console import processes

log = logging.getLogger(__name__)


class RunState(Callback):
    """Saves the random number generators and the number of processes with every checkpoint.

    Lightning restores weights, optimizer, loops and (through the data module's resumable
    loader) the position in the epoch, but not the generators: restoring them makes anything
    random after a resume (dropout, augmentation) draw what the unbroken run drew. Every process
    is seeded alike, so rank 0's generators stand for all of them.
    """

    def state_dict(self) -> dict[str, Any]:
        kind, keys, position, has_gauss, gauss = np.random.get_state()
        state: dict[str, Any] = {  # tensors and plain values only, so that `torch.load(weights_only=True)` reads it
            "torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss],
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["world_size"] = trainer.world_size

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("world_size")
        if saved is not None and saved != trainer.world_size and trainer.is_global_zero:
            log.info(
                f"resuming a checkpoint of {processes(saved)} on {trainer.world_size}: the global batches are the "
                f"same (data.batch_size is split over the processes); BatchNorm statistics are per process"
            )

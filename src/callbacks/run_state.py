"""What a checkpoint needs beyond Lightning's own state to resume a run exactly."""

import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning import Callback, LightningModule, Trainer

from src.launch.console import processes

log = logging.getLogger(__name__)


def all_ranks(value: Any) -> list[Any]:
    """`value` of every process, in rank order: a collective, which every process calls."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def generators() -> dict[str, Any]:
    """As tensors and plain values, so that `torch.load(weights_only=True)` reads them."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class RunState(Callback):
    """A random stream per process (Lightning seeds all alike: rank r > 0 reseeds with seed + r); every process's
    generators, which Lightning does not restore, and the world size in each checkpoint, for an exact resume."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.global_rank:  # after Lightning's own seeding of the stage, before a checkpoint is restored
            seed = torch.initial_seed() + trainer.global_rank
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": all_ranks(generators())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks", [state])  # a checkpoint from before streams per rank holds one
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank >= len(ranks):  # resumed on more processes: this one keeps its own new stream
            return
        state = ranks[rank]
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

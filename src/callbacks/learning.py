"""Whether a short run's training loss fell: what `debug=quick`'s few steps can tell."""

from typing import Any

import torch
from lightning import LightningModule, Trainer

from src.callbacks import RunFigures


class LossFalls(RunFigures):
    """Keeps the first and last optimizer steps' loss on the device, so no step waits for it."""

    def __init__(self) -> None:
        self.first: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.steps = 0  # optimizer steps: a batch may hold several (fast steps) or a part of one (accumulation)
        self._counted, self._start = 0, 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._counted, self._start = self.steps, trainer.global_step  # a resumed run's, restored by now

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        losses = loss.detach().reshape(-1)  # several optimizer steps a batch: their losses, in order
        if self.first is None:
            self.first = losses[0]
        self.last = losses[-1]
        self.steps = self._counted + trainer.global_step - self._start

    def state_dict(self) -> dict[str, Any]:
        """A resumed run's verdict spans all its steps."""
        return {"first": None if self.first is None else self.first.cpu(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.not_taken_up:
            return
        self.first, self.steps = state["first"], state["steps"]

    def verdict(self) -> str:
        """`train/loss fell from 2.30 to 2.05 in 4 steps`, or that it did not and what that leaves open."""
        if self.first is None or self.last is None:
            return "no training step to tell whether this setting learns"
        first, last = float(self.first), float(self.last)
        if last < first * 0.99:
            return f"train/loss fell from {first:.4f} to {last:.4f} in {self.steps} steps"
        moved = "rose" if last > first * 1.01 else "did not fall"
        return (f"train/loss {moved} in its {self.steps} steps ({first:.4f} to {last:.4f}): these are too few to tell "
                "whether this setting learns; give it more with trainer.limit_train_batches or max_epochs")

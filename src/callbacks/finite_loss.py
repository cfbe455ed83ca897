"""Stop a run whose training loss became nan or inf, before it writes a checkpoint or a result."""

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from src.errors import TrainingDiverged


ACROSS_PROCESSES_EVERY_N_STEPS = 50  # a read there is a collective, where every rank waits for the slowest


class FiniteLossCheck(Callback):
    """Names the first step whose `train/loss` was not finite, recorded on the device and read every `every_n_steps`
    (default: each step on one CPU; in one CUDA process a pinned copy once it has landed, never waiting; across
    processes every `ACROSS_PROCESSES_EVERY_N_STEPS`), and before validation, epoch ends and checkpoints."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self._interval = 1
        self._step = 0
        self._first: torch.Tensor | None = None  # [step, epoch, loss] of the first bad step; step -1: none yet
        self._landing: tuple[torch.Tensor, torch.cuda.Event] | None = None  # a pinned copy of the record, and its event

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = pl_module.device
        cheap = device.type == "cpu" and trainer.world_size == 1
        lagged = device.type == "cuda" and trainer.world_size == 1
        self._interval = self.every_n_steps or (1 if cheap else 0 if lagged else ACROSS_PROCESSES_EVERY_N_STEPS)
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self._first = torch.tensor([-1.0, -1.0, 0.0], dtype=dtype, device=device)
        self._landing = (torch.full((3,), -1.0, dtype=dtype, pin_memory=True), torch.cuda.Event()) if lagged else None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self._first is None or not isinstance(loss, torch.Tensor):
            return
        # One loss per optimizer step of the batch; updated in place with Python scalars: no host-device copy.
        first, losses = self._first, loss.detach().flatten()
        bad = ~torch.isfinite(losses)
        where = bad.to(torch.int8).argmax()  # the batch's first bad step, 0 if none
        new = (first[0] < 0) & bad.any()
        first[2] = torch.where(new, losses.gather(0, where.unsqueeze(0))[0].to(first.dtype), first[2])
        first[1].masked_fill_(new, trainer.current_epoch)
        first[0] = torch.where(new, where.to(first.dtype) + self._step, first[0])
        if self._landing is not None and self._landing[1].query():  # the last pinned copy has landed: read, send the next
            host, landed = self._landing
            self.raise_if_bad(trainer, [host.tolist()])
            host.copy_(first, non_blocking=True)
            landed.record()
        if self._interval and (batch_idx + 1) % self._interval == 0:
            self.check(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.check(trainer)  # every process builds each checkpoint: the all-gather meets in all of them

    def check(self, trainer: Trainer) -> None:
        if self._first is None:
            return
        records = [self._first]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # Not the strategy's all_gather: it calls torch.distributed.nn.functional's, which warns it is deprecated.
            records = [torch.empty_like(self._first) for _ in range(trainer.world_size)]
            dist.all_gather(records, self._first)
        self.raise_if_bad(trainer, torch.stack(records).tolist())

    def raise_if_bad(self, trainer: Trainer, records: list[list[float]]) -> None:
        bad = [row for row in records if row[0] >= 0]
        if not bad:
            return
        step, epoch, loss = min(bad)  # Lightning's epoch, from 0; the message counts from 1, as train.log does
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
        raise TrainingDiverged(
            f"train/loss is {loss} at step {int(step)} (epoch {int(epoch) + 1}) with learning rate {lr:g}; "
            "lower optim.lr, or clip gradients with trainer.gradient_clip_val"
        )

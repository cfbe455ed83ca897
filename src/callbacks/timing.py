"""Wall time of each training epoch, validation excluded."""

import logging
import statistics
import time

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from src.callbacks import RunFigures, last_trained, log_scalars

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    """So that wall time covers the kernels, not only their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EpochTimer(RunFigures):
    """Logs `time/epoch_s` and `time/samples_per_s` each epoch, and their medians (`_median`) at the end. Left out:
    validation and the checkpoint after it (inside Lightning's epoch), and a module's one-off `warmup_s`."""

    def __init__(self) -> None:
        self.epoch_times: list[float] = []
        self.samples_per_s: list[float] = []
        self._start = 0.0
        self._paused_at: float | None = None
        self._paused = 0.0
        self._samples = 0
        self._warmup_at_start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A run resumed mid-epoch gets no `on_train_epoch_start`: its epoch is timed from here."""
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _sync(pl_module.device)
        self._start, self._paused, self._paused_at, self._samples = time.perf_counter(), 0.0, None, 0
        self._warmup_at_start = getattr(pl_module, "warmup_s", 0.0)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._resume()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._samples += len(batch[1]) * trainer.world_size

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            _sync(pl_module.device)
            self._paused_at = time.perf_counter()

    def _resume(self) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _sync(pl_module.device)
        self._resume()
        warmup = getattr(pl_module, "warmup_s", 0.0) - self._warmup_at_start
        seconds = time.perf_counter() - self._start - self._paused - warmup
        self.epoch_times.append(seconds)
        samples_per_s = self._samples / seconds if seconds > 0 else 0.0
        self.samples_per_s.append(samples_per_s)
        log_scalars(trainer, {"time/epoch_s": seconds, "time/samples_per_s": samples_per_s})
        # Every process reads the metrics: reading them reduces the epoch's train/loss across processes.
        shown = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train/loss", "train/acc", "val/acc")}
        if trainer.is_global_zero:  # the line to grep in train.log, written as each epoch ends
            metrics = " ".join(f"{k}={v:.4f}" for k, v in shown.items())
            log.info(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} step {trainer.global_step}: {metrics} "
                     f"{seconds:.2f} s {samples_per_s:.0f} samples/s")

    def state_dict(self) -> dict[str, list[float]]:
        """A resumed run's medians cover all its epochs."""
        return {"epoch_times": list(self.epoch_times), "samples_per_s": list(self.samples_per_s)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        if self.foreign_checkpoint:
            return
        self.epoch_times, self.samples_per_s = list(state["epoch_times"]), list(state["samples_per_s"])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.epoch_times:
            epoch, step = last_trained(trainer)
            log_scalars(trainer, {"time/epoch_s_median": statistics.median(self.epoch_times),
                                  "time/samples_per_s_median": statistics.median(self.samples_per_s)}, step, epoch)

"""Wall time of each training epoch, validation excluded, and the training time a run took to reach each target accuracy."""

import logging
import statistics
import time
from collections.abc import Sequence

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from src.callbacks import RunFigures, last_trained, log_scalars
from src.records import TO_TARGET, target_name

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

    def _epoch_so_far(self, pl_module: LightningModule) -> float:
        """Training seconds of this epoch up to now, or to the validation that paused it."""
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return now - self._start - self._paused - (getattr(pl_module, "warmup_s", 0.0) - self._warmup_at_start)

    def trained_s(self, pl_module: LightningModule) -> float:
        """Training seconds of the run so far, validation excluded: the clock of `TimeToAccuracy`."""
        return sum(self.epoch_times) + max(0.0, self._epoch_so_far(pl_module))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _sync(pl_module.device)
        self._resume()
        seconds = self._epoch_so_far(pl_module)
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
        if self.not_taken_up:
            return
        self.epoch_times, self.samples_per_s = list(state["epoch_times"]), list(state["samples_per_s"])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.epoch_times:
            epoch, step = last_trained(trainer)
            log_scalars(trainer, {"time/epoch_s_median": statistics.median(self.epoch_times),
                                  "time/samples_per_s_median": statistics.median(self.samples_per_s)}, step, epoch)


class TimeToAccuracy(RunFigures):
    """Training seconds (EpochTimer's clock: validation excluded) and optimizer steps until `val/acc` first reached each
    target: what settles whether a cheaper step (compression, lower precision) pays for the steps it may add. Its
    resolution is the validation interval (`trainer.val_check_interval`). Logs `time/trained_s` at every validation,
    the x axis of the report's accuracy-against-time plot, and `time/to_val_acc_<target>` once, where reached."""

    def __init__(self, targets: Sequence[float] = (0.80, 0.85, 0.90)) -> None:
        self.targets = sorted({float(target) for target in targets})
        self.reached: dict[str, tuple[float, int]] = {}  # target name: (seconds, optimizer step)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timer = next((c for c in trainer.callbacks if isinstance(c, EpochTimer)), None)
        accuracy = trainer.callback_metrics.get("val/acc")
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or timer is None or accuracy is None:
            return
        seconds, accuracy = timer.trained_s(pl_module), float(accuracy)
        now = {"time/trained_s": seconds}
        for target in self.targets:
            if accuracy >= target and target_name(target) not in self.reached:
                self.reached[target_name(target)] = (seconds, trainer.global_step)
                now[TO_TARGET + target_name(target)] = seconds
        log_scalars(trainer, now)

    def summary(self) -> list[dict[str, float | int | None]]:
        """For `result.json`: each target, with its seconds and step, or None where the run never reached it."""
        reached = [(target, *self.reached.get(target_name(target), (None, None))) for target in self.targets]
        return [{"target": target, "seconds": seconds, "step": step} for target, seconds, step in reached]

    def verdict(self) -> str:
        """The result line's part: the highest target reached."""
        if not self.targets:
            return ""
        reached = [target for target in self.targets if target_name(target) in self.reached]
        if not reached:
            return f"val/acc reached none of {', '.join(map(target_name, self.targets))}"
        seconds, step = self.reached[target_name(reached[-1])]
        return f"val/acc {target_name(reached[-1])} after {seconds:.1f} s of training, step {step}"

    def state_dict(self) -> dict[str, dict[str, list[float]]]:
        return {"reached": {name: [seconds, step] for name, (seconds, step) in self.reached.items()}}

    def load_state_dict(self, state: dict[str, dict[str, list[float]]]) -> None:
        if not self.not_taken_up:
            self.reached = {str(name): (float(seconds), int(step)) for name, (seconds, step) in state["reached"].items()}

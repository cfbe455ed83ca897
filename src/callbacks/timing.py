"""Wall time of each training epoch, validation excluded, and the training time a run took to reach each target accuracy."""

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from src.callbacks import RunFigures, last_trained, log_scalars
from src.records import HPARAMS_TO_TARGET, NOT_REACHED, TO_TARGET, target_name

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    """So that wall time covers the kernels, not only their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EpochTimer(RunFigures):
    """Logs `time/epoch_s` and `time/samples_per_s` each epoch, and their medians (`_median`) at the end. Left out:
    validation and the checkpoint after it (inside Lightning's epoch), and a module's one-off `warmup_s`, which it
    counts apart (`warmup_s()`). A checkpoint saved mid-epoch (`step.ckpt`) keeps the epoch's seconds so far, so that a
    run resumed from it times the whole epoch, not its rest."""

    def __init__(self) -> None:
        self.epoch_times: list[float] = []
        self.samples_per_s: list[float] = []
        self._start = 0.0
        self._paused_at: float | None = None
        self._paused = 0.0
        self._samples = 0
        self._warmup_at_start = 0.0
        self._module: LightningModule | None = None  # what `state_dict` reads the warm-up and the epoch so far of
        self._in_epoch = False  # between an epoch's start and its last batch: a checkpoint now is mid-epoch
        self._carried, self._carried_samples = 0.0, 0  # the epoch's seconds and samples before a mid-epoch resume
        self._warmup_before = 0.0  # the warm-up of the run's earlier processes: a resumed one compiles again

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A run resumed mid-epoch gets no `on_train_epoch_start`: its epoch is timed from here, on from the seconds
        its checkpoint kept."""
        self._module = pl_module
        self._begin(pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._carried, self._carried_samples = 0.0, 0
        self._begin(pl_module)

    def _begin(self, pl_module: LightningModule) -> None:
        _sync(pl_module.device)
        self._start, self._paused, self._paused_at = time.perf_counter(), 0.0, None
        self._samples, self._in_epoch = self._carried_samples, True
        self._warmup_at_start = getattr(pl_module, "warmup_s", 0.0)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._resume()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._samples += len(batch[1]) * trainer.world_size
        self._in_epoch = not trainer.is_last_batch

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
        warmup = getattr(pl_module, "warmup_s", 0.0) - self._warmup_at_start
        return self._carried + now - self._start - self._paused - warmup

    def trained_s(self, pl_module: LightningModule) -> float:
        """Training seconds of the run so far, validation and warm-up excluded."""
        return sum(self.epoch_times) + max(0.0, self._epoch_so_far(pl_module))

    def warmup_s(self, pl_module: LightningModule | None) -> float:
        """The run's warm-up so far (compiling, capturing CUDA graphs), all its processes: a cost of getting anywhere,
        which `TimeToAccuracy` counts."""
        return self._warmup_before + (getattr(pl_module, "warmup_s", 0.0) if pl_module is not None else 0.0)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _sync(pl_module.device)
        self._resume()
        seconds, self._in_epoch = self._epoch_so_far(pl_module), False
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

    def state_dict(self) -> dict[str, Any]:
        """A resumed run's medians cover all its epochs, its epoch resumed mid-way all that epoch's seconds, and its
        time to accuracy the warm-up of every process."""
        mid_epoch = self._in_epoch and self._module is not None
        return {"epoch_times": list(self.epoch_times), "samples_per_s": list(self.samples_per_s),
                "epoch_so_far_s": max(0.0, self._epoch_so_far(self._module)) if mid_epoch else 0.0,
                "epoch_samples": self._samples if mid_epoch else 0, "warmup_s": self.warmup_s(self._module)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.not_taken_up:
            return
        self.epoch_times, self.samples_per_s = list(state["epoch_times"]), list(state["samples_per_s"])
        # Checkpoints written before these were kept hold none of them.
        self._carried, self._carried_samples = float(state.get("epoch_so_far_s", 0.0)), int(state.get("epoch_samples", 0))
        self._warmup_before = float(state.get("warmup_s", 0.0))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.epoch_times:
            epoch, step = last_trained(trainer)
            log_scalars(trainer, {"time/epoch_s_median": statistics.median(self.epoch_times),
                                  "time/samples_per_s_median": statistics.median(self.samples_per_s)}, step, epoch)


class TimeToAccuracy(RunFigures):
    """Training seconds (EpochTimer's clock: validation excluded, warm-up included: compiling is a cost of getting
    there) and optimizer steps until `val/acc` first reached each target: what settles whether a cheaper step
    (compression, lower precision, `compile=true`) pays for what it adds. Its resolution is the validation interval
    (`trainer.val_check_interval`). Logs `time/trained_s` at every validation, the x axis of the report's
    accuracy-against-time plot, and `time/to_val_acc_<target>` once, where reached."""

    def __init__(self, targets: Sequence[float] = (0.80, 0.85, 0.90)) -> None:
        self.targets = sorted({float(target) for target in targets})
        self.reached: dict[str, tuple[float, int, float]] = {}  # target name: (seconds, optimizer step, warm-up in them)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timer = next((c for c in trainer.callbacks if isinstance(c, EpochTimer)), None)
        accuracy = trainer.callback_metrics.get("val/acc")
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or timer is None or accuracy is None:
            return
        warmup, accuracy = timer.warmup_s(pl_module), float(accuracy)
        seconds = timer.trained_s(pl_module) + warmup
        now = {"time/trained_s": seconds}
        for target in self.targets:
            if accuracy >= target and target_name(target) not in self.reached:
                self.reached[target_name(target)] = (seconds, trainer.global_step, warmup)
                now[TO_TARGET + target_name(target)] = seconds
        log_scalars(trainer, now)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Each target's seconds once more, `NOT_REACHED` where the run did not reach it, as `HPARAMS_TO_TARGET`: the
        column HParams shows for every run, which its parallel coordinates need to draw it."""
        if self.targets:
            epoch, step = last_trained(trainer)
            log_scalars(trainer, {HPARAMS_TO_TARGET + target_name(target): self.reached.get(
                target_name(target), (NOT_REACHED,))[0] for target in self.targets}, step, epoch)

    def summary(self) -> list[dict[str, float | int | None]]:
        """For `result.json`: each target, with its seconds, step and the warm-up seconds in them, or None where the
        run did not reach it."""
        reached = [(target, *self.reached.get(target_name(target), (None, None, None))) for target in self.targets]
        return [{"target": target, "seconds": seconds, "step": step, "warmup_s": warmup}
                for target, seconds, step, warmup in reached]

    def verdict(self) -> str:
        """The result line's part: the highest target reached."""
        if not self.targets:
            return ""
        reached = [target for target in self.targets if target_name(target) in self.reached]
        if not reached:
            return f"val/acc reached none of {', '.join(map(target_name, self.targets))}"
        seconds, step, warmup = self.reached[target_name(reached[-1])]
        included = f" (warm-up {warmup:.1f} s of it)" if warmup else ""
        return f"val/acc {target_name(reached[-1])} after {seconds:.1f} s of training{included}, step {step}"

    def state_dict(self) -> dict[str, dict[str, list[float]]]:
        return {"reached": {name: list(reached) for name, reached in self.reached.items()}}

    def load_state_dict(self, state: dict[str, dict[str, list[float]]]) -> None:
        if not self.not_taken_up:  # a checkpoint written before the warm-up was kept holds [seconds, step]
            self.reached = {str(name): (float(kept[0]), int(kept[1]), float(kept[2]) if len(kept) > 2 else 0.0)
                            for name, kept in state["reached"].items()}

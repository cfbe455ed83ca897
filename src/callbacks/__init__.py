"""Callbacks that measure runs: epoch time and throughput, communication."""

from typing import Any

from lightning import Callback, LightningModule, Trainer

from src.checkpoints import is_own


def log_scalars(trainer: Trainer, values: dict[str, float], step: int | None = None) -> None:
    """On rank 0, straight to every logger (`LightningModule.log` costs about a millisecond a call on a small CPU), by
    default at the step Lightning gives the epoch's other scalars: that of its last batch."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step - 1 if step is None else step)


class RunFigures(Callback):
    """Keeps its figures in checkpoints for a resumed run's medians; a new run that starts from another folder's
    checkpoint begins its own (Lightning calls `on_load_checkpoint` before `load_state_dict`)."""

    foreign_checkpoint = False

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.foreign_checkpoint = trainer.ckpt_path is not None and not is_own(trainer.ckpt_path, trainer.default_root_dir)

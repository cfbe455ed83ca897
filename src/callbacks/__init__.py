"""Callbacks that measure runs: epoch time and throughput, communication."""

from lightning import Trainer


def log_scalars(trainer: Trainer, values: dict[str, float], step: int | None = None) -> None:
    """On rank 0, straight to every logger (`LightningModule.log` costs about a millisecond a call on a small CPU), by
    default at the step Lightning gives the epoch's other scalars: that of its last batch."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step - 1 if step is None else step)

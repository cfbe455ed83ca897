"""Callbacks that measure runs: epoch time and throughput, communication."""

from typing import Any

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from src.checkpoints import is_own


def log_scalars(trainer: Trainer, values: dict[str, float], step: int | None = None) -> None:
    """On rank 0, straight to every logger (`LightningModule.log` costs about a millisecond a call on a small CPU), by
    default at the step Lightning gives the epoch's other scalars: that of its last batch."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step - 1 if step is None else step)


class RunFigures(Callback):
    """Keeps its figures in checkpoints for a resumed run's medians. Only a fit takes them up: a new run that starts
    from another folder's checkpoint begins its own, and testing the best checkpoint after a fit keeps the figures of
    the whole fit, not those of the epoch it was saved at (Lightning restores callbacks for a test too, and calls
    `on_load_checkpoint` before `load_state_dict`)."""

    not_taken_up = False

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.not_taken_up = trainer.state.fn != TrainerFn.FITTING or (
            trainer.ckpt_path is not None and not is_own(trainer.ckpt_path, trainer.default_root_dir))

"""The progress bar of a run that shows one."""

from typing import Any

from lightning import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar


class EpochBar(TQDMProgressBar):
    """Lightning's bar, its epochs counted from 1 of max_epochs as train.log and the stop line count them
    (Lightning's own counts from 0)."""

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch + 1}/{trainer.max_epochs}")

"""The progress bar of a run that shows one: a run whose output goes to a terminal, or that asks for it."""

import sys
from typing import Any

from lightning import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


class EpochBar(TQDMProgressBar):
    """Epochs counted from 1 of max_epochs, as train.log counts them (Lightning's bar counts from 0)."""

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        # Lightning's steps, the description set before the reset draws the bar (else under the last epoch's name).
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.set_description(f"Epoch {trainer.current_epoch + 1}/{trainer.max_epochs}", refresh=False)
        bar.reset(convert_inf(self.total_train_batches))
        bar.initial = 0


def progress_bar(enable: bool | None) -> EpochBar | None:
    """`trainer.enable_progress_bar=null`: only where the output is a terminal; a file would fill with escapes."""
    return EpochBar() if enable or enable is None and sys.stdout.isatty() else None

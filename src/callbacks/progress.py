"""The progress bar of a run that shows one: a run whose output goes to a terminal, or that asks for it."""

import sys
from typing import Any

from lightning import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


class EpochBar(TQDMProgressBar):
    """Lightning's bar, its epochs counted from 1 of max_epochs as train.log and the stop line count them
    (Lightning's own counts from 0)."""

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        # Lightning's steps, with the description set before the reset draws the bar: else each epoch's
        # bar is first drawn under the last epoch's name (and the first under Lightning's "Epoch 0").
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.set_description(f"Epoch {trainer.current_epoch + 1}/{trainer.max_epochs}", refresh=False)
        bar.reset(convert_inf(self.total_train_batches))
        bar.initial = 0


def progress_bar(enable: bool | None) -> EpochBar | None:
    """The bar for `trainer.enable_progress_bar` (null: where the output is a terminal). Elsewhere (a file, a pipe) a bar
    would fill it with carriage returns and escapes: the epoch lines of `train.log` say the same, one line an epoch."""
    return EpochBar() if enable or enable is None and sys.stdout.isatty() else None

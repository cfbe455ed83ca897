"""The progress bar of a run that shows one: a run whose output goes to a terminal, or that asks for it."""

import sys
from typing import Any

from lightning import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

from src.launch.console import register


class EpochBar(TQDMProgressBar):
    """Epochs counted from 1 of max_epochs, as train.log counts them (Lightning's bar counts from 0)."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate, process_position, leave)
        self.leave = leave  # kept here too: Lightning keeps it private

    # Each bar Lightning opens, registered: the console prints its lines above the bars on screen and closes them
    # before an error line (src/launch/console.py).
    def init_sanity_tqdm(self) -> Tqdm:
        return register(super().init_sanity_tqdm())

    def init_train_tqdm(self) -> Tqdm:
        return register(super().init_train_tqdm())

    def init_validation_tqdm(self) -> Tqdm:
        return register(super().init_validation_tqdm())

    def init_test_tqdm(self) -> Tqdm:
        return register(super().init_test_tqdm())

    def init_predict_tqdm(self) -> Tqdm:
        return register(super().init_predict_tqdm())

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        # Lightning's steps, the description set before the reset draws the bar (else under the last epoch's name).
        if self.leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.set_description(f"Epoch {trainer.current_epoch + 1}/{trainer.max_epochs}", refresh=False)
        bar.reset(convert_inf(self.total_train_batches))
        bar.initial = 0


def progress_bar(enable: bool | None) -> EpochBar | None:
    """`trainer.enable_progress_bar=null`: only where the output is a terminal; a file would fill with escapes."""
    return EpochBar() if enable or enable is None and sys.stdout.isatty() else None

"""The epoch time counts training only: validation and the checkpoint written after it are left out."""

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from src.callbacks import timing
from src.callbacks.timing import EpochTimer

TRAIN_S, VALIDATE_S, SAVE_S = 1.0, 10.0, 100.0


class Clock:
    """A clock that moves only when the run says so: each kind of work advances it by a known amount."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedModel(BoringModel):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def train_dataloader(self):  # (images, labels) pairs, as the timer counts samples by the labels
        return DataLoader(TensorDataset(torch.randn(16, 32), torch.zeros(16)), batch_size=2)

    def training_step(self, batch, batch_idx):
        self.clock.now += TRAIN_S
        return super().training_step(batch[0], batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock.now += VALIDATE_S
        self.log("val/acc", -float(self.clock.now))
        return super().validation_step(batch, batch_idx)


class SlowCheckpoint(ModelCheckpoint):
    """Saves after validation, as the best-epoch checkpoint does, taking SAVE_S of the clock."""

    def __init__(self, clock: Clock, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock = clock

    def _save_checkpoint(self, trainer, filepath):
        self.clock.now += SAVE_S
        super()._save_checkpoint(trainer, filepath)


@pytest.mark.parametrize("val_check_interval", [1.0, 2])
def test_validation_and_the_checkpoint_after_it_are_not_epoch_time(tmp_path, monkeypatch, val_check_interval):
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    timer = EpochTimer()
    saver = SlowCheckpoint(clock, dirpath=tmp_path, monitor="val/acc", mode="max", save_top_k=-1)
    trainer = Trainer(max_epochs=2, limit_train_batches=4, limit_val_batches=1, val_check_interval=val_check_interval,
                      num_sanity_val_steps=0, callbacks=[timer, saver], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(TimedModel(clock))
    validations = 2 * (4 // val_check_interval if isinstance(val_check_interval, int) else 1)
    assert clock.now == pytest.approx(2 * 4 * TRAIN_S + validations * (VALIDATE_S + SAVE_S))  # the clock saw all three
    assert timer.epoch_times == pytest.approx([4 * TRAIN_S, 4 * TRAIN_S])


def test_testing_the_best_checkpoint_keeps_the_figures_of_the_whole_fit(tmp_path, monkeypatch):
    """Lightning restores callbacks from the file a test scores: the best epoch's checkpoint knows fewer epochs."""
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    timer = EpochTimer()
    best = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max")  # val/acc falls: the first epoch is best
    trainer = Trainer(max_epochs=3, limit_train_batches=4, limit_val_batches=1, limit_test_batches=1,
                      num_sanity_val_steps=0, callbacks=[timer, best], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=tmp_path)
    model = TimedModel(clock)
    trainer.fit(model)
    assert best.best_model_path.endswith("epoch=0-step=4.ckpt")
    trainer.test(model, dataloaders=model.val_dataloader(), ckpt_path=best.best_model_path, weights_only=True)
    assert timer.epoch_times == pytest.approx([4 * TRAIN_S] * 3)

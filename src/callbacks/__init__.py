"""Callbacks that measure runs: epoch time and throughput, communication."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from src.checkpoints import is_own


def log_scalars(trainer: Trainer, values: dict[str, float], step: int | None = None, epoch: int | None = None) -> None:
    """On rank 0, straight to every logger (`LightningModule.log` costs about a millisecond a call on a small CPU), by
    default at the step and epoch Lightning gives the epoch's other scalars: its last batch's, and the epoch as
    Lightning adds it to each of its own rows (a CSV row without it belonged to no epoch)."""
    if trainer.is_global_zero:
        epoch = trainer.current_epoch if epoch is None else epoch
        for logger in trainer.loggers:
            logger.log_metrics({**values, "epoch": epoch}, step=trainer.global_step - 1 if step is None else step)


def last_trained(trainer: Trainer) -> tuple[int, int]:
    """The epoch and step (from 0) of the last training step, once training has ended: Lightning's counters are
    then one epoch and one step on."""
    return max(trainer.current_epoch - 1, 0), max(trainer.global_step - 1, 0)


def logged_step(trainer: Trainer) -> int:
    """The step Lightning logs a point at (not `global_step` where a batch takes several optimizer steps)."""
    # Private: the step Lightning logs at; no public API sets it (Lightning moves it back itself at an epoch's end)
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def log_at_step(trainer: Trainer, step: int) -> None:
    """Lightning logs the points that follow at `step`: the one place its private counter is set."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step  # private, as in `logged_step`


@contextmanager
def logged_at_last_step(trainer: Trainer) -> Iterator[None]:
    """The test's points at the last training epoch and step, where the run's medians are; Lightning would log them
    one epoch and one step on, at its counters after training. It moves its own step back so for an epoch's end
    (`_FitLoop.on_advance_end`); no public setting does either. A trainer that trained nothing is left as it is."""
    loop = trainer.fit_loop
    if trainer.global_step == 0:
        yield
        return
    saved = logged_step(trainer), loop.epoch_progress.current.completed
    epoch, step = last_trained(trainer)
    log_at_step(trainer, step)
    loop.epoch_progress.current.completed = epoch
    try:
        yield
    finally:
        log_at_step(trainer, saved[0])
        loop.epoch_progress.current.completed = saved[1]


class RunFigures(Callback):
    """Keeps its figures in checkpoints for a resumed run's medians. Only a fit takes them up: a new run that starts
    from another folder's checkpoint begins its own, and testing the best checkpoint after a fit keeps the figures of
    the whole fit, not those of the epoch it was saved at (Lightning restores callbacks for a test too, and calls
    `on_load_checkpoint` before `load_state_dict`)."""

    not_taken_up = False

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.not_taken_up = trainer.state.fn != TrainerFn.FITTING or (
            trainer.ckpt_path is not None and not is_own(trainer.ckpt_path, trainer.default_root_dir))

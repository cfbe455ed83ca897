"""The TensorBoard logger of every run, and where a resumed run's logging takes up."""

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

from src.checkpoints import Saved

EPOCH_TAG = "trainer/epoch"


class RunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, with Lightning's `epoch` counter filed as `trainer/epoch`, so
    that it joins a group of its own instead of standing first among the run's scalars."""

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        super().log_metrics({EPOCH_TAG if name == "epoch" else name: value for name, value in metrics.items()}, step)


def purge_step(resumed: Saved | None, run_dir: Path) -> int | None:
    """Resuming in its own folder, a run hides the TensorBoard points its earlier part logged after
    the checkpoint (TensorBoard's purge step), so no step appears twice. Lightning logs optimizer
    step n at TensorBoard step n - 1, so the first point after a checkpoint at step s is at s."""
    if resumed is None or resumed.path.parent.parent.resolve() != run_dir.resolve():
        return None
    return resumed.step if resumed.step >= 0 else None

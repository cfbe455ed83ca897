"""The TensorBoard logger of every run."""

from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

EPOCH_TAG = "trainer/epoch"


class RunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, with Lightning's `epoch` counter filed as `trainer/epoch`, so
    that it joins a group of its own instead of standing first among the run's scalars."""

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        super().log_metrics({EPOCH_TAG if name == "epoch" else name: value for name, value in metrics.items()}, step)

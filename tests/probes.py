"""Callbacks that show, from inside a run's processes, what they see (`+callbacks.probe._target_=tests.probes.ShowVariable`)."""

import os

from lightning import Callback, LightningModule, Trainer


class ShowVariable(Callback):
    """Writes `<name>=<value> rank <r>` to standard output from every process as training starts."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # One write: the processes share one output, and a print may write its line and its end apart.
        os.write(1, f"{self.name}={os.environ.get(self.name)} rank {trainer.global_rank}\n".encode())

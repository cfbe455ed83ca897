"""The machine a run ran on, kept beside its results, and a warning when the run's settings fit it badly."""

import logging

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator

from src import sysinfo

log = logging.getLogger(__name__)


class SystemInfoLogger(Callback):
    """On rank 0: `python -m src.sysinfo`'s report as TensorBoard text `system`, and a line per precision warning."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._info = sysinfo.collect()
        accelerator = "gpu" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu"
        processes_per_node = trainer.world_size // trainer.num_nodes
        for warning in sysinfo.precision_warnings(self._info, str(trainer.precision), accelerator, processes_per_node):
            log.warning(warning)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Once a resumed run has its step back, so that the text's step never goes back."""
        if not trainer.is_global_zero:
            return
        report = "```\n" + sysinfo.format_report(self._info) + "\n```"
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("system", report, global_step=trainer.global_step)

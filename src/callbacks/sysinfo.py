"""The machine a run ran on, kept beside its results, and a warning when the run's settings fit it badly."""

import logging
import threading
from typing import Any

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator

from src import sysinfo

log = logging.getLogger(__name__)

TOPOLOGY_WAIT_S = 5.0  # at the end of training, for the interconnect's reader; it never holds up a step
QUICK_READ_S = 0.2  # at the start: what a machine with fewer than 2 GPUs answers at once


class SystemInfoLogger(Callback):
    """On rank 0: `python -m src.sysinfo`'s report as TensorBoard text `system`, and a line per precision warning. The
    interconnect (`nvidia-smi topo -m`, up to 20 s) is read in a thread, so that no rank waits for rank 0 to start:
    where it is not known when training starts, the text comes again once it is, at a later step."""

    def __init__(self) -> None:
        self._info: dict[str, Any] = {}
        self._links: dict[str, Any] | None = None
        self._reader: threading.Thread | None = None
        self._step = 0  # the step of the last text: a later one never goes back (TensorBoard would purge)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._info = sysinfo.collect(interconnect=False)
        accelerator = "gpu" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu"
        processes_per_node = trainer.world_size // trainer.num_nodes
        for warning in sysinfo.precision_warnings(self._info, str(trainer.precision), accelerator, processes_per_node):
            log.warning(warning)
        self._links = None
        self._reader = threading.Thread(target=self._read_links, args=(len(self._info["gpus"]),), daemon=True,
                                        name="interconnect reader")
        self._reader.start()

    def _read_links(self, count: int) -> None:
        self._links = sysinfo.interconnect_of(count)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At the step training starts from (a resumed run's), so that the text's step never goes back."""
        if self._reader is None:
            return
        self._reader.join(QUICK_READ_S)  # fewer than 2 GPUs: known at once
        self._write(trainer, trainer.global_step, final=self._links is not None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._reader is not None and self._links is not None:
            self._write(trainer, trainer.global_step - 1, final=True)  # the step this batch's figures are logged at

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._reader is not None:
            self._reader.join(TOPOLOGY_WAIT_S)
            self._write(trainer, trainer.global_step - 1, final=True)

    def _write(self, trainer: Trainer, step: int, final: bool) -> None:
        if final:
            self._reader = None
        links = self._links or {**sysinfo.UNREAD, "summary": (f"not read: nvidia-smi topo -m took over {TOPOLOGY_WAIT_S:g} s"
                                                              if final else "being read (nvidia-smi topo -m)")}
        report = "```\n" + sysinfo.format_report({**self._info, "interconnect": links}) + "\n```"
        self._step = max(step, self._step) if final else step
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("system", report, global_step=self._step)

"""Logs rank 0's gradient communication per optimizer step (`xfer/` scalars; docs/communication.md lists them).

From the strategy's CommMeter: `bytes_per_step` (the hook's all-reduce payload; absent in a run of one process),
`compression_ratio`, `hook_ms` and `buckets_per_step`. From DDP's runtime logging data, which DDP records only for
a sample of steps (reading a step's timers on CUDA waits for the GPU) and files during the next step's forward pass:
`backward_compute_ms`, `backward_comm_ms`, `overlap_ms` and `overlap_frac`. Each is also logged as its epoch mean,
`xfer/<name>_epoch`, so a run shorter than `trainer.log_every_n_steps` still shows it.
"""

from typing import Any

from lightning import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from src.strategies.comm import CommMeter


class CommLogger(Callback):
    """Logs the `xfer/` scalars after each optimizer step; does nothing when the strategy has no CommMeter."""

    def __init__(self) -> None:
        self._meter: CommMeter | None = None
        self._last_step = 0
        self._ddp: DistributedDataParallel | None = None
        self._ddp_iteration = -1
        self._epoch_values: dict[str, list[float]] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = getattr(trainer.strategy, "comm_meter", None)
        self._last_step = trainer.global_step
        if self._meter is not None:
            self._meter.take()  # drop anything sent before training (none is expected)
        self._ddp = trainer.strategy.model if isinstance(trainer.strategy.model, DistributedDataParallel) else None
        self._ddp_iteration = -1
        # Private to DDP: no public API gives its backward timings. A torch without it logs none.
        if not hasattr(self._ddp, "_get_ddp_logging_data"):
            self._ddp = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._meter is None or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        step = self._meter.take()
        if step.buckets == 0:
            return
        sent = {} if trainer.world_size == 1 else {  # one process: the all-reduces send nothing
            "xfer/bytes_per_step": float(step.bytes_sent), "xfer/compression_ratio": step.compression_ratio}
        self._record(trainer, {**sent, "xfer/hook_ms": step.hook_s * 1000, "xfer/buckets_per_step": float(step.buckets)})

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        """DDP has just filed the previous step's timings."""
        timings = self.ddp_timings()
        if timings:
            self._record(trainer, timings)

    def _record(self, trainer: Trainer, values: dict[str, float]) -> None:
        """Kept for the epoch's means; rank 0 writes them straight to the logger at Lightning's logging steps
        (`LightningModule.log` costs about a millisecond a call on a small CPU)."""
        for name, value in values.items():
            self._epoch_values.setdefault(name, []).append(value)
        if trainer.is_global_zero and trainer.global_step % trainer.log_every_n_steps == 0:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step - 1)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_values = {}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for name, values in self._epoch_values.items():
            pl_module.log(f"{name}_epoch", sum(values) / len(values), on_step=False, on_epoch=True, rank_zero_only=True)

    def ddp_timings(self) -> dict[str, float]:
        """{} unless DDP recorded a new step."""
        if self._ddp is None:
            return {}
        data = self._ddp._get_ddp_logging_data()
        keys = ("iteration", "backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
        if any(key not in data for key in keys) or data["iteration"] == self._ddp_iteration:
            return {}
        self._ddp_iteration = data["iteration"]
        compute, comm, overlap = (data[key] / 1e6 for key in keys[1:])
        return {
            "xfer/backward_compute_ms": compute,
            "xfer/backward_comm_ms": comm,
            "xfer/overlap_ms": overlap,
            "xfer/overlap_frac": overlap / comm if comm > 0 else 0.0,
        }

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = None
        self._ddp = None

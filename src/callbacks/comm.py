"""Rank 0's gradient communication per optimizer step (`xfer/`, docs/communication.md): the CommMeter's figures and
DDP's backward timings for its sample of steps; also as epoch means, `xfer/<name>_epoch`, for the shortest runs."""

from typing import Any

from lightning import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from src.callbacks import log_scalars
from src.strategies.comm import CommMeter

DDP_TIMERS = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")


class CommLogger(Callback):
    """Does nothing when the strategy has no CommMeter."""

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
            self._meter.take()  # drop anything sent before training
        # Private to DDP: no public API gives its backward timings. A torch without it logs none.
        model = trainer.strategy.model
        has_timings = isinstance(model, DistributedDataParallel) and hasattr(model, "_get_ddp_logging_data")
        self._ddp = model if has_timings else None
        self._ddp_iteration = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
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
        """DDP has just filed the previous step's timings: recorded unless DDP recorded no new step."""
        if self._ddp is None:
            return
        data = self._ddp._get_ddp_logging_data()  # private: see on_train_start
        if any(key not in data for key in ("iteration", *DDP_TIMERS)) or data["iteration"] == self._ddp_iteration:
            return
        self._ddp_iteration = data["iteration"]
        compute, comm, overlap = (data[key] / 1e6 for key in DDP_TIMERS)
        self._record(trainer, {
            "xfer/backward_compute_ms": compute,
            "xfer/backward_comm_ms": comm,
            "xfer/overlap_ms": overlap,
            "xfer/overlap_frac": overlap / comm if comm > 0 else 0.0,
        })

    def _record(self, trainer: Trainer, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._epoch_values.setdefault(name, []).append(value)
        if trainer.global_step % trainer.log_every_n_steps == 0:
            log_scalars(trainer, values)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_values = {}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for name, values in self._epoch_values.items():
            pl_module.log(f"{name}_epoch", sum(values) / len(values), on_step=False, on_epoch=True, rank_zero_only=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = None
        self._ddp = None

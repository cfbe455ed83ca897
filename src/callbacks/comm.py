"""Rank 0's gradient communication per optimizer step (`xfer/`, docs/communication.md): the CommMeter's figures and
DDP's backward timings for its sample of steps; also as epoch means, `xfer/<name>_epoch`, for the shortest runs."""

from typing import Any

from lightning import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from src.callbacks import log_scalars
from src.strategies.comm import CommMeter

DDP_TIMERS = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
DDP_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate: DDP times iterations 1-10, then every 100th


def ddp_sampled(iteration: int) -> bool:
    """Whether DDP timed the backward pass before its iteration `iteration` (1 is the first): it files an iteration's
    timings as the next one's forward begins, so reading them on other steps costs a call and finds none."""
    timed = iteration - 1
    return 1 <= timed <= 10 or timed > 0 and timed % DDP_SAMPLE_RATE == 0


class CommLogger(Callback):
    """Does nothing when the strategy has no CommMeter and is not DDP. It reads on batch ends, outside the step: a
    CUDA graph replays the step without its hooks (`src.fast_path.hooks_in_step`)."""

    def __init__(self) -> None:
        self._meter: CommMeter | None = None
        self._last_step = self._first_step = self._warm = 0
        self._ddp: DistributedDataParallel | None = None
        self._ddp_iteration = -1
        self._epoch_values: dict[str, list[float]] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = getattr(trainer.strategy, "comm_meter", None)
        self._last_step = self._first_step = trainer.global_step
        self._warm = getattr(trainer.strategy, "warm_iterations", 0)  # DDP's iterations before training
        if self._meter is not None:
            self._meter.take()  # drop anything sent before training
        # Private to DDP: no public API gives its backward timings. A torch without it logs none.
        model = trainer.strategy.model
        has_timings = isinstance(model, DistributedDataParallel) and hasattr(model, "_get_ddp_logging_data")
        self._ddp = model if has_timings else None
        self._ddp_iteration = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._last_step = trainer.global_step
        if self._ddp is not None and ddp_sampled(trainer.global_step - self._first_step + self._warm):
            self._record_ddp_timings(trainer)  # the step before: first, so that no point goes back a step
        if self._meter is not None:
            self._record_meter(trainer, self._meter)

    def _record_meter(self, trainer: Trainer, meter: CommMeter) -> None:
        step = meter.take()
        if step.buckets == 0:
            return
        sent = {} if trainer.world_size == 1 else {  # one process: the all-reduces send nothing
            "xfer/bytes_per_step": float(step.bytes_sent), "xfer/compression_ratio": step.compression_ratio}
        self._record(trainer, {**sent, "xfer/hook_ms": step.hook_s * 1000, "xfer/buckets_per_step": float(step.buckets)},
                     step=trainer.global_step - 1)

    def _record_ddp_timings(self, trainer: Trainer) -> None:
        """What DDP filed as this step's forward began: the previous step's backward timings, not those of the
        iterations DDP took before training."""
        data = self._ddp._get_ddp_logging_data()  # type: ignore[union-attr]  # private: see on_train_start
        if (any(key not in data for key in ("iteration", *DDP_TIMERS)) or data["iteration"] == self._ddp_iteration
                or data["iteration"] <= self._warm):
            return
        self._ddp_iteration = data["iteration"]
        compute, comm, overlap = (data[key] / 1e6 for key in DDP_TIMERS)
        self._record(trainer, {
            "xfer/backward_compute_ms": compute,
            "xfer/backward_comm_ms": comm,
            "xfer/overlap_ms": overlap,
            "xfer/overlap_frac": overlap / comm if comm > 0 else 0.0,
        }, step=trainer.global_step - 2)

    def _record(self, trainer: Trainer, values: dict[str, float], step: int) -> None:
        """Figures of optimizer step `step` (from 0), logged at it on the steps Lightning logs its own."""
        for name, value in values.items():
            self._epoch_values.setdefault(name, []).append(value)
        if (step + 1) % trainer.log_every_n_steps == 0:
            log_scalars(trainer, values, step=step)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_values = {}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for name, values in self._epoch_values.items():
            pl_module.log(f"{name}_epoch", sum(values) / len(values), on_step=False, on_epoch=True, rank_zero_only=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = None
        self._ddp = None

"""Gradient communication per optimizer step, as counted by the strategy's CommMeter.

Rank 0's figures, per process and per optimizer step (micro-batches that only accumulate
gradients send nothing and fold into the next step):

- `xfer/bytes_per_step`: bytes of every all-reduce the hook issued (its payload, not the wire
  traffic of the all-reduce algorithm); not logged by a run of one process, which sends nothing.
- `xfer/compression_ratio`: the same buckets' gradients as fp32 bytes, divided by bytes_per_step.
- `xfer/hook_ms`: the sum over the step's buckets of the time from the hook's call to the end of
  its collectives (compression, all-reduces and decompression, including any wait for the other
  ranks): the wall time until its future completes on gloo, CUDA events on NCCL, whose future
  completes once enqueued (counted in the first step that finds them passed: `CommMeter`);
  buckets may overlap each other and the backward pass.
- `xfer/buckets_per_step`: hook calls, one per DDP bucket reduced.

What DDP itself measured of the step's backward pass (its runtime logging data, which DDP records
for a sample of steps, the first ten and every hundredth: on CUDA, reading a step's timers waits
for the GPU, so every step would):

- `xfer/backward_compute_ms`: from the start of the backward pass to the last gradient ready;
- `xfer/backward_comm_ms`: from the first bucket's all-reduce launched to the last one done;
- `xfer/overlap_ms`: the part of backward_comm_ms spent while gradients were still computed;
- `xfer/overlap_frac`: overlap_ms / backward_comm_ms, the share of communication hidden.

DDP files a sampled step's timings during the next step's forward pass, so they are read there
and logged at the step they belong to; the run's very last step has none.

Every `xfer/` scalar is also logged once per epoch as its mean over the epoch's steps,
`xfer/<name>_epoch`, so a run shorter than `trainer.log_every_n_steps` steps still shows it.
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
        # DDP's runtime logging is private to it: no public API gives its backward timings. A torch without
        # it logs no timings rather than failing the run.
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
        """After this step's forward pass: DDP has just filed the previous step's timings."""
        timings = self.ddp_timings()
        if timings:
            self._record(trainer, timings)

    def _record(self, trainer: Trainer, values: dict[str, float]) -> None:
        """Keep the figures of the optimizer step that has just finished for the epoch's means; rank 0 also writes them
        at Lightning's logging steps, under the number Lightning gives that step (global_step - 1).

        Straight to the logger: `LightningModule.log` costs about a millisecond a call on a small CPU, which
        several calls a step turn into a share of a small model's step.
        """
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
        """The last recorded step's backward compute, communication and their overlap (ms); {} if none is new."""
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

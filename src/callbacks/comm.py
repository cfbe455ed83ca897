"""Gradient communication per optimizer step, as counted by the strategy's CommMeter.

Rank 0's figures, per process and per optimizer step (micro-batches that only accumulate
gradients send nothing and fold into the next step):

- `comm/bytes_per_step`: bytes of every all-reduce the hook issued (its payload, not the wire
  traffic of the all-reduce algorithm).
- `comm/compression_ratio`: the same buckets' gradients as fp32 bytes, divided by bytes_per_step.
- `comm/hook_ms`: the sum over the step's buckets of the wall time from the hook's call to the
  completion of the future it returned (compression, all-reduces and decompression, including
  any wait for the other ranks); buckets may overlap each other and the backward pass.
- `comm/buckets_per_step`: hook calls, one per DDP bucket reduced.
"""

from typing import Any

from lightning import Callback, LightningModule, Trainer

from src.strategies.comm import CommMeter


class CommLogger(Callback):
    """Logs the `comm/` scalars after each optimizer step; does nothing when the strategy has no CommMeter."""

    def __init__(self) -> None:
        self._meter: CommMeter | None = None
        self._last_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = getattr(trainer.strategy, "comm_meter", None)
        self._last_step = trainer.global_step
        if self._meter is not None:
            self._meter.take()  # drop anything sent before training (none is expected)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._meter is None or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        step = self._meter.take()
        if step.buckets == 0:
            return
        for name, value in (
            ("comm/bytes_per_step", float(step.bytes_sent)),
            ("comm/compression_ratio", step.compression_ratio),
            ("comm/hook_ms", step.hook_s * 1000),
            ("comm/buckets_per_step", float(step.buckets)),
        ):
            pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._meter = None

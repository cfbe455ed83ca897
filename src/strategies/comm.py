"""Measures what a DDP communication hook really sends, by counting the collectives it issues.

The hook gets a process group of its own, so every `torch.distributed.all_reduce` on that group
is the hook's: counting them counts exactly what it sends, including the all-reduces that
PowerSGD issues from future callbacks on the backend's threads (hence the lock).
"""

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

FP32_BYTES = 4


@dataclass(frozen=True)
class StepComm:
    """One process's gradient communication between two optimizer steps."""

    bytes_sent: int = 0  # payload of every all-reduce the hook issued
    fp32_bytes: int = 0  # the same buckets' gradients as fp32
    hook_s: float = 0.0  # sum over buckets of the time from the hook's call to its future completing
    buckets: int = 0  # hook calls, one per DDP bucket that was reduced
    collectives: int = 0  # all-reduce calls

    @property
    def compression_ratio(self) -> float:
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else 0.0


class CommMeter:
    """Counts the bytes and time of one DDP hook that owns its process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._step = StepComm()
        self._original: Callable[..., Any] | None = None
        self._counting: Callable[..., Any] | None = None

    def wrap(self, hook: Hook) -> Hook:
        """The hook, timed from its call until its future completes."""

        def measured(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            fp32_bytes = bucket.buffer().numel() * FP32_BYTES
            start = time.perf_counter()

            def done(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                self._add(fp32_bytes=fp32_bytes, hook_s=time.perf_counter() - start, buckets=1)
                return future.value()

            # DDP waits for the future returned here, so `done` has run before backward returns.
            return hook(state, bucket).then(done)

        return measured

    def start(self) -> None:
        """Route `torch.distributed.all_reduce` through the counter until `stop`."""
        original = dist.all_reduce

        @functools.wraps(original)
        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if group is self.group:
                self._add(bytes_sent=tensor.numel() * tensor.element_size(), collectives=1)
            return original(tensor, *args, **kwargs)

        self._original, self._counting = original, counting
        dist.all_reduce = counting

    def stop(self) -> None:
        if self._original is not None and dist.all_reduce is self._counting:
            dist.all_reduce = self._original
        self._original = self._counting = None

    def take(self) -> StepComm:
        """What was counted since the last call."""
        with self._lock:
            step, self._step = self._step, StepComm()
        return step

    def _add(self, bytes_sent: int = 0, fp32_bytes: int = 0, hook_s: float = 0.0, buckets: int = 0, collectives: int = 0) -> None:
        with self._lock:
            s = self._step
            self._step = StepComm(
                s.bytes_sent + bytes_sent, s.fp32_bytes + fp32_bytes, s.hook_s + hook_s,
                s.buckets + buckets, s.collectives + collectives,
            )

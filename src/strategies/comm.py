"""Measures what a DDP communication hook really sends, by counting the collectives on its own process group.

`CountingGroup` is a `torch.distributed.ProcessGroup` written in Python (c10d dispatches a Python subclass's
collectives to its methods) that counts the bytes of each all-reduce or all-gather, whoever issued it (PowerSGD
issues some from future callbacks on the backend's threads: hence the lock), and hands it to a real group; its Work
objects pass through. Where c10d or the backend refuses it, the run goes on uncounted and says so in one line.
Collectives that name world ranks (`broadcast`, `barrier`) need a registered group: a hook's `group.inner`.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

FP32_BYTES = 4


@dataclass(frozen=True)
class StepComm:
    bytes_sent: int = 0  # payload of every collective on the hook's group
    fp32_bytes: int = 0  # the same buckets' gradients as fp32
    hook_s: float = 0.0  # sum over buckets of the time from the hook's call to the end of its collectives
    buckets: int = 0  # hook calls, one per DDP bucket that was reduced
    collectives: int = 0  # collective calls on the hook's group

    @property
    def compression_ratio(self) -> float:
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else 0.0


class CommMeter:
    """Counts the bytes and time of one DDP hook that owns its process group.

    With `device_timed` (NCCL, whose future completes once its collectives are enqueued), a bucket is timed by CUDA
    events at the hook's call and in the future's callback; the first `take` that finds the end passed counts it.
    """

    def __init__(self, device_timed: bool = False) -> None:
        self._lock = threading.Lock()
        self._step = StepComm()
        self.counting = False  # whether the group's bytes are counted (see new_group)
        self.device_timed = device_timed
        self._events: list[tuple[Any, Any]] = []  # (start, end) CUDA events of buckets not counted yet

    def new_group(self, backend: str, timeout: timedelta) -> dist.ProcessGroup:
        """Called by every rank, as `dist.new_group`. One all-reduce probes the counting group; where it fails (alike
        on every rank, which runs the same torch), the plain group is returned, uncounted."""
        inner = dist.new_group(backend=backend, timeout=timeout)
        group = CountingGroup(inner, self)
        try:
            probe = torch.zeros(1, device=_device_of(backend))
            dist.all_reduce(probe, group=group)
        except Exception as error:  # noqa: BLE001  any failure means: go on uncounted, never fail the run
            reason = _first_cause(error)
            log.warning(f"xfer/bytes_per_step is not counted on this torch ({torch.__version__}) and backend "
                        f"({backend}): {reason}; the run goes on with a plain {backend} group")
            self.counting = False
            return inner
        self.take()  # the probe is not the hook's
        self.counting = True
        return group

    def wrap(self, hook: Hook) -> Hook:
        """The hook, timed from its call until its future completes."""

        def measured(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            fp32_bytes = bucket.buffer().numel() * FP32_BYTES
            started = self._start()

            def done(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                self._add(fp32_bytes=fp32_bytes, hook_s=self._stop(started), buckets=1)
                return future.value()

            # DDP waits for the future returned here, so `done` has run before backward returns.
            return hook(state, bucket).then(done)

        return measured

    def _start(self) -> Any:
        if not self.device_timed:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _stop(self, started: Any) -> float:
        """With CUDA events 0: `take` counts them. A future's callback runs on the stream its value is ready on."""
        if not self.device_timed:
            return time.perf_counter() - started
        with self._lock:
            self._events.append((started, self._start()))
        return 0.0

    def count_collective(self, bytes_sent: int) -> None:
        self._add(bytes_sent=bytes_sent, collectives=1)

    def take(self) -> StepComm:
        """What was counted since the last call."""
        with self._lock:
            step, self._step = self._step, StepComm()
            pending, self._events, device_ms = self._events, [], 0.0
            for start, end in pending:
                if end.query():
                    device_ms += start.elapsed_time(end)
                else:
                    self._events.append((start, end))
        return replace(step, hook_s=step.hook_s + device_ms / 1000)

    def _add(self, bytes_sent: int = 0, fp32_bytes: int = 0, hook_s: float = 0.0, buckets: int = 0, collectives: int = 0) -> None:
        with self._lock:
            s = self._step
            self._step = StepComm(
                s.bytes_sent + bytes_sent, s.fp32_bytes + fp32_bytes, s.hook_s + hook_s,
                s.buckets + buckets, s.collectives + collectives,
            )


def _first_cause(error: BaseException) -> str:
    """The first line of the first error (torch's exception logger can raise another while reporting it)."""
    while error.__context__ is not None:
        error = error.__context__
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _device_of(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


# The ProcessGroup methods c10d calls that a CountingGroup counts, with the position of the argument sent.
SENT_ARGUMENT: dict[str, int] = {"allreduce": 0, "allreduce_coalesced": 0, "allgather": 1, "reduce_scatter": 1}


class CountingGroup(dist.ProcessGroup):

    def __init__(self, inner: dist.ProcessGroup, meter: CommMeter) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.meter = meter

    def getBackendName(self) -> str:  # noqa: N802 (the name c10d calls)
        return f"counted_{self.inner.name()}"


def _forwarding(name: str, sent_argument: int) -> Callable[..., Any]:
    def collective(self: CountingGroup, *args: Any) -> Any:
        self.meter.count_collective(_nbytes(args[sent_argument]))
        return getattr(self.inner, name)(*args)

    collective.__name__, collective.__qualname__ = name, f"CountingGroup.{name}"
    return collective


for _name, _argument in SENT_ARGUMENT.items():
    setattr(CountingGroup, _name, _forwarding(_name, _argument))

"""What a DDP hook really sends: its own group, a ProcessGroup written in Python (c10d dispatches to its methods),
counts the collectives whoever issues them (PowerSGD from the backend's threads: hence the lock). Collectives that name
world ranks (`broadcast`, `barrier`) need the hook's `group.inner`."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
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
    """Bytes and time of one DDP hook that owns its group. `device_timed` (NCCL, whose future completes once its
    collectives are enqueued): buckets timed by CUDA events, counted by the `take` that finds them passed."""

    def __init__(self, device_timed: bool = False) -> None:
        self._lock = threading.Lock()
        self._step = StepComm()
        self.counting = False
        self.device_timed = device_timed
        self._events: list[tuple[Any, Any]] = []  # (start, end) CUDA events of buckets not counted yet

    def new_group(self, backend: str, timeout: timedelta) -> dist.ProcessGroup:
        """Called by every rank. One all-reduce probes the counting group; where it fails (alike on every rank), the
        plain group, uncounted."""
        inner = dist.new_group(backend=backend, timeout=timeout)
        group = CountingGroup(inner, self)
        try:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        except Exception as error:  # noqa: BLE001  any failure means: go on uncounted, never fail the run
            while error.__context__ is not None:  # torch's exception logger can raise another while reporting it
                error = error.__context__
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            log.warning(f"xfer/bytes_per_step is not counted on this torch ({torch.__version__}) and backend "
                        f"({backend}): {reason}; the run goes on with a plain {backend} group")
            return inner
        self.take()  # the probe is not the hook's
        self.counting = True
        return group

    def wrap(self, hook: Hook) -> Hook:
        """The hook, timed from its call until its future completes (DDP waits for that future in backward)."""

        def measured(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            fp32_bytes = bucket.buffer().numel() * FP32_BYTES
            started = self._now()

            def done(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                if self.device_timed:  # runs on the stream the value is ready on: `take` times the events
                    with self._lock:
                        self._events.append((started, self._now()))
                    self.add(fp32_bytes=fp32_bytes, buckets=1)
                else:
                    self.add(fp32_bytes=fp32_bytes, hook_s=time.perf_counter() - started, buckets=1)
                return future.value()

            return hook(state, bucket).then(done)

        return measured

    def _now(self) -> Any:
        if not self.device_timed:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

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

    def add(self, **counts: float) -> None:
        with self._lock:
            self._step = StepComm(**{f.name: getattr(self._step, f.name) + counts.get(f.name, 0)
                                     for f in fields(StepComm)})


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
        self.meter.add(bytes_sent=_nbytes(args[sent_argument]), collectives=1)
        return getattr(self.inner, name)(*args)

    collective.__name__, collective.__qualname__ = name, f"CountingGroup.{name}"
    return collective


for _name, _argument in SENT_ARGUMENT.items():
    setattr(CountingGroup, _name, _forwarding(_name, _argument))

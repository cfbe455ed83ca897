"""Measures what a DDP communication hook really sends, by counting the collectives on its process group.

The hook gets a process group of its own, made by `CommMeter.new_group`. That group's c10d
backend is a `CountingBackend`: a backend written in Python (torch's `Backend.register_backend`
extension point, registered here as `counted_gloo` or `counted_nccl`) that holds the real
backend, built by torch's own creator for it from the same store, ranks and timeout, and hands
every collective on to it after counting the bytes this process passes in. Every collective on
the group reaches the backend, whatever issued it: `dist.all_reduce` (however it was imported),
`all_reduce_coalesced`, `group.allreduce`, functional collectives, or PowerSGD's all-reduces
from future callbacks on the backend's threads (hence the lock). A collective the backend does
not forward fails with torch's "does not support" error instead of going uncounted. Nothing
process-wide is replaced, and other groups never see the counter.

The group itself is a plain torch `ProcessGroup`, so torch's dispatch to its backend, its name
and its registration stay torch's own; only the backend is ours. The Work objects the real
backend returns pass through, so `wait()` and `get_future()` behave as on a plain gloo or NCCL
group, and the timeout is the real backend's own. Building the real backend with torch's
creator reads torch's backend registry (`Backend._plugins`, as of torch 2.14): the same code
for gloo, NCCL and MPI, and the real backend gets exactly the options a plain group would.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

FP32_BYTES = 4
COUNTED_PREFIX = "counted_"


@dataclass(frozen=True)
class StepComm:
    """One process's gradient communication between two optimizer steps."""

    bytes_sent: int = 0  # payload of every collective on the hook's group
    fp32_bytes: int = 0  # the same buckets' gradients as fp32
    hook_s: float = 0.0  # sum over buckets of the time from the hook's call to its future completing
    buckets: int = 0  # hook calls, one per DDP bucket that was reduced
    collectives: int = 0  # collective calls on the hook's group

    @property
    def compression_ratio(self) -> float:
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else 0.0


class CommMeter:
    """Counts the bytes and time of one DDP hook that owns its process group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step = StepComm()

    def new_group(self, backend: str, timeout: timedelta) -> dist.ProcessGroup:
        """A process group of all ranks over `backend` (gloo, nccl, mpi) whose every collective this meter counts.

        Like `dist.new_group`, every rank must call it, in the same order as its other groups.
        """
        return dist.new_group(backend=register_counted_backend(backend), timeout=timeout, pg_options=self)

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

    def count_collective(self, bytes_sent: int) -> None:
        """One collective on the group, passing `bytes_sent` bytes in; called by its backend, on any thread."""
        self._add(bytes_sent=bytes_sent, collectives=1)

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


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or of every tensor in a (nested) list of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


# The collectives a CountingBackend forwards (torch's Python names for them, as c10d calls a Python
# backend), each with the position of the argument holding what this process passes in; None: nothing.
SENT_ARGUMENT: dict[str, int | None] = {
    "allreduce": 0, "allreduce_coalesced": 0, "reduce": 0, "broadcast": 0,
    "allgather": 1, "allgather_coalesced": 1, "all_gather_single": 1, "all_gather_single_coalesced": 1, "gather": 1,
    "scatter": 1, "reduce_scatter": 1, "reduce_scatter_single": 1, "reduce_scatter_single_coalesced": 1,
    "alltoall": 1, "all_to_all_single": 1, "send": 0, "recv": None, "barrier": None,
}


class CountingBackend(C10dBackend):
    """A c10d backend that counts each collective's bytes with a CommMeter, then hands it to the real backend."""

    def __init__(self, inner: C10dBackend, meter: CommMeter, name: str) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.meter = meter
        self._name = name

    @property
    def options(self) -> Any:
        return self.inner.options  # the real backend's, timeout included

    def getBackendName(self) -> str:  # noqa: N802 (the name c10d calls)
        return self._name

    def shutdown(self) -> None:
        self.inner.shutdown()

    def abort(self) -> None:
        self.inner.abort()


def _forwarding(name: str, sent_argument: int | None) -> Callable[..., Any]:
    def collective(self: CountingBackend, *args: Any) -> Any:
        self.meter.count_collective(_nbytes(args[sent_argument]) if sent_argument is not None else 0)
        return getattr(self.inner, name)(*args)

    collective.__name__, collective.__qualname__ = name, f"CountingBackend.{name}"
    return collective


for _name, _argument in SENT_ARGUMENT.items():
    setattr(CountingBackend, _name, _forwarding(_name, _argument))


def register_counted_backend(backend: str) -> str:
    """Register `counted_<backend>`, the counting wrapper of a built-in backend, once; returns its name.

    Its creator builds the real backend with torch's own creator for `backend` (so the timeout,
    the group's name and NCCL's communicator splitting are as on a plain group) and wraps it. The
    group's `pg_options` is the CommMeter that counts; the real backend gets its default options.
    """
    name = COUNTED_PREFIX + backend
    if name.upper() in dist.Backend._plugins:
        return name
    dist.Backend._ensure_backend_registered(backend)  # torch registers its built-in backends on first use
    real = dist.Backend._plugins[backend.upper()]

    def create(opts: Any, meter: CommMeter) -> CountingBackend:
        return CountingBackend(real.creator_fn(opts, None), meter, name)

    dist.Backend.register_backend(name, create, extended_api=True, devices=dist.Backend.backend_capability[backend])
    return name

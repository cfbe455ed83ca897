"""A model's training step timed here, on one thread: the step a what-if starts from, and the terms of the cost
model (overhead, skew, hook, DDP's own work, lag) that one run's averages cannot give (docs/scaling.md)."""

import copy
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.nn.parallel import DistributedDataParallel

from src.scaling.probe import lag_share, one_thread, start_ranks
from src.strategies.comm import CommMeter
from src.strategies.ddp import CommHookDDPStrategy, one_bucket_cap_mb

T = TypeVar("T")

log = logging.getLogger(__name__)

BUDGET_S = 1.0  # timing per batch size: enough repeats for a median, few enough for a report
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # Lightning's names; any other: no autocast


@dataclass(frozen=True)
class StepClock:
    step_s: float  # median step at the batch asked for
    overhead_share: float  # of step_s, between 0 and 1
    skew: float  # standard deviation / mean of step_s


def reason(error: Exception, limit: int = 300) -> str:
    """An exception in one short line, for a warning or a usage error; a rank's by its traceback's last line."""
    if isinstance(error, ProcessRaisedException):
        return " ".join(str(error).strip().splitlines()[-1].split())[:limit]
    return f"{type(error).__name__}: {' '.join(str(error).split())[:limit]}"


def stepper(net: nn.Module, input_shape: Sequence[int], batch: int, precision: str = "32-true",
            device: str = "cpu") -> Callable[[], float]:
    """A training step on random data that returns its seconds (on CUDA, once the device has done it)."""
    images = torch.randn(batch, *input_shape, device=device)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    with torch.no_grad():  # a DDP model prepares its backward pass only for a forward pass that records one
        classes = int(net(images[:1]).shape[-1])
    labels = torch.randint(0, classes, (batch,), device=device)
    autocast = AUTOCAST.get(precision)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def step_times(net: nn.Module, input_shape: Sequence[int], batch: int, repeats: int | None = None,
               precision: str = "32-true", device: str = "cpu") -> list[float]:
    """Seconds of each of `repeats` steps after a warm-up one; None: as many as fit BUDGET_S."""
    step = stepper(net, input_shape, batch, precision, device)
    first = step()
    count = repeats if repeats is not None else max(3, min(20, int(BUDGET_S / max(first, 1e-6))))
    return [step() for _ in range(count)]


def measure(net: nn.Module, input_shape: Sequence[int], batch: int, precision: str = "32-true") -> StepClock:
    """Time `net`'s step at `batch` and at a quarter of it, on one thread."""
    with one_thread():
        net.train()
        full = step_times(net, input_shape, batch, precision=precision)
        small_batch = max(1, batch // 4)
        small = statistics.median(step_times(net, input_shape, small_batch, precision=precision))
    step = statistics.median(full)
    return StepClock(step, overhead_share(step, batch, small, small_batch), statistics.pstdev(full) / statistics.mean(full))


def overhead_share(step: float, batch: int, small_step: float, small_batch: int) -> float:
    """The intercept of the line through (small_batch, small_step) and (batch, step), as a share of `step`, within [0, 1)."""
    if small_batch >= batch:
        return 0.0
    intercept = (small_step * batch - step * small_batch) / (batch - small_batch)
    return min(max(intercept / step, 0.0), 0.99)


def in_processes(failed: str, instead: str, work: Callable[..., Any], processes: int, net: Any, *args: Any,
                 device: str = "cpu") -> Any:
    """`work(rank, processes, net, *args)` in `start_ranks`, its group, DDP's threads and any failure away from the
    caller's; None, logged, where it fails. A net that cannot be built here fails before any process starts."""
    try:
        instantiate(net)
        return start_ranks(work, processes, net, *args, device=device)
    except Exception as error:  # noqa: BLE001  a figure that cannot be timed is estimated or assumed instead
        log.warning(f"{failed} ({reason(error)}); {instead}")
        return None


def _each_hook(rank: int, processes: int, net: Any, measure: Callable[..., T], hooks: tuple[str, ...],
               *args: Any) -> dict[str, T]:
    model = instantiate(net)
    return {hook: measure(model, hook, *args) for hook in hooks}


def _ddp(net: nn.Module, hook: str, rank: int, bucket_cap_mb: float, device: str = "cpu",
         meter: CommMeter | None = None) -> tuple[CommHookDDPStrategy, DistributedDataParallel]:
    """A DDP copy of `net` with `hook` (timed by `meter`, if any); PowerSGD in one bucket, as in this project's runs."""
    strategy = CommHookDDPStrategy(hook=hook, powersgd_rank=rank, start_powersgd_iter=2)
    cap = max(bucket_cap_mb, one_bucket_cap_mb(net)) if hook.startswith("powersgd") else bucket_cap_mb
    model = DistributedDataParallel(copy.deepcopy(net).to(device).train(), bucket_cap_mb=cap,
                                    device_ids=[0] if device == "cuda" else None)
    state, function = strategy.build_hook(dist.group.WORLD)
    model.register_comm_hook(state, meter.wrap(function) if meter else function)
    return strategy, model


@dataclass(frozen=True)
class DDPClock:
    hooks: dict[str, float]  # s per step: each hook from its call to its future's completion
    reducer: float  # s per step DDP adds besides its hook, the same for every hook


def ddp_times(net: Any, input_shape: Sequence[int], hooks: Sequence[str], rank: int = 1,
              bucket_cap_mb: float = 25.0, repeats: int = 5) -> DDPClock | None:
    """Seconds per step DDP and each hook take besides their transfer, on one thread: on a one-process gloo group
    every all-reduce is a local no-op. None where it fails: the caller then estimates the hooks (`timed.encode_s`)."""
    timed = in_processes("the DDP hooks could not be timed", "their arithmetic is estimated", _each_hook, 1, net,
                         _hook_and_reducer_s, tuple(hooks), tuple(input_shape), rank, bucket_cap_mb, repeats)
    if timed is None:
        return None
    # Still a difference of timings: below zero where DDP's copies are tiny next to the pass.
    reducer = max(0.0, statistics.median(added for _, added in timed.values()))
    return DDPClock({hook: hook_s for hook, (hook_s, _) in timed.items()}, reducer)


def _hook_and_reducer_s(net: nn.Module, hook: str, input_shape: Sequence[int], rank: int, bucket_cap_mb: float,
                        repeats: int) -> tuple[float, float]:
    """The median of the hook's seconds per step, and what the rest of DDP adds to a forward and backward pass: the
    least DDP pass less the least hook and plain pass (load only ever adds to a timing, and a difference of medians
    of a loaded machine can fall below zero)."""
    plain, meter = copy.deepcopy(net), CommMeter()
    strategy, model = _ddp(net, hook, rank, bucket_cap_mb, meter=meter)
    image = torch.randn(1, *input_shape)  # one image: the gradients, all DDP and the hook see, do not depend on the batch
    ddp_s, hook_s, plain_s = [], [], []
    for _ in range(strategy.start_powersgd_iter + 1 + repeats):  # PowerSGD's first steps are plain all-reduces
        ddp_s.append(_pass_s(model, image))
        hook_s.append(meter.take().hook_s)
        plain_s.append(_pass_s(plain, image))
    timed = slice(-repeats, None)
    return statistics.median(hook_s[timed]), min(ddp_s[timed]) - min(hook_s[timed]) - min(plain_s[timed])


def _pass_s(model: nn.Module, image: torch.Tensor) -> float:
    """Seconds of a forward and backward pass, the gradients cleared first as an optimizer step leaves them."""
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(image).float().sum().backward()
    return time.perf_counter() - start


def ddp_step_costs(net: Any, input_shape: Sequence[int], batch: int, precision: str, hooks: Sequence[str], rank: int = 1,
                   bucket_cap_mb: float = 25.0, device: str = "cuda", repeats: int = 10) -> dict[str, float] | None:
    """Seconds a step of a DDP model of world size 1 takes beyond the plain model's, per hook, on `device`: what DDP
    costs a GPU's step besides the transfer. None where it fails, as `ddp_times`."""
    return in_processes(f"DDP's own cost could not be measured on {device}", "it is assumed", _each_hook, 1, net,
                        _added_by_ddp, tuple(hooks), tuple(input_shape), batch, precision, rank, bucket_cap_mb,
                        device, repeats, device=device)


def _added_by_ddp(net: nn.Module, hook: str, input_shape: Sequence[int], batch: int, precision: str, rank: int,
                  bucket_cap_mb: float, device: str, repeats: int) -> float:
    """The two models' steps alternate, so that a device that speeds up or slows down moves both."""
    strategy, ddp = _ddp(net, hook, rank, bucket_cap_mb, device)
    plain = copy.deepcopy(net).to(device).train()
    plain_step, ddp_step = stepper(plain, input_shape, batch, precision, device), stepper(ddp, input_shape, batch, precision, device)
    for _ in range(strategy.start_powersgd_iter + 2):  # warm-up: allocation, autotuning, PowerSGD's plain steps
        plain_step(), ddp_step()
    added = [ddp_step() - plain_step() for _ in range(repeats)]
    return max(0.0, statistics.median(added))  # the difference of two timings can fall below zero where DDP costs little


def meeting_lags(net: Any, input_shape: Sequence[int], batches: dict[int, int], precision: str = "32-true",
                 cores: int | None = None, rounds: int = 8) -> dict[int, float]:
    """For each process count N in `batches` (N -> each process's batch), the time N one-thread processes lose stepping
    together and meeting after each step, a share of their turns; a count whose processes fail is left out, logged."""
    cores = cores or len(os.sched_getaffinity(0))
    lags = {}
    for processes, batch in batches.items():
        timed = in_processes(f"the model's steps on {processes} processes could not be timed",
                             "the probe's lag is used instead", _meeting_worker, processes, net, tuple(input_shape),
                             batch, precision, rounds)
        if timed is not None:
            lags[processes] = lag_share(*timed, processes, cores)
    return lags


def _meeting_worker(rank: int, processes: int, net: Any, input_shape: tuple[int, ...], batch: int, precision: str,
                    rounds: int) -> list[float]:
    """Each round one process steps alone (interleaved, so that a machine that changes speed moves both), then all
    step together and meet: the medians of both."""
    model = instantiate(net).train()
    step, token = stepper(model, input_shape, batch, precision), torch.zeros(1)
    step()  # warm-up: allocation, first-call dispatch
    alone, together = [], []
    for round_ in range(rounds):
        dist.barrier()
        if rank == round_ % processes:
            alone.append(step())
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.all_reduce(token)
        together.append(time.perf_counter() - start)
    everyone: list[list[float] | None] = [None] * processes
    dist.all_gather_object(everyone, alone)
    return [statistics.median(s for steps in everyone if steps for s in steps), statistics.median(together)]

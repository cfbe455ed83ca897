"""A model's training step timed here, on one thread: the step time a what-if starts from, and two
terms of the cost model that one run's averages cannot give.

- overhead: the part of a step that does not shrink with the batch. The step is timed at the
  batch b and at b/4; the straight line t(b) = overhead + c x b through both gives it. Processes
  that split a global batch each still pay it in full.
- skew: the spread of the step time (standard deviation / mean) over repeated steps. With N
  ranks, every all-reduce waits for the slowest; `costmodel.expected_max_normal` says how far
  behind the mean that one is.

Forward pass, cross-entropy on random labels, backward pass and a plain SGD step, in the run's
precision (bf16 and fp16 autocast add a cast per layer, a cost the batch does not shrink): the
figures are shares of a step, applied to a run's own step time.

- hook: what each DDP communication hook costs a step besides its all-reduces' transfer: torch's
  own hook (PowerSGD's error feedback, products, orthogonalisation and the chain of futures its
  three all-reduces complete on), timed in a DDP model of the run's shapes on a one-process gloo group.
"""

import copy
import logging
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.strategies.comm import CommMeter
from src.strategies.ddp import CommHookDDPStrategy, one_bucket_cap_mb

log = logging.getLogger(__name__)

BUDGET_S = 1.0  # timing per batch size: enough repeats for a median, few enough for a report


@dataclass(frozen=True)
class StepClock:
    step_s: float  # median step at the batch asked for
    overhead_share: float  # of step_s, between 0 and 1
    skew: float  # standard deviation / mean of step_s


AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # Lightning's names; any other: no autocast


def step_times(net: nn.Module, input_shape: Sequence[int], batch: int, repeats: int | None = None,
               precision: str = "32-true") -> list[float]:
    """Seconds of each of `repeats` training steps at `batch` (after one warm-up step); None: as many as fit BUDGET_S."""
    images = torch.randn(batch, *input_shape)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    classes = int(net(images[:1]).shape[-1])
    labels = torch.randint(0, classes, (batch,))
    autocast = AUTOCAST.get(precision)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    first = step()
    count = repeats if repeats is not None else max(3, min(20, int(BUDGET_S / max(first, 1e-6))))
    return [step() for _ in range(count)]


def measure(net: nn.Module, input_shape: Sequence[int], batch: int, precision: str = "32-true") -> StepClock:
    """Time `net`'s step at `batch` and at a quarter of it, with one thread, in `precision`; restore the thread count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net.train()
        full = step_times(net, input_shape, batch, precision=precision)
        small_batch = max(1, batch // 4)
        small = statistics.median(step_times(net, input_shape, small_batch, precision=precision))
    finally:
        torch.set_num_threads(threads)
    step = statistics.median(full)
    return StepClock(step, overhead_share(step, batch, small, small_batch), statistics.pstdev(full) / statistics.mean(full))


def overhead_share(step: float, batch: int, small_step: float, small_batch: int) -> float:
    """The intercept of the line through (small_batch, small_step) and (batch, step), as a share of `step`, within [0, 1)."""
    if small_batch >= batch:
        return 0.0
    intercept = (small_step * batch - step * small_batch) / (batch - small_batch)
    return min(max(intercept / step, 0.0), 0.99)


def hook_times(net: Any, input_shape: Sequence[int], hooks: Sequence[str], rank: int = 1,
               bucket_cap_mb: float = 25.0, repeats: int = 5) -> dict[str, float] | None:
    """Seconds per step each hook takes from its call to its future's completion, as in training, on one thread.

    `net`: the model's config (`_target_` and its arguments). A one-process gloo group makes every
    all-reduce a local no-op, so what is left is the hook itself. It runs in a process of its own:
    the group, DDP's threads and any failure stay there, away from the caller's process and its
    groups. None, with the reason logged, when that process fails; the caller then estimates the
    hooks' arithmetic instead (`costmodel.encode_s`).
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(_hook_times, net, tuple(input_shape), tuple(hooks), rank, bucket_cap_mb, repeats).result()
        except Exception as error:  # noqa: BLE001  a figure that cannot be timed is estimated instead
            log.warning(f"the DDP hooks could not be timed ({type(error).__name__}: {error}); their arithmetic is estimated")
            return None


def _hook_times(net: Any, input_shape: tuple[int, ...], hooks: tuple[str, ...], rank: int, bucket_cap_mb: float,
                repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = instantiate(net)
    return {hook: _hook_s(model, input_shape, hook, rank, bucket_cap_mb, repeats) for hook in hooks}


def _hook_s(net: nn.Module, input_shape: Sequence[int], hook: str, rank: int, bucket_cap_mb: float, repeats: int) -> float:
    strategy = CommHookDDPStrategy(hook=hook, powersgd_rank=rank, start_powersgd_iter=2)
    # PowerSGD gets one bucket, as this project's gloo runs give it (`CommHookDDPStrategy.ddp_bucket_cap_mb`).
    cap = max(bucket_cap_mb, one_bucket_cap_mb(net)) if hook.startswith("powersgd") else bucket_cap_mb
    model = DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=cap)
    meter = CommMeter()
    state, function = strategy.build_hook(dist.group.WORLD)
    model.register_comm_hook(state, meter.wrap(function))
    image = torch.randn(1, *input_shape)  # one image: the gradients, all the hook sees, do not depend on the batch
    times = []
    for _ in range(strategy.start_powersgd_iter + 1 + repeats):  # PowerSGD's first steps are plain all-reduces
        model(image).float().sum().backward()
        times.append(meter.take().hook_s)
    return statistics.median(times[-repeats:])

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
"""

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

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

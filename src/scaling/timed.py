"""What `python -m src.scaling <folder>` times here for a run's model, and `scaling_terms.json`, which keeps it:
a report never times (seconds to a minute), it reads this file and says what it assumes where it has no entry."""

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from src.folders import read_bytes, write_file
from src.records import LIMIT
from src.scaling import stepclock
from src.scaling.probe import median_s
from src.strategies.ddp import HOOKS

log = logging.getLogger(__name__)

FILE = "scaling_terms.json"


@dataclass
class Timed:
    """A run's model's terms as timed here; None where a figure was not timed."""

    device: str  # where: "cpu", or the GPU's name
    overhead_share: float | None = None  # of the step, which no split of the batch shrinks
    skew: float | None = None  # standard deviation / mean of the step
    hooks: dict[str, float] = field(default_factory=dict)  # s per step, each hook's own work besides its transfer
    hooks_estimated: bool = False  # the hooks' arithmetic estimated, where DDP could not be timed
    reducer: dict[str, float] = field(default_factory=dict)  # s per step DDP adds besides the hook (GPU: with it), per hook
    lags: dict[int, float] = field(default_factory=dict)  # processes -> the model's lag meeting on shared cores

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"


def key(model: str, batch: int, processes: int, precision: str, per_process_batch: int | None, bucket_mb: float,
        rank: int) -> str:
    return f"{model}|batch {batch}|{processes} proc|{precision}|per process {per_process_batch}|{bucket_mb:g} MiB|rank {rank}"


def encode_s(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1) -> float:
    """Seconds one CPU thread spends per step on the hook's own arithmetic, on tensors of the model's shapes (PowerSGD:
    the error feedback, P = M Q, orthonormalised, Q = M^T P, M = P Q^T)."""
    numel = sum(math.prod(shape) for shape in shapes)
    flat = torch.randn(numel)
    if hook == "none":
        return median_s(lambda: flat.div_(2))
    if hook in ("fp16", "bf16"):
        dtype = torch.float16 if hook == "fp16" else torch.bfloat16
        return median_s(lambda: flat.copy_(flat.to(dtype).div_(2)))
    matrices = [torch.randn(s[0], math.prod(s) // s[0]) for s in shapes if len(s) > 1]
    matrices = [m for m in matrices if 2 * (m.shape[0] + m.shape[1]) * min(rank, *m.shape) < m.numel()]
    error = torch.zeros(numel)

    def powersgd() -> None:
        if hook == "powersgd_fp16":
            flat.copy_(flat.half().float())
        flat.add_(error)
        kept = flat.clone()
        for m in matrices:
            r = min(rank, *m.shape)
            p = torch.linalg.qr(m @ torch.randn(m.shape[1], r)).Q
            q = m.T @ p
            m.copy_(p @ q.T)
        error.copy_(kept).sub_(flat)

    return median_s(powersgd)


def time_run(net: Any, shapes: Sequence[Sequence[int]], input_shape: Sequence[int], batch: int, precision: str,
             accelerator: str, rank: int, bucket_mb: float, cores: int, meet_batches: dict[int, int],
             need_clock: bool = True) -> Timed:
    """Time the terms of a run's model here at each process's `batch`. A CPU run: overhead, skew, each hook, DDP
    besides it, the lag meeting at `meet_batches` (processes -> batch); a GPU run: what DDP of world size 1 adds."""
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            return Timed(device="")  # a GPU run read where there is none: nothing measured, the defaults are assumed
        costs = stepclock.ddp_step_costs(net, input_shape, batch, precision, HOOKS, rank, bucket_mb, device="cuda")
        return Timed(device=torch.cuda.get_device_name(0), reducer=costs or {})
    timed = Timed(device="cpu")
    if need_clock:
        clock = stepclock.measure(instantiate(net), input_shape, batch, precision)
        timed.overhead_share, timed.skew = clock.overhead_share, clock.skew
    ddp = stepclock.ddp_times(net, input_shape, HOOKS, rank, bucket_mb)
    if ddp is None:
        timed.hooks, timed.hooks_estimated = {h: encode_s(shapes, h, rank) for h in HOOKS}, True
    else:
        timed.hooks, timed.reducer = dict(ddp.hooks), {h: ddp.reducer for h in HOOKS}
    timed.lags = stepclock.meeting_lags(net, input_shape, meet_batches, precision, cores) if meet_batches else {}
    return timed


def load(path: Path) -> dict[str, Timed]:
    """The saved figures by `key`; none where the file is missing or unreadable."""
    if not path.is_file():
        return {}
    try:
        saved = json.loads(read_bytes(path, LIMIT))
        return {name: Timed(**{**figures, "lags": {int(n): lag for n, lag in figures.get("lags", {}).items()}})
                for name, figures in saved.items()}
    except (ValueError, TypeError, AttributeError) as error:
        log.warning(f"{path}: not read ({type(error).__name__}: {error}); its terms are assumed until timed again")
        return {}


def save(path: Path, figures: dict[str, Timed]) -> None:
    write_file(path, json.dumps({name: asdict(timed) for name, timed in figures.items()}, indent=1) + "\n")

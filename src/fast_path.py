"""Settings that make the same training faster on the hardware at hand, each chosen by measurement (docs/results.md):
`precision=auto`, `channels_last`, `compile`, `trainer.benchmark`, `cuda_graphs` and `steps_per_execution`."""

import ctypes
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning import Callback, LightningModule
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from omegaconf import DictConfig
from torch import nn

from src.errors import UsageError
from src.sysinfo import cpu_has_bf16, launching_gpus, recommend_precision

log = logging.getLogger(__name__)

STEPS_PER_EXECUTION = 8  # Lightning's loop costs about 1.7 ms a batch on an H100 host: more than a LeNet step

LIGHTNING_SPELLING = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}  # as Trainer has it

# glibc's mallopt parameters (malloc.h) and the value that turns trimming off.
M_TRIM_THRESHOLD, M_MMAP_MAX, NEVER = -1, -4, -1

# Lightning calls these from inside `manual_backward`, which a CUDA graph captures once and then replays without them.
STEP_HOOKS = {LightningModule: ("on_before_backward", "backward", "on_after_backward"),
              Callback: ("on_before_backward", "on_after_backward")}

# torch's own float32 math on CUDA: cuDNN convolves float32 in TF32 (10 mantissa bits) on Ampere and later.
TORCH_FP32_MATH = (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision)

StepFunction = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def auto_precision(accelerator: str) -> str:
    """Resolved while the run is named, in the launching process: without a CUDA context (`launching_gpus`)."""
    return recommend_precision(launching_gpus() if accelerator == "gpu" else [], cpu_has_bf16())[0]


def resolve_accelerator(requested: str) -> str:
    """`cuda` is Lightning's other name for `gpu`."""
    if requested == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if requested == "cuda" else requested


def resolve_precision(requested: object, accelerator: str) -> str:
    """What Lightning will really use, spelled as the run's records give it; CPU has no fp16 autocast: bf16."""
    precision = str(requested)
    if precision == "auto":
        precision = auto_precision(accelerator)
    elif accelerator == "cpu" and precision in ("16", "16-mixed"):
        precision = "bf16-mixed"
    return LIGHTNING_SPELLING.get(precision, precision)


def float32_math(precision: str, accelerator: str) -> bool:
    """Whether float32 computes in full: `precision=32` (Lightning's `32-true`) on CUDA does, in cuDNN and matmuls
    alike; the other precisions keep torch's defaults. Set at every run: a sequential sweep's runs share the process."""
    exact = accelerator == "gpu" and precision == "32-true"
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = (
        ("ieee", "ieee") if exact else TORCH_FP32_MATH)
    return exact


def hooks_in_step(module: object, callbacks: list[object]) -> list[str]:
    """The hooks a CUDA graph replay of the training step would skip: those the module or a callback overrides among
    the ones Lightning calls inside the step."""
    found = []
    for owner in [module, *callbacks]:
        for base, hooks in STEP_HOOKS.items():
            if isinstance(owner, base):
                found += [f"{type(owner).__name__}.{hook}" for hook in hooks
                          if getattr(type(owner), hook) is not getattr(base, hook)]
    return found


def cudnn_benchmark(benchmark: bool | None, deterministic: object) -> bool:
    """On by default: Lightning's default leaves cuDNN's autotuning off."""
    return (not deterministic) if benchmark is None else benchmark


def one_channel_nchw_pays(accelerator: str, strategy: object) -> bool:
    """One-input-channel convolutions keep NCHW weights under `channels_last` only under DDP on CUDA, where cuDNN gave
    their gradient in NCHW strides and DDP copied it every step; on CPU the mixed layout costs a conversion a pass."""
    return accelerator == "gpu" and isinstance(strategy, DDPStrategy)


def speed_up(net: nn.Module, channels_last: bool, compile: bool, one_channel_nchw: bool = False) -> nn.Module:
    """In place, before any device or wrapper sees `net`."""
    if channels_last:
        net.to(memory_format=torch.channels_last)
        for conv in net.modules() if one_channel_nchw else ():
            if isinstance(conv, nn.Conv2d) and conv.in_channels == 1:
                conv.weight.data = conv.weight.data.clone(memory_format=torch.contiguous_format)
    if compile:
        net.compile()
    return net


def keep_freed_memory() -> bool:
    """Keep memory a CPU step frees for the next; whether glibc took it. glibc maps large blocks fresh and trims its
    heap, so each step faulted its activations in again: up to a fifth of LeNet's step on CPU (docs/results.md)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER))


@dataclass(frozen=True)
class FastSteps:
    """`steps_per_execution` optimizer steps per training batch, graphed or not."""

    steps_per_execution: int = 1
    cuda_graphs: bool = False
    compiled: bool = False  # the network is compiled: its first step is a warm-up, timed and reported

    @property
    def manual(self) -> bool:  # the module steps its optimizer itself (Lightning's manual optimization)
        return self.steps_per_execution > 1 or self.cuda_graphs


def resolve_fast_steps(cuda_graphs: bool | str, steps_per_execution: int | str, *, accelerator: str, world_size: int,
                       strategy: object, compile: bool, trainer_args: dict[str, Any], supported: bool,
                       step_counts: dict[str, int] | None = None, hooks: list[str] | None = None) -> FastSteps:
    """`auto` takes them where they work (one process stepping its own optimizer; graphs: CUDA, no `compile`, no
    `hooks` that a replay would skip), and the most steps per batch that divide `step_counts`: Lightning checks those
    counts only after each batch."""
    blockers = [need for need, missing in (
        ("a strategy of one process on one device (strategy=auto)",
         world_size > 1 or not (strategy == "auto" or isinstance(strategy, SingleDeviceStrategy))),
        ("trainer.accumulate_grad_batches=1", trainer_args.get("accumulate_grad_batches", 1) != 1),
        ("trainer.gradient_clip_val=null", trainer_args.get("gradient_clip_val") is not None),
        ("the Classifier and a data module with steps_per_execution (the built-in ones)", not supported),
    ) if missing]
    graph_blockers = blockers + (["a CUDA device"] if accelerator != "gpu" else []) + (
        [f"no hook that runs inside the training step, where a replay skips it (here: {', '.join(hooks)})"]
        if hooks else [])
    graphs = cuda_graphs == "auto" and not graph_blockers and not compile or cuda_graphs is True
    if cuda_graphs is True and graph_blockers:
        raise UsageError(f"cuda_graphs=true needs {', '.join(graph_blockers)}; use cuda_graphs=false")
    counts = {key: n for key, n in (step_counts or {}).items() if n > 0}
    if steps_per_execution == "auto":
        steps = 1 if blockers else math.gcd(STEPS_PER_EXECUTION, *counts.values())
    else:
        steps = int(steps_per_execution)
        if steps > 1 and blockers:
            raise UsageError(f"steps_per_execution={steps} needs {', '.join(blockers)}; "
                             "use steps_per_execution=auto or 1")
        for key, n in counts.items():
            if n % steps:
                raise UsageError(f"steps_per_execution={steps} does not divide {key}={n}; use a divisor of it, "
                                 "or steps_per_execution=auto")
    return FastSteps(steps_per_execution=steps, cuda_graphs=graphs, compiled=compile)


class GraphedStep:
    """Forward, loss and backward of one batch shape, captured once, then replayed; gradients must be None at capture,
    so that the graph owns them. Run warm steps eagerly first (cuDNN autotuning, optimizer state)."""

    def __init__(self, step: StepFunction, x: torch.Tensor, y: torch.Tensor, parameters: list[nn.Parameter]) -> None:
        self.x, self.y = x.clone(), y.clone()
        device = x.device.type
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.get_autocast_dtype(device), enabled=torch.is_autocast_enabled(device),
                            cache_enabled=False):  # capture forbids autocast's weight cache
            loss, logits = self._capture(step)
        self.capture_s = time.perf_counter() - start
        # Detached, the capture's autograd graph goes: an eager step after it (an uneven last batch) would
        # otherwise accumulate through its nodes, which live on the capture's stream (torch warns, and syncs).
        self.loss, self.logits = loss.detach(), logits.detach()
        self.grads = [(param, param.grad) for param in parameters if param.grad is not None]

    def _capture(self, step: StepFunction) -> tuple[torch.Tensor, torch.Tensor]:
        """Apart, with `_replay`, so that a test can play the graph on CPU."""
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.x.device)
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            result = step(self.x, self.y)
        torch.cuda.synchronize(self.x.device)
        return result

    def _replay(self) -> None:
        self.graph.replay()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay on `x`, `y`; the returned tensors are overwritten by the next replay."""
        self.x.copy_(x)
        self.y.copy_(y)
        for param, grad in self.grads:  # Lightning sets them to None before validation; the optimizer skips those
            if param.grad is not grad:
                param.grad = grad
        self._replay()
        return self.loss, self.logits


def apply_fast_steps(cfg: DictConfig, trainer_args: dict[str, Any], module: nn.Module, datamodule: object, *,
                     accelerator: str, world_size: int, strategy: object, step_batch: int,
                     callbacks: list[object]) -> FastSteps:
    """Set the module, the data and the Trainer's batch counts (in place) up for the fast steps."""
    batch_counts = {f"trainer.{key}": value for key in ("limit_train_batches", "val_check_interval")
                    if type(value := trainer_args.get(key)) is int}
    fast_steps = resolve_fast_steps(
        cfg.cuda_graphs, cfg.steps_per_execution, accelerator=accelerator, world_size=world_size, strategy=strategy,
        compile=cfg.compile, trainer_args=trainer_args,
        step_counts={"checkpoint.every_n_train_steps": cfg.checkpoint.every_n_train_steps,
                     "trainer.max_steps": trainer_args["max_steps"], **batch_counts},
        supported=hasattr(module, "use_fast_steps") and hasattr(datamodule, "steps_per_execution"),
        hooks=hooks_in_step(module, callbacks),
    )
    for key in batch_counts:  # counted in optimizer steps: Lightning counts batches of steps_per_execution steps
        trainer_args[key.removeprefix("trainer.")] //= fast_steps.steps_per_execution
    if hasattr(module, "use_fast_steps"):
        module.use_fast_steps(fast_steps, step_batch)
    if fast_steps.manual:
        datamodule.steps_per_execution = fast_steps.steps_per_execution  # type: ignore[attr-defined]
    return fast_steps

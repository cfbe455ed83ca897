"""The settings that make the same training faster on the hardware at hand.

- `precision=auto`: what `python -m src.sysinfo` recommends for the devices in use: bf16 autocast
  where they compute bf16 natively (CPUs with AVX512-BF16 or AMX, GPUs from Ampere on), fp16
  autocast on older GPUs with tensor cores, fp32 elsewhere.
- `channels_last=true`: weights and inputs in NHWC order, the layout oneDNN and cuDNN convolve
  fastest (ResNet-18 on an H100: 5.9 against 10.6 ms a step in bf16). Same numbers. Every
  convolution, except under DDP on CUDA (`one_channel_nchw_pays`).
- on CPU, freed memory stays in the process (`keep_freed_memory`): glibc otherwise hands large
  blocks back to the kernel and faults them in again, page by page, at the next step.
- `compile=true`: `torch.compile` on the network, in place, so that checkpoints keep their keys.
- `trainer.benchmark=true`: cuDNN times its convolution algorithms once and keeps the fastest.
- `cuda_graphs=auto`: on one CUDA device, each step's forward and backward pass is one CUDA graph
  replay (`GraphedStep`) instead of hundreds of kernel launches from Python; `cuda_graphs=true
  compile=true` captures the compiled network's kernels.
- `steps_per_execution=auto`: in one process, each of Lightning's training batches holds 8 optimizer
  steps, so Lightning's per-batch work (its hooks on every callback, its progress and logging
  bookkeeping: about 1.7 ms on a GPU host, 2.3 ms on a 2-core CPU) is paid once per 8 steps.

`benchmarks/speed.py` measures each; docs/results.md has the figures.
"""

import ctypes
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from omegaconf import DictConfig
from torch import nn

from src.errors import UsageError
from src.sysinfo import cpu_has_bf16, gpu_info, recommend_precision

log = logging.getLogger(__name__)

# Lightning's loop and the callbacks cost about 1.7 ms a batch on an H100 host, against the 1.0-1.4 ms a graphed
# LeNet step takes there, and 2.3 ms on a 2-core CPU, where LeNet's default step went from 9 to 4 % over a plain
# loop (docs/results.md).
STEPS_PER_EXECUTION = 8

# Lightning's full names of the short precision values (`Trainer.precision` reports these).
LIGHTNING_SPELLING = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}

# glibc's mallopt parameters (malloc.h) and the value that turns trimming off.
M_TRIM_THRESHOLD, M_MMAP_MAX, NEVER = -1, -4, -1

StepFunction = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def auto_precision(accelerator: str) -> str:
    gpus = [gpu_info(i) for i in range(torch.cuda.device_count())] if accelerator == "gpu" else []
    return recommend_precision(gpus, cpu_has_bf16())[0]


def resolve_accelerator(requested: str) -> str:
    """`auto` becomes `gpu` when CUDA is there, else `cpu`; `cuda` is Lightning's other name for `gpu`."""
    if requested == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if requested == "cuda" else requested


def resolve_precision(requested: object, accelerator: str) -> str:
    """The precision Lightning will really use, in its own full spelling (`32-true`, `bf16-mixed`), the one name the
    run's folder, config.yaml, result line and HParams give it: `auto` picks by hardware; fp16 autocast exists only on
    CUDA, so CPU gets bf16 (the run says so)."""
    precision = str(requested)
    if precision == "auto":
        precision = auto_precision(accelerator)
    elif accelerator == "cpu" and precision in ("16", "16-mixed"):
        precision = "bf16-mixed"
    return LIGHTNING_SPELLING.get(precision, precision)


def cudnn_benchmark(benchmark: bool | None, deterministic: object) -> bool:
    """`trainer.benchmark`, on by default: Lightning's default leaves cuDNN's autotuning off."""
    return (not deterministic) if benchmark is None else benchmark


def one_channel_nchw_pays(accelerator: str, strategy: object) -> bool:
    """Whether convolutions of one input channel keep NCHW weights under `channels_last`: only under DDP on CUDA.

    There cuDNN handed back such a weight's gradient with NCHW strides, and DDP, which compares a gradient's
    strides with its bucket's, warned and copied it every step (ResNet-18 on an H100; not measured since
    channels_last became the GPU default). On CPU oneDNN returns it in the weight's own strides, and the
    mixed layout costs: an NCHW first convolution hands NCHW activations to the NHWC layers after it, which
    convert them in every forward and backward pass (docs/results.md: on a 2-core AMD EPYC without
    AVX-512, this and `keep_freed_memory` together took LeNet's default step from 78 to 57 ms).
    """
    return accelerator == "gpu" and isinstance(strategy, DDPStrategy)


def speed_up(net: nn.Module, channels_last: bool, compile: bool, one_channel_nchw: bool = False) -> nn.Module:
    """Apply the layout and compilation settings to `net` in place, before any device or wrapper sees it.

    With `one_channel_nchw` (see `one_channel_nchw_pays`), a convolution of one input channel keeps
    NCHW strides: its weight is the same bytes in both layouts.
    """
    if channels_last:
        net.to(memory_format=torch.channels_last)
        for conv in net.modules() if one_channel_nchw else ():
            if isinstance(conv, nn.Conv2d) and conv.in_channels == 1:
                conv.weight.data = conv.weight.data.clone(memory_format=torch.contiguous_format)
    if compile:
        net.compile()
    return net


def keep_freed_memory() -> bool:
    """Keep memory that a CPU step frees in this process, for the next step to reuse; whether the C library took it.

    glibc serves blocks above a threshold (128 KiB, rising to what was last freed) by mapping fresh pages
    and gives them back when they are freed, and trims the top of its heap back to the kernel. A training
    step frees and allocates the same large activations every time, so each step faulted them in again, a
    page at a time: LeNet at batch 256 took 1,000 to 11,000 page faults a step, depending on how the
    threshold had moved, and up to a fifth of its step (a 2-core AMD EPYC, docs/results.md). With no
    mapping per block and no trimming, the process keeps its largest step's memory and faults none.
    Only on Linux with glibc (elsewhere `mallopt` is missing or refuses, and nothing changes).
    """
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
    """How the training steps run: `steps_per_execution` optimizer steps per training batch, graphed or not."""

    steps_per_execution: int = 1
    cuda_graphs: bool = False
    compiled: bool = False  # the network is compiled: its first step is a warm-up, timed and reported

    @property
    def manual(self) -> bool:
        """Whether the module steps its optimizer itself (Lightning's manual optimization)."""
        return self.steps_per_execution > 1 or self.cuda_graphs


def resolve_fast_steps(cuda_graphs: bool | str, steps_per_execution: int | str, *, accelerator: str, world_size: int,
                       strategy: object, compile: bool, trainer_args: dict[str, Any], supported: bool,
                       step_counts: dict[str, int] | None = None) -> FastSteps:
    """The `cuda_graphs` and `steps_per_execution` this run uses; `auto` takes them where they work.

    Both need the module to step its own optimizer, in one process: DDP's reducer expects one
    backward pass per forward call of its wrapper, and `nn.DataParallel` rebuilds its replicas every
    call. Lightning's gradient accumulation and clipping work only when it steps the optimizer.
    CUDA graphs also need a CUDA device. With `compile=true`, only `cuda_graphs=true` captures the
    compiled code in the graph: `auto` leaves graphs off there until that is measured on a GPU
    (docs/results.md). Lightning looks at the step count after each batch, so the counts in
    `step_counts` (a step checkpoint every N steps, `trainer.max_steps`, and the batch counts of
    `trainer.limit_train_batches` and `trainer.val_check_interval`, which stay counts of optimizer
    steps) must be multiples of the steps per batch; `auto` takes the largest that divides them,
    on any device.
    """
    blockers = []
    if world_size > 1 or not (strategy == "auto" or isinstance(strategy, SingleDeviceStrategy)):
        blockers.append("a strategy of one process on one device (strategy=auto)")
    if trainer_args.get("accumulate_grad_batches", 1) != 1:
        blockers.append("trainer.accumulate_grad_batches=1")
    if trainer_args.get("gradient_clip_val") is not None:
        blockers.append("trainer.gradient_clip_val=null")
    if not supported:
        blockers.append("the Classifier and a data module with steps_per_execution (the built-in ones)")
    graph_blockers = [*blockers]
    if accelerator != "gpu":
        graph_blockers.append("a CUDA device")

    graphs = cuda_graphs == "auto" and not graph_blockers and not compile or cuda_graphs is True
    if cuda_graphs is True and graph_blockers:
        raise UsageError(f"cuda_graphs=true needs {', '.join(graph_blockers)}; use cuda_graphs=auto or false")
    counts = {key: n for key, n in (step_counts or {}).items() if n > 0}
    if steps_per_execution == "auto":
        steps = 1 if blockers else math.gcd(STEPS_PER_EXECUTION, *counts.values())
    else:
        steps = int(steps_per_execution)
        if steps > 1 and blockers:
            raise UsageError(f"steps_per_execution={steps} needs {', '.join(blockers)}; use steps_per_execution=auto or 1")
        for key, n in counts.items():
            if n % steps:
                raise UsageError(f"steps_per_execution={steps} does not divide {key}={n}; use a divisor of it, "
                                 "or steps_per_execution=auto")
    return FastSteps(steps_per_execution=steps, cuda_graphs=graphs, compiled=compile)


class GraphedStep:
    """Forward, loss and backward pass of one batch shape, captured once as a CUDA graph, then replayed.

    `step(x, y)` must compute the loss, call `backward()` on it and return (loss, logits). The
    parameters' gradients must be None when the graph is captured: the captured backward pass then
    owns the gradient tensors, and every replay overwrites them (no `zero_grad` between steps).
    A replay writes those tensors whatever `.grad` holds by then, so each replay first hands every
    parameter its captured gradient back: Lightning sets all gradients to None before each
    validation (`LightningModule.on_validation_model_zero_grad`), and the optimizer skips a
    parameter whose `.grad` is None. Autocast, if on, is kept with its weight cache off, as graph
    capture requires. The first replays need warm steps run eagerly before the capture (cuDNN's
    autotuning, lazily built optimizer state).
    """

    def __init__(self, step: StepFunction, x: torch.Tensor, y: torch.Tensor, parameters: list[nn.Parameter]) -> None:
        self.x, self.y = x.clone(), y.clone()
        device = x.device.type
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.get_autocast_dtype(device), enabled=torch.is_autocast_enabled(device),
                            cache_enabled=False):
            loss, logits = self._capture(step)
        self.capture_s = time.perf_counter() - start
        # Detached, the capture's autograd graph goes: an eager step after it (an uneven last batch) would
        # otherwise accumulate through its nodes, which live on the capture's stream (torch warns, and syncs).
        self.loss, self.logits = loss.detach(), logits.detach()
        self.grads = [(param, param.grad) for param in parameters if param.grad is not None]

    def _capture(self, step: StepFunction) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA part, with `_replay`: apart, so that a test can play the graph on CPU."""
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
        for param, grad in self.grads:
            if param.grad is not grad:
                param.grad = grad
        self._replay()
        return self.loss, self.logits


def apply_fast_steps(cfg: DictConfig, trainer_args: dict[str, Any], module: nn.Module, datamodule: object, *,
                     accelerator: str, world_size: int, strategy: object, step_batch: int) -> FastSteps:
    """Resolve `cuda_graphs` and `steps_per_execution` for this run and set the module, the data and the
    Trainer's batch counts (`trainer_args`, in place) up for them."""
    batch_counts = {f"trainer.{key}": value for key in ("limit_train_batches", "val_check_interval")
                    if type(value := trainer_args.get(key)) is int}
    fast_steps = resolve_fast_steps(
        cfg.cuda_graphs, cfg.steps_per_execution, accelerator=accelerator, world_size=world_size, strategy=strategy,
        compile=cfg.compile, trainer_args=trainer_args,
        step_counts={"checkpoint.every_n_train_steps": cfg.checkpoint.every_n_train_steps,
                     "trainer.max_steps": trainer_args["max_steps"], **batch_counts},
        supported=hasattr(module, "use_fast_steps") and hasattr(datamodule, "steps_per_execution"),
    )
    for key in batch_counts:  # counted in optimizer steps: Lightning counts batches of steps_per_execution steps
        trainer_args[key.removeprefix("trainer.")] //= fast_steps.steps_per_execution
    if hasattr(module, "use_fast_steps"):
        module.use_fast_steps(fast_steps, step_batch)
    if fast_steps.manual:
        datamodule.steps_per_execution = fast_steps.steps_per_execution  # type: ignore[attr-defined]
    return fast_steps

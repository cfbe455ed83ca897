"""Training speed side by side: the book's pipeline, plain loops, and the framework old and new.

On whatever device is present (the first CUDA GPU, else the CPU), the same network trains on the
same Fashion-MNIST images for the same number of optimizer steps at the same batch size:

- book:                torchvision's FashionMNIST with ToTensor, a DataLoader with 4 workers, a plain
                       loop that moves each batch to the device; fp32 (Dive into Deep Learning's pipeline)
- plain fp32:          a plain loop on in-memory uint8 tensors, normalised on the device; fp32
- plain fast:          the same loop with the fast path's precision and layout for this device (every
                       convolution in channels_last, as a one-process run has it)
- plain reduce-overhead: the same, the network under `torch.compile(mode="reduce-overhead")` (CUDA
                       graphs on a GPU): the best a user writes by hand
- framework fp32 (old default): `python -m src.train precision=32 channels_last=false cuda_graphs=false
                       steps_per_execution=1`, the default before the fast path
- framework default:   `python -m src.train` with today's defaults (eager steps: `cuda_graphs=false`)
- framework cuda_graphs=auto: the defaults with each step a CUDA graph replay on a GPU (on CPU: the default)
- framework one step a batch: the defaults with `steps_per_execution=1`, so that Lightning's loop
                       runs once per optimizer step (the default on CPU before 2026-11-25)
- framework compile=true: the defaults with `compile=true` (no CUDA graphs then)
- ... cuda_graphs=true: the compiled network's kernels captured in the framework's CUDA graph (on CPU: no graphs)
- ... Lightning only:  the default without the project's callbacks, to tell what Lightning costs per
                       step from what the project adds (`--model tiny` makes that cost most of the step)
- framework ddp:       `strategy=ddp devices=1`: one DDP process (NCCL on a GPU), the fast path's precision and
                       layout, one step a batch (DDP takes no CUDA graphs); `... without comm callback` leaves
                       out the callback that logs `xfer/*`, to tell what it costs a step

Each round runs one epoch of each, in turn, so that all see the same machine load; the first round
warms up (compilation, CUDA graph capture) and is not counted. The framework's epochs are timed by
its own EpochTimer, with the project's callbacks on and validation off. `--ablation` adds plain-loop
rows for each setting alone and for the first convolution left in NCHW (what DDP on CUDA gets), and
framework rows for each precision with and without channels_last.
The FLOP share divides the network's FLOPs per second (counted by torch.utils.flop_counter) by the
peak this device reaches on a large matrix product in the same dtype, measured here. CPU ms/step is
the process's CPU time (every thread) per step, and faults/step its minor page faults per step (memory
the C library had given back to the kernel and the step touched again), both over the same span as
the wall time. On a shared machine, `--threads 1` makes CPU time a measure of the work done that other
processes' load hardly changes (with more threads it counts their waits for each other too).

On CPU every contender runs with freed memory kept in the process, as `python -m src.train` keeps
it there (`src.fast_path.keep_freed_memory`); it is a setting of the whole process, so the plain
loops get it too. `--allocator glibc` leaves the C library's defaults, to measure what it is worth.

    python benchmarks/speed.py --data-root ../shared/data --steps 64 --rounds 4
    python benchmarks/speed.py --data-root ../shared/data --model resnet18 --steps 64 --ablation
    python benchmarks/speed.py --data-root ../shared/data --steps 32 --rounds 5 --threads 1 --allocator glibc
"""

import argparse
import functools
import logging
import math
import resource
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from torchvision.datasets import FashionMNIST
from torchvision.transforms import ToTensor

from src.callbacks.comm import CommLogger
from src.callbacks.timing import EpochTimer
from src.data.fashion_mnist import MEAN, STD, FashionMNISTDataModule
from src.fast_path import (TORCH_FP32_MATH, FastSteps, auto_precision, float32_math, keep_freed_memory,
                           one_channel_nchw_pays, resolve_fast_steps, resolve_precision, speed_up)
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.models.resnet import resnet18
from src.strategies.ddp import CommHookDDPStrategy

CONF = str(Path(__file__).resolve().parent.parent / "conf")


def tiny() -> nn.Module:
    """A network with almost no compute: its step time is what the loop around it costs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


NETS: dict[str, Callable[[], nn.Module]] = {"lenet": LeNet, "resnet18": resnet18, "tiny": tiny}


@dataclass(frozen=True)
class Settings:
    precision: str  # "32" or a mixed precision: autocast in bf16 or fp16
    channels_last: bool
    compile: bool = False
    compile_mode: str | None = None  # the plain loop's torch.compile mode ("reduce-overhead": CUDA graphs)
    cuda_graphs: bool | str = False  # the framework's `cuda_graphs` and `steps_per_execution`
    steps_per_execution: int | str = 1
    ddp: bool = False  # the framework under `strategy=ddp` (one process)
    comm_logged: bool = True  # with the callback that logs xfer/* (src.callbacks.comm.CommLogger)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)


@dataclass(frozen=True)
class Usage:
    """What one epoch took: wall time, this process's CPU time (every thread) and its minor page faults."""

    seconds: float
    cpu_s: float = 0.0
    faults: int = 0

    @staticmethod
    def now() -> "Usage":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return Usage(0.0, usage.ru_utime + usage.ru_stime, usage.ru_minflt)

    def since(self, start: "Usage", seconds: float) -> "Usage":
        return Usage(seconds, self.cpu_s - start.cpu_s, self.faults - start.faults)


class EpochUsage(Callback):
    """CPU time and page faults of each training epoch, counted where EpochTimer starts and stops its clock."""

    def __init__(self) -> None:
        self.epochs: list[tuple[Usage, Usage]] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Classifier) -> None:
        self._start = Usage.now()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Classifier) -> None:
        self.epochs.append((self._start, Usage.now()))


def counted(epoch: Callable[[], float]) -> Callable[[], Usage]:
    """An epoch of a plain loop, with its CPU time and page faults."""
    def run() -> Usage:
        start = Usage.now()
        seconds = epoch()
        return Usage.now().since(start, seconds)
    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_float32_math() -> None:
    """The plain loops compute float32 as torch does by default (TF32 convolutions on CUDA): what a user's loop does."""
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = TORCH_FP32_MATH


def plain_epoch(net: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                settings: Settings, batch_size: int, steps: int, generator: torch.Generator) -> float:
    """The book's training loop on tensors already on the device: shuffle, gather, normalise, step, count hits."""
    device = images.device
    torch_float32_math()
    order = torch.randperm(len(labels), generator=generator).to(device)
    dtype = settings.autocast_dtype
    hits = torch.zeros((), device=device, dtype=torch.long)
    sync(device)
    start = time.perf_counter()
    for step in range(steps):
        index = order[step * batch_size : (step + 1) * batch_size]
        x, y = images[index].float().div_(255).sub_(MEAN).div_(STD), labels[index]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = net(x)
            loss = nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        hits += (logits.argmax(1) == y).sum()
    sync(device)
    return time.perf_counter() - start


def book_epoch(net: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, steps: int, device: torch.device) -> float:
    """Dive into Deep Learning's `train_ch6` loop: batches from the DataLoader's workers, moved to the device."""
    torch_float32_math()
    sync(device)
    start = time.perf_counter()
    correct = 0.0
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        x, y = x.to(device), y.to(device)
        logits = net(x)
        loss = nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        correct += float((logits.argmax(1) == y).sum())  # the book's accuracy, read back every step
    sync(device)
    return time.perf_counter() - start


def project_callbacks(tmp: str) -> list:
    """The callbacks a `python -m src.train` run uses, checkpoints excluded (they write files outside the epoch)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp}"])
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    return [c for c in callbacks if not isinstance(c, ModelCheckpoint)]


def framework(datamodule: FashionMNISTDataModule, model: str, settings: Settings, steps: int, accelerator: str,
              lr: float, lightning_only: bool = False) -> Callable[[], Usage]:
    """Epochs of `steps` steps through Trainer, Classifier and the data module, timed by EpochTimer; with
    `lightning_only`, without the project's other callbacks. The module lives on from round to round,
    as the plain loop's network does, so that both train the same weights as far (and its CUDA graph,
    captured in the first round, serves the others)."""
    strategy = CommHookDDPStrategy() if settings.ddp else "auto"
    net = speed_up(NETS[model](), settings.channels_last, settings.compile, one_channel_nchw_pays(accelerator, strategy))
    module = Classifier(net, functools.partial(torch.optim.SGD, lr=lr))
    fast = resolve_fast_steps(settings.cuda_graphs, settings.steps_per_execution, accelerator=accelerator, world_size=1,
                              strategy=strategy, compile=settings.compile, trainer_args={}, supported=True)
    if steps % fast.steps_per_execution:
        raise SystemExit(f"--steps {steps} must be a multiple of {fast.steps_per_execution} (steps_per_execution)")
    if fast.manual:
        module.use_fast_steps(fast, datamodule.batch_size)
    return lambda: framework_epoch(datamodule, module, settings, steps, accelerator, lightning_only, fast)


def framework_epoch(datamodule: FashionMNISTDataModule, module: Classifier, settings: Settings, steps: int,
                    accelerator: str, lightning_only: bool, fast: FastSteps) -> Usage:
    datamodule.steps_per_execution = fast.steps_per_execution  # the data module serves every contender in turn
    float32_math(resolve_precision(settings.precision, accelerator), accelerator)  # as a run sets it
    with tempfile.TemporaryDirectory() as tmp:
        usage = EpochUsage()
        callbacks = [EpochTimer(), usage] if lightning_only else [*project_callbacks(tmp), usage]
        callbacks = [c for c in callbacks if settings.comm_logged or not isinstance(c, CommLogger)]
        trainer = Trainer(
            accelerator=accelerator, devices=1, max_epochs=1, precision=settings.precision,
            strategy=CommHookDDPStrategy() if settings.ddp else "auto",  # a fit's own: a strategy serves one Trainer
            limit_train_batches=steps // fast.steps_per_execution, limit_val_batches=0, num_sanity_val_steps=0, benchmark=True,
            logger=TensorBoardLogger(tmp, name="", version=""), callbacks=callbacks, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )
        trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == steps, (trainer.global_step, steps)
    start, end = usage.epochs[0]
    return end.since(start, next(c for c in callbacks if isinstance(c, EpochTimer)).epoch_times[0])


def flops_per_step(model: str, batch_size: int, device: torch.device) -> int:
    """Forward and backward FLOPs of one batch, as torch's FLOP counter counts convolutions and matmuls."""
    net = NETS[model]().to(device)
    x = torch.randn(batch_size, 1, 28, 28, device=device)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(net(x), torch.zeros(batch_size, dtype=torch.long, device=device)).backward()
    return counter.get_total_flops()


def matmul_peak(device: torch.device, dtype: torch.dtype, tf32: bool) -> float:
    """FLOP/s of a large square matrix product: what this device really reaches in `dtype`.

    With `tf32` (cuDNN convolves float32 in TF32, its default on CUDA), float32 is timed in TF32: against
    the true float32 peak, an fp32 convolutional network on an H100 came to 183 % of it.
    """
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    was = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        a @ b
        sync(device)
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.0:
            a @ b
            repeats += 1
            sync(device)
    finally:
        torch.backends.cuda.matmul.fp32_precision = was
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--model", choices=sorted(NETS), default="lenet")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="optimizer steps per epoch, a multiple of 8 (a full epoch has 215)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one epoch each; the first warms up")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--ablation", action="store_true", help="also time each fast-path setting alone, and each precision")
    parser.add_argument("--only", default="", help="comma-separated names of contenders to run (default: all)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's CPU threads (default: torch's choice); 1 makes CPU time a measure of work, robust to load")
    parser.add_argument("--allocator", choices=("kept", "glibc"), default="kept",
                        help="on CPU: keep freed memory in the process as src.train does (kept), or glibc's defaults")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the first round warms up and is not counted")
    if args.threads < 0:
        parser.error("--threads must be 0 (torch's choice) or a positive number of threads")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    kept = accelerator == "cpu" and args.allocator == "kept" and keep_freed_memory()
    seed_everything(0, verbose=False)
    datamodule = FashionMNISTDataModule(root=args.data_root, batch_size=args.batch_size, download=False)
    datamodule.setup()
    split = datamodule.splits["train"]
    if args.steps * args.batch_size > len(split):
        parser.error(f"--steps {args.steps} x --batch-size {args.batch_size} exceeds the {len(split)} training images")
    images, labels = split.images.to(device), split.labels.to(device)
    full_epoch_steps = math.ceil(len(split) / args.batch_size)

    fp32 = Settings("32", channels_last=False)
    fast = Settings(auto_precision(accelerator), channels_last=True)
    default = Settings(fast.precision, fast.channels_last, cuda_graphs=False, steps_per_execution="auto")
    graphed = Settings(fast.precision, fast.channels_last, cuda_graphs="auto", steps_per_execution="auto")
    one_step = Settings(fast.precision, fast.channels_last, cuda_graphs=False, steps_per_execution=1)
    book_data = FashionMNIST(args.data_root, train=True, transform=ToTensor(), download=False)
    book_loader = DataLoader(book_data, args.batch_size, shuffle=True, num_workers=4, persistent_workers=True)

    def plain(settings: Settings, one_channel_nchw: bool = False) -> Callable[[], Usage]:
        net = speed_up(NETS[args.model]().to(device), settings.channels_last, compile=False, one_channel_nchw=one_channel_nchw)
        if settings.compile:
            net.compile(mode=settings.compile_mode)
        optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
        generator = torch.Generator().manual_seed(0)
        return counted(lambda: plain_epoch(net, optimizer, images, labels, settings, args.batch_size, args.steps, generator))

    def run_framework(settings: Settings, lightning_only: bool = False) -> Callable[[], Usage]:
        return framework(datamodule, args.model, settings, args.steps, accelerator, args.lr, lightning_only)

    book_net = NETS[args.model]().to(device)
    book_optimizer = torch.optim.SGD(book_net.parameters(), lr=args.lr)
    reduce_overhead = Settings(fast.precision, fast.channels_last, compile=True, compile_mode="reduce-overhead")
    compiled = Settings(fast.precision, fast.channels_last, compile=True, cuda_graphs="auto", steps_per_execution="auto")
    ddp = Settings(fast.precision, fast.channels_last, ddp=True)
    ddp_unlogged = Settings(fast.precision, fast.channels_last, ddp=True, comm_logged=False)
    compiled_graphs = Settings(fast.precision, fast.channels_last, compile=True, cuda_graphs=device.type == "cuda",
                               steps_per_execution="auto")
    makers: dict[str, tuple[Settings, Callable[[], Callable[[], Usage]]]] = {
        "book (torchvision + 4 workers)": (fp32, lambda: counted(lambda: book_epoch(book_net, book_optimizer, book_loader, args.steps, device))),
        "plain fp32": (fp32, lambda: plain(fp32)),
        "plain fast": (fast, lambda: plain(fast)),
        "plain reduce-overhead": (reduce_overhead, lambda: plain(reduce_overhead)),
        "framework fp32 (old default)": (fp32, lambda: run_framework(fp32)),
        "framework default": (default, lambda: run_framework(default)),
        "framework cuda_graphs=auto": (graphed, lambda: run_framework(graphed)),
        "framework one step a batch": (one_step, lambda: run_framework(one_step)),
        "framework compile=true": (compiled, lambda: run_framework(compiled)),
        "framework compile=true cuda_graphs=true": (compiled_graphs, lambda: run_framework(compiled_graphs)),
        "framework default (Lightning only)": (default, lambda: run_framework(default, lightning_only=True)),
        "framework ddp": (ddp, lambda: run_framework(ddp)),
        "framework ddp without comm callback": (ddp_unlogged, lambda: run_framework(ddp_unlogged)),
    }
    if args.ablation:
        for name, settings in {
            "plain channels_last only": Settings("32", channels_last=True),
            f"plain {fast.precision} only": Settings(fast.precision, channels_last=False),
        }.items():
            makers[name] = (settings, functools.partial(plain, settings))
        makers["plain fast with one-channel conv NCHW"] = (fast, functools.partial(plain, fast, one_channel_nchw=True))
        for precision in ("32", "16-mixed", "bf16-mixed") if device.type == "cuda" else ("32", "bf16-mixed"):
            for layout in (False, True):
                settings = Settings(precision, layout, cuda_graphs="auto", steps_per_execution="auto")
                makers[f"framework {precision}{' channels_last' if layout else ''}"] = (settings, functools.partial(run_framework, settings))
            settings = Settings(precision, True, compile=True, cuda_graphs="auto", steps_per_execution="auto")
            makers[f"framework {precision} channels_last compile"] = (settings, functools.partial(run_framework, settings))
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in makers]
    if unknown:
        parser.error(f"--only: unknown contender(s) {unknown}; choose from {list(makers)}")
    contenders = {name: (settings, make()) for name, (settings, make) in makers.items() if not wanted or name in wanted}

    usages: dict[str, list[Usage]] = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        for name, (_, epoch) in contenders.items():
            usage = epoch()
            if round_ > 0:
                usages[name].append(usage)
    times = {name: [u.seconds for u in used] for name, used in usages.items()}
    cpu_per_step = {name: statistics.median(u.cpu_s for u in used) / args.steps for name, used in usages.items()}

    flops = flops_per_step(args.model, args.batch_size, device)
    tf32 = device.type == "cuda" and TORCH_FP32_MATH[0] == "tf32"  # the plain loops' convolutions
    peaks = {dtype: matmul_peak(device, dtype, tf32)
             for dtype in {torch.float32, *(s.autocast_dtype or torch.float32 for s, _ in contenders.values())}}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; torch {torch.__version__}; {args.model}, batch {args.batch_size}, {args.steps} steps per round, "
          f"{args.rounds - 1} timed rounds; s/epoch scaled to a full epoch of {full_epoch_steps} steps")
    if device.type == "cpu":
        print("freed memory kept in the process, as src.train keeps it" if kept else
              f"the C library's own allocator settings (--allocator {args.allocator})")
    print(f"FLOPs per step (forward + backward): {flops / 1e9:.2f} G; matmul peak here: "
          + ", ".join(f"{str(d).removeprefix('torch.')}{' (TF32)' if d == torch.float32 and tf32 else ''} {p / 1e12:.2f} TFLOP/s"
                      for d, p in peaks.items()))
    per_step = {name: statistics.median(t) / args.steps for name, t in times.items()}
    book = per_step.get("book (torchvision + 4 workers)", float("nan"))
    old = per_step.get("framework fp32 (old default)", float("nan"))
    print(f"{'':40} {'ms/step':>8} {'s/epoch':>8} {'images/s':>9} {'x book':>7} {'x old default':>13} {'share of peak':>13} "
          f"{'CPU ms/step':>11} {'faults/step':>11}  rounds (s)")
    for name, step_s in per_step.items():
        settings = contenders[name][0]
        peak = peaks[settings.autocast_dtype or torch.float32]
        print(f"{name:40} {step_s * 1000:8.3f} {step_s * full_epoch_steps:8.2f} {args.batch_size / step_s:9.0f} {book / step_s:7.2f} "
              f"{old / step_s:13.2f} {flops / step_s / peak:12.1%} {cpu_per_step[name] * 1000:11.2f} {statistics.median(u.faults for u in usages[name]) / args.steps:11.0f}  "
              f"{', '.join(f'{t:.2f}' for t in times[name])}")
    best_plain = min((n for n in per_step if n.startswith("plain")), key=per_step.get, default=None)
    if "framework default" in per_step and best_plain is not None:
        fast_s = per_step["framework default"]
        # Each round's contenders ran back to back: the median of per-round ratios resists a load spike
        # that hits one round better than the ratio of medians does.
        paired = statistics.median(f / p for f, p in zip(times["framework default"], times[best_plain]))
        print(f"framework default vs old default: {old / fast_s:.2f}x faster; vs the book's pipeline: {book / fast_s:.2f}x "
              f"faster; vs the best plain loop ({best_plain}): {100 * (fast_s / per_step[best_plain] - 1):+.1f}% time "
              f"(median of paired rounds: {100 * (paired - 1):+.1f}%; CPU time: "
              f"{100 * (cpu_per_step['framework default'] / cpu_per_step[best_plain] - 1):+.1f}%)")
    if "framework default (Lightning only)" in per_step and "framework default" in per_step:
        lightning_s = per_step["framework default (Lightning only)"]
        print(f"per step: the project's callbacks add {1e6 * (per_step['framework default'] - lightning_s):+.0f} us "
              "to Lightning's loop")


if __name__ == "__main__":
    main()

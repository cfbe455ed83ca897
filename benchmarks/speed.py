"""Training speed side by side: the book's pipeline, plain loops, and the framework old and new.

On whatever device is present (the first CUDA GPU, else the CPU), the same network trains on the
same Fashion-MNIST images for the same number of optimizer steps at the same batch size:

- book:                torchvision's FashionMNIST with ToTensor, a DataLoader with 4 workers, a plain
                       loop that moves each batch to the device; fp32 (Dive into Deep Learning's pipeline)
- plain fp32:          a plain loop on in-memory uint8 tensors, normalised on the device; fp32
- plain fast:          the same loop with the fast path's precision and layout for this device
- plain reduce-overhead: the same, the network under `torch.compile(mode="reduce-overhead")` (CUDA
                       graphs on a GPU): the best a user writes by hand
- framework fp32 (old default): `python -m src.train precision=32 channels_last=false cuda_graphs=false
                       steps_per_execution=1`, the default before the fast path
- framework default:   `python -m src.train` with today's defaults (every `auto`)
- framework compile=true: the defaults with `compile=true` (no CUDA graphs then)
- ... Lightning only:  the default without the project's callbacks, to tell what Lightning costs per
                       step from what the project adds (`--model tiny` makes that cost most of the step)

Each round runs one epoch of each, in turn, so that all see the same machine load; the first round
warms up (compilation, CUDA graph capture) and is not counted. The framework's epochs are timed by
its own EpochTimer, with the project's callbacks on and validation off. `--ablation` adds plain-loop
rows for each setting alone, and framework rows for each precision with and without channels_last.
The FLOP share divides the network's FLOPs per second (counted by torch.utils.flop_counter) by the
peak this device reaches on a large matrix product in the same dtype, measured here.

    python benchmarks/speed.py --data-root ../shared/data --steps 64 --rounds 4
    python benchmarks/speed.py --data-root ../shared/data --model resnet18 --steps 64 --ablation
"""

import argparse
import functools
import logging
import math
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
from lightning import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from torchvision.datasets import FashionMNIST
from torchvision.transforms import ToTensor

from src.callbacks.timing import EpochTimer
from src.data.fashion_mnist import MEAN, STD, FashionMNISTDataModule
from src.fast_path import FastSteps, auto_precision, resolve_fast_steps, speed_up
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.models.resnet import resnet18

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

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_epoch(net: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                settings: Settings, batch_size: int, steps: int, generator: torch.Generator) -> float:
    """The book's training loop on tensors already on the device: shuffle, gather, normalise, step, count hits."""
    device = images.device
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
              lr: float, lightning_only: bool = False) -> Callable[[], float]:
    """Epochs of `steps` steps through Trainer, Classifier and the data module, timed by EpochTimer; with
    `lightning_only`, without the project's other callbacks. The module lives on from round to round,
    as the plain loop's network does, so that both train the same weights as far (and its CUDA graph,
    captured in the first round, serves the others)."""
    module = Classifier(speed_up(NETS[model](), settings.channels_last, settings.compile),
                        functools.partial(torch.optim.SGD, lr=lr))
    fast = resolve_fast_steps(settings.cuda_graphs, settings.steps_per_execution, accelerator=accelerator, world_size=1,
                              strategy="auto", compile=settings.compile, trainer_args={}, supported=True)
    if steps % fast.steps_per_execution:
        raise SystemExit(f"--steps {steps} must be a multiple of {fast.steps_per_execution} (steps_per_execution)")
    if fast.manual:
        module.use_fast_steps(fast, datamodule.batch_size)
    return lambda: framework_epoch(datamodule, module, settings, steps, accelerator, lightning_only, fast)


def framework_epoch(datamodule: FashionMNISTDataModule, module: Classifier, settings: Settings, steps: int,
                    accelerator: str, lightning_only: bool, fast: FastSteps) -> float:
    datamodule.steps_per_execution = fast.steps_per_execution  # the data module serves every contender in turn
    with tempfile.TemporaryDirectory() as tmp:
        callbacks = [EpochTimer()] if lightning_only else project_callbacks(tmp)
        trainer = Trainer(
            accelerator=accelerator, devices=1, max_epochs=1, precision=settings.precision,
            limit_train_batches=steps // fast.steps_per_execution, limit_val_batches=0, num_sanity_val_steps=0, benchmark=True,
            logger=TensorBoardLogger(tmp, name="", version=""), callbacks=callbacks, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )
        trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == steps, (trainer.global_step, steps)
    return next(c for c in callbacks if isinstance(c, EpochTimer)).epoch_times[0]


def flops_per_step(model: str, batch_size: int, device: torch.device) -> int:
    """Forward and backward FLOPs of one batch, as torch's FLOP counter counts convolutions and matmuls."""
    net = NETS[model]().to(device)
    x = torch.randn(batch_size, 1, 28, 28, device=device)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(net(x), torch.zeros(batch_size, dtype=torch.long, device=device)).backward()
    return counter.get_total_flops()


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matrix product: what this device really reaches in `dtype`."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    repeats, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a @ b
        repeats += 1
        sync(device)
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
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the first round warms up and is not counted")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    accelerator = "gpu" if device.type == "cuda" else "cpu"
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
    default = Settings(fast.precision, fast.channels_last, cuda_graphs="auto", steps_per_execution="auto")
    book_data = FashionMNIST(args.data_root, train=True, transform=ToTensor(), download=False)
    book_loader = DataLoader(book_data, args.batch_size, shuffle=True, num_workers=4, persistent_workers=True)

    def plain(settings: Settings) -> Callable[[], float]:
        net = speed_up(NETS[args.model]().to(device), settings.channels_last, compile=False)
        if settings.compile:
            net.compile(mode=settings.compile_mode)
        optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
        generator = torch.Generator().manual_seed(0)
        return lambda: plain_epoch(net, optimizer, images, labels, settings, args.batch_size, args.steps, generator)

    def run_framework(settings: Settings, lightning_only: bool = False) -> Callable[[], float]:
        return framework(datamodule, args.model, settings, args.steps, accelerator, args.lr, lightning_only)

    book_net = NETS[args.model]().to(device)
    book_optimizer = torch.optim.SGD(book_net.parameters(), lr=args.lr)
    reduce_overhead = Settings(fast.precision, fast.channels_last, compile=True, compile_mode="reduce-overhead")
    compiled = Settings(fast.precision, fast.channels_last, compile=True, cuda_graphs="auto", steps_per_execution="auto")
    makers: dict[str, tuple[Settings, Callable[[], Callable[[], float]]]] = {
        "book (torchvision + 4 workers)": (fp32, lambda: lambda: book_epoch(book_net, book_optimizer, book_loader, args.steps, device)),
        "plain fp32": (fp32, lambda: plain(fp32)),
        "plain fast": (fast, lambda: plain(fast)),
        "plain reduce-overhead": (reduce_overhead, lambda: plain(reduce_overhead)),
        "framework fp32 (old default)": (fp32, lambda: run_framework(fp32)),
        "framework default": (default, lambda: run_framework(default)),
        "framework compile=true": (compiled, lambda: run_framework(compiled)),
        "framework default (Lightning only)": (default, lambda: run_framework(default, lightning_only=True)),
    }
    if args.ablation:
        for name, settings in {
            "plain channels_last only": Settings("32", channels_last=True),
            f"plain {fast.precision} only": Settings(fast.precision, channels_last=False),
        }.items():
            makers[name] = (settings, functools.partial(plain, settings))
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

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        for name, (_, epoch) in contenders.items():
            seconds = epoch()
            if round_ > 0:
                times[name].append(seconds)

    flops = flops_per_step(args.model, args.batch_size, device)
    peaks = {dtype: matmul_peak(device, dtype) for dtype in {torch.float32, *(s.autocast_dtype or torch.float32 for s, _ in contenders.values())}}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; torch {torch.__version__}; {args.model}, batch {args.batch_size}, {args.steps} steps per round, "
          f"{args.rounds - 1} timed rounds; s/epoch scaled to a full epoch of {full_epoch_steps} steps")
    print(f"FLOPs per step (forward + backward): {flops / 1e9:.2f} G; matmul peak here: "
          + ", ".join(f"{str(d).removeprefix('torch.')} {p / 1e12:.2f} TFLOP/s" for d, p in peaks.items()))
    per_step = {name: statistics.median(t) / args.steps for name, t in times.items()}
    book = per_step.get("book (torchvision + 4 workers)", float("nan"))
    old = per_step.get("framework fp32 (old default)", float("nan"))
    print(f"{'':40} {'ms/step':>8} {'s/epoch':>8} {'images/s':>9} {'x book':>7} {'x old default':>13} {'share of peak':>13}  rounds (s)")
    for name, step_s in per_step.items():
        settings = contenders[name][0]
        peak = peaks[settings.autocast_dtype or torch.float32]
        print(f"{name:40} {step_s * 1000:8.3f} {step_s * full_epoch_steps:8.2f} {args.batch_size / step_s:9.0f} {book / step_s:7.2f} "
              f"{old / step_s:13.2f} {flops / step_s / peak:12.1%}  {', '.join(f'{t:.2f}' for t in times[name])}")
    best_plain = min((n for n in per_step if n.startswith("plain")), key=per_step.get, default=None)
    if "framework default" in per_step and best_plain is not None:
        fast_s = per_step["framework default"]
        # Each round's contenders ran back to back: the median of per-round ratios resists a load spike
        # that hits one round better than the ratio of medians does.
        paired = statistics.median(f / p for f, p in zip(times["framework default"], times[best_plain]))
        print(f"framework default vs old default: {old / fast_s:.2f}x faster; vs the book's pipeline: {book / fast_s:.2f}x "
              f"faster; vs the best plain loop ({best_plain}): {100 * (fast_s / per_step[best_plain] - 1):+.1f}% time "
              f"(median of paired rounds: {100 * (paired - 1):+.1f}%)")
    if "framework default (Lightning only)" in per_step and "framework default" in per_step:
        lightning_s = per_step["framework default (Lightning only)"]
        print(f"per step: the project's callbacks add {1e6 * (per_step['framework default'] - lightning_s):+.0f} us "
              "to Lightning's loop")


if __name__ == "__main__":
    main()

"""Epoch time of LeNet through the framework against a plain PyTorch loop, side by side.

Both train the same network on the same in-memory Fashion-MNIST tensors, for the same
number of steps at the same batch size, on this machine's CPU. They alternate, epoch by
epoch (the plain epoch runs just before each framework epoch, outside its timing), so that
both see the same machine load; the median epoch times are compared.

    python benchmarks/overhead.py --data-root ../shared/data --steps 200 --rounds 5
"""

import argparse
import functools
import statistics
import tempfile
import time
import warnings

import torch
from lightning import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from src.callbacks.timing import EpochTimer
from src.data.fashion_mnist import MEAN, STD, FashionMNISTDataModule
from src.models.lenet import LeNet
from src.models.module import Classifier


def plain_epoch(net: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                batch_size: int, steps: int, generator: torch.Generator) -> float:
    """The book's training loop: shuffle, slice a batch, normalise, forward, backward, step, count hits."""
    loss_fn = nn.CrossEntropyLoss()
    order = torch.randperm(len(labels), generator=generator)
    hits = 0
    start = time.perf_counter()
    for step in range(steps):
        index = order[step * batch_size : (step + 1) * batch_size]
        x = images[index].float().div_(255).sub_(MEAN).div_(STD)
        y = labels[index]
        logits = net(x)
        loss = loss_fn(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        hits += (logits.argmax(1) == y).sum().item()
    return time.perf_counter() - start


class PlainLoop(Callback):
    """Runs one plain epoch before each framework epoch starts, outside the framework's timing."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, steps: int) -> None:
        self.data, self.batch_size, self.steps = (images, labels), batch_size, steps
        self.net = LeNet()
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.2)
        self.generator = torch.Generator().manual_seed(0)
        self.epoch_times: list[float] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epoch_times.append(plain_epoch(self.net, self.optimizer, *self.data, self.batch_size, self.steps, self.generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per epoch")
    parser.add_argument("--rounds", type=int, default=5, help="epochs of each, alternating")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    seed_everything(0, verbose=False)
    datamodule = FashionMNISTDataModule(root=args.data_root, batch_size=args.batch_size, download=False)
    datamodule.setup()
    train_split = datamodule.splits["train"]
    if args.steps * args.batch_size > len(train_split):
        parser.error(f"--steps {args.steps} x --batch-size {args.batch_size} exceeds the {len(train_split)} training images")

    plain = PlainLoop(train_split.images, train_split.labels, args.batch_size, args.steps)
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as logdir:
        trainer = Trainer(
            accelerator="cpu", devices=1, max_epochs=args.rounds, limit_train_batches=args.steps,
            limit_val_batches=0, num_sanity_val_steps=0, logger=TensorBoardLogger(logdir, name="", version=""),
            callbacks=[plain, timer], enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False,
        )
        trainer.fit(Classifier(LeNet(), optimizer=functools.partial(torch.optim.SGD, lr=0.2)), datamodule=datamodule)
    plain_times, framework_times = plain.epoch_times, timer.epoch_times

    plain_s, framework_s = statistics.median(plain_times), statistics.median(framework_times)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, LeNet, batch {args.batch_size}, "
          f"{args.steps} steps per epoch, {args.rounds} alternating epochs each")
    print(f"plain loop  median {plain_s:.3f} s/epoch  ({', '.join(f'{t:.2f}' for t in plain_times)})")
    print(f"framework   median {framework_s:.3f} s/epoch  ({', '.join(f'{t:.2f}' for t in framework_times)})")
    # Each framework epoch ran right after its plain epoch: the median of those paired ratios
    # resists a load spike that hits one round better than the ratio of medians does.
    paired = statistics.median(f / p for f, p in zip(framework_times, plain_times))
    print(f"framework / plain = {framework_s / plain_s:.3f} (ratio of medians), {paired:.3f} (median of paired rounds)")
    print(f"overhead {100 * (paired - 1):+.1f}%")


if __name__ == "__main__":
    main()

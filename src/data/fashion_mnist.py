"""Fashion-MNIST held on the training device as uint8 tensors, sharded per process, batched by gathering there."""

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule
from torch import nn
from torch.utils.data import Dataset, DistributedSampler
from torchvision.datasets import FashionMNIST
from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

from src import folders
from src.config import per_process_batch  # the check before torch loads, again here
from src.errors import UsageError

# Mean and standard deviation of the official training images' pixels (in [0, 1]).
MEAN, STD = 0.2860, 0.3530
RAW_FILES = [os.path.splitext(os.path.basename(url))[0] for url, _ in FashionMNIST.resources]
IMAGE_SIZE = 28  # pixels a side


class TensorImages(Dataset):
    """Images and labels of one split as two tensors (uint8 images, N x 1 x 28 x 28)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images.unsqueeze(1) if images.dim() == 3 else images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class DeviceLoader:
    """One process's shard in `sampler`'s order, a gather on the split's device a batch of `steps_per_batch` steps.
    Its checkpointed position counts global one-step batches: a mid-epoch resume on any world size sees the same."""

    batch_sampler = None  # Lightning looks for one beside `sampler`, as on a DataLoader

    def __init__(self, split: TensorImages, sampler: Sequence[int] | DistributedSampler, batch_size: int,
                 device: torch.device, steps_per_batch: int = 1) -> None:
        self.images, self.labels = split.images.to(device), split.labels.to(device)
        self.sampler, self.batch_size, self.device = sampler, batch_size, device
        self.steps_per_batch = steps_per_batch
        self.epoch = self.batches_seen = 0
        self.resume_at: tuple[int, int] | None = None  # (epoch, global batches already seen)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / (self.batch_size * self.steps_per_batch))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A generator: runs from the first batch, after Lightning has set the sampler's epoch.
        self.epoch = getattr(self.sampler, "epoch", 0)
        self.batches_seen = self.resume_at[1] if self.resume_at is not None and self.resume_at[0] == self.epoch else 0
        self.resume_at = None
        indices = torch.tensor(list(self.sampler), dtype=torch.long).to(self.device, non_blocking=True)
        span = self.batch_size * self.steps_per_batch
        for start in range(self.batches_seen * self.batch_size, len(indices), span):
            batch = indices[start : start + span]
            self.batches_seen += math.ceil(len(batch) / self.batch_size)
            yield self.images[batch], self.labels[batch]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = (state["epoch"], state["batches_seen"])


def augment(images: torch.Tensor, pad: int, hflip: bool) -> torch.Tensor:
    """A random crop of the image padded by `pad` pixels, mirrored with probability 1/2 if `hflip`: one gather."""
    n, _, height, width = images.shape
    rows = torch.arange(height, device=images.device).expand(n, height)
    cols = torch.arange(width, device=images.device).expand(n, width)
    if pad:
        images = nn.functional.pad(images, (pad, pad, pad, pad))
        rows = rows + torch.randint(0, 2 * pad + 1, (n, 1), device=images.device)
        cols = cols + torch.randint(0, 2 * pad + 1, (n, 1), device=images.device)
    if hflip:
        flip = torch.rand(n, 1, device=images.device) < 0.5
        cols = torch.where(flip, cols.flip(1), cols)
    picked = images[torch.arange(n, device=images.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return picked.permute(0, 3, 1, 2)  # the indexed dimensions come first: N x H x W x C


class FashionMNISTDataModule(LightningDataModule):
    """Served in a distributed sampler's order also on one process: N processes' shards of batch k make batch k."""

    def __init__(self, root: str = "data", batch_size: int = 256, val_size: int = 5000, download: bool = True,
                 shuffle: bool = True, seed: int = 42, num_classes: int = 10, in_channels: int = 1,
                 random_crop: int = 0, hflip: bool = False) -> None:
        super().__init__()
        self.random_crop, self.hflip = random_crop, hflip  # training images only (`augment`)
        self.num_classes, self.in_channels = num_classes, in_channels  # given to the model too (conf/model)
        self.root, self.batch_size, self.val_size = Path(root), batch_size, val_size
        self.raw_folder = self.root / "FashionMNIST" / "raw"
        self.sample_shape = (in_channels, IMAGE_SIZE, IMAGE_SIZE)
        self.download, self.shuffle, self.seed = download, shuffle, seed
        self.steps_per_execution = 1  # optimizer steps per training batch: set by the run (src/fast_path.py)
        self.splits: dict[str, TensorImages] = {}

    def missing_files(self) -> list[str]:
        return [name for name in RAW_FILES if not (self.raw_folder / name).is_file()]

    def prepare_data(self) -> None:
        if not self.missing_files():
            return
        reason = "data.download=false"
        if self.download:
            created = folders.missing(self.raw_folder)
            try:
                FashionMNIST(str(self.root), download=True)  # fetches both splits' files
                return
            except Exception as error:  # torchvision raises RuntimeError/URLError/OSError when offline
                folders.remove_empty(created)  # torchvision made them before it tried
                first_line = str(error).splitlines()[0].rstrip(" :") if str(error) else type(error).__name__
                reason = f"download failed: {first_line}"
        raise UsageError(f"data.root={self.root}: Fashion-MNIST not found in {self.raw_folder} ({reason}); expected "
                         f"{', '.join(RAW_FILES)}; point data.root=<folder holding FashionMNIST/raw> at a copy")

    def _load(self, train: bool) -> FashionMNIST:
        self.prepare_data()
        try:
            return FashionMNIST(str(self.root), train=train, download=False)
        except Exception as error:
            raise UsageError(f"data.root={self.root}: {self._unreadable_file()} in {self.raw_folder} is corrupt "
                             f"({type(error).__name__}: {error}); delete it to download again, or point data.root at "
                             "a good copy") from error

    def _unreadable_file(self) -> str:
        for name in RAW_FILES:
            try:
                read_sn3_pascalvincent_tensor(str(self.raw_folder / name), strict=False)
            except Exception:
                return name
        return "a file"

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        if (self.num_classes, self.in_channels) != (10, 1):
            key, value = ("data.num_classes", self.num_classes) if self.num_classes != 10 else ("data.in_channels", self.in_channels)
            raise UsageError(f"{key}={value} is not allowed; Fashion-MNIST has 10 classes of grayscale images (10 and 1)")
        train, test = self._load(train=True), self._load(train=False)
        for prefix, split in (("train", train), ("t10k", test)):
            self._check(prefix, split.data, split.targets)
        if not 0 <= self.val_size < len(train.targets):
            raise UsageError(f"data.val_size={self.val_size} is not allowed; data.val_size must be a whole number "
                             f"from 0 to {len(train.targets) - 1} (the training images less one)")
        order = torch.randperm(len(train.targets), generator=torch.Generator().manual_seed(self.seed))
        val_idx, train_idx = order[: self.val_size], order[self.val_size :]
        self.splits = {
            "train": TensorImages(train.data.index_select(0, train_idx), train.targets.index_select(0, train_idx)),
            "val": TensorImages(train.data.index_select(0, val_idx), train.targets.index_select(0, val_idx)),
            "test": TensorImages(test.data, test.targets),
        }

    def _check(self, prefix: str, images: torch.Tensor, labels: torch.Tensor) -> None:
        where = f"data.root={self.root}: {self.raw_folder / prefix}"
        if len(labels) != len(images):
            raise UsageError(f"{where}-labels-idx1-ubyte holds {len(labels)} labels for the {len(images)} images of "
                             f"{prefix}-images-idx3-ubyte; point data.root at a good copy")
        if tuple(images.shape[1:]) != (IMAGE_SIZE, IMAGE_SIZE):
            raise UsageError(f"{where}-images-idx3-ubyte holds images of {'x'.join(map(str, images.shape[1:]))} pixels, "
                             f"not Fashion-MNIST's {IMAGE_SIZE}x{IMAGE_SIZE}; point data.root at a good copy")
        if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < self.num_classes:
            raise UsageError(f"{where}-labels-idx1-ubyte holds labels from {int(labels.min())} to {int(labels.max())}, "
                             f"not 0 to {self.num_classes - 1} (data.num_classes={self.num_classes}); point data.root at a good copy")

    def _loader(self, split: str) -> DeviceLoader:
        """Training shards padded (DDP needs equal steps on every process); evaluation shards hold each image once."""
        trainer, dataset, train = self.trainer, self.splits[split], split == "train"
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        device = trainer.strategy.root_device if trainer else torch.device("cpu")
        if train:
            order = DistributedSampler(dataset, world_size, rank, shuffle=self.shuffle, seed=self.seed)
        else:
            order = range(rank, len(dataset), world_size)
        return DeviceLoader(dataset, order, per_process_batch(self.batch_size, world_size), device,
                            self.steps_per_execution if train else 1)

    def train_dataloader(self) -> DeviceLoader:
        return self._loader("train")

    def val_dataloader(self) -> DeviceLoader:
        return self._loader("val")

    def test_dataloader(self) -> DeviceLoader:
        return self._loader("test")

    def on_after_batch_transfer(self, batch: tuple[torch.Tensor, torch.Tensor], dataloader_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Augment and normalise on the device, into the precision's input dtype (Lightning converts them earlier)."""
        images, labels = batch
        if (self.random_crop or self.hflip) and self.trainer and self.trainer.training:
            images = augment(images, self.random_crop, self.hflip)
        dtype = self.trainer.precision_plugin.convert_input(torch.zeros(())).dtype if self.trainer else torch.float32
        return images.to(dtype).div_(255).sub_(MEAN).div_(STD), labels

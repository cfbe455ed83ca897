"""Fashion-MNIST held in memory as uint8 tensors, sharded per process, batched by slicing."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.datasets import FashionMNIST
from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

from src.errors import UsageError

# Mean and standard deviation of the official training images' pixels (in [0, 1]).
MEAN, STD = 0.2860, 0.3530
RAW_FILES = [os.path.splitext(os.path.basename(url))[0] for url, _ in FashionMNIST.resources]


class TensorImages(Dataset):
    """Images as one uint8 tensor; `__getitems__` lets the DataLoader fetch a batch by slicing."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images.unsqueeze(1) if images.dim() == 3 else images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]


def _keep_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """collate_fn for batches that `__getitems__` already built."""
    return batch


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way through, where a checkpoint left it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_at: tuple[int, int] | None = None  # (epoch, samples of this process already seen)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self.resume_at is not None:
            epoch, seen = self.resume_at
            self.resume_at = None
            if epoch == self.epoch:
                indices = indices[seen:]
        return iter(indices)


class ResumableLoader(DataLoader):
    """A DataLoader whose position in the epoch is part of every checkpoint, so that a run resumed
    from a mid-epoch checkpoint sees exactly the batches an unbroken run would have seen.

    Lightning saves `state_dict()` with the fit loop and calls `load_state_dict()` on resume. The
    count is global batches, the same on any number of processes, so a checkpoint resumes under
    another world size too.
    """

    sampler: ResumableSampler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.batches_seen = 0

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing runs until the first batch is asked for, after Lightning has set
        # the sampler's epoch.
        resume = self.sampler.resume_at
        skipped = resume[1] // self.batch_size if resume and resume[0] == self.sampler.epoch else 0
        self.epoch, self.batches_seen = self.sampler.epoch, skipped
        for batch in super().__iter__():
            self.batches_seen += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.resume_at = (state["epoch"], state["batches_seen"] * self.batch_size)


def per_process_batch(batch_size: int, world_size: int) -> int:
    """The global batch split evenly over all processes."""
    if batch_size < 1 or batch_size % world_size:
        raise UsageError(
            f"data.batch_size={batch_size} is the global batch and must be a positive multiple of the "
            f"{world_size} processes (devices x num_nodes); try {max(world_size, batch_size // world_size * world_size)}"
        )
    return batch_size // world_size


class FashionMNISTDataModule(LightningDataModule):
    """Fashion-MNIST through torchvision: download when missing, parse the IDX files, keep them in memory.

    Every split is served through a distributed sampler, also on one process, so that a run on
    N processes sees exactly the same global batches as a run on one: the union of the N
    shards of batch k is batch k of the single-process run. Validation and test shards are not
    padded, so accuracy counts each image once on any number of processes.
    """

    def __init__(
        self,
        root: str = "data",
        batch_size: int = 256,
        num_workers: int = 0,
        val_size: int = 5000,
        download: bool = True,
        shuffle: bool = True,
        seed: int = 42,
        num_classes: int = 10,
        in_channels: int = 1,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes  # given to the model too (conf/model: ${data.num_classes})
        self.in_channels = in_channels
        self.root = Path(root)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_size = val_size
        self.download = download
        self.shuffle = shuffle
        self.seed = seed
        self.splits: dict[str, TensorImages] = {}

    @property
    def raw_folder(self) -> Path:
        return self.root / "FashionMNIST" / "raw"

    def missing_files(self) -> list[str]:
        return [name for name in RAW_FILES if not (self.raw_folder / name).is_file()]

    def prepare_data(self) -> None:
        """Download into `root` when files are missing (runs once per node)."""
        if not self.missing_files():
            return
        reason = "data.download=false"
        if self.download:
            try:
                FashionMNIST(str(self.root), train=True, download=True)
                FashionMNIST(str(self.root), train=False, download=True)
                return
            except Exception as error:  # torchvision raises RuntimeError/URLError/OSError when offline
                first_line = str(error).splitlines()[0].rstrip(" :") if str(error) else type(error).__name__
                reason = f"download failed: {first_line}"
        raise UsageError(
            f"data.root={self.root}: Fashion-MNIST not found in {self.raw_folder} ({reason}); expected "
            f"{', '.join(RAW_FILES)}; point data.root=<folder holding FashionMNIST/raw> at a copy"
        )

    def _load(self, train: bool) -> FashionMNIST:
        if self.missing_files():
            self.prepare_data()
        try:
            return FashionMNIST(str(self.root), train=train, download=False)
        except Exception as error:
            raise UsageError(
                f"data.root={self.root}: {self._unreadable_file()} in {self.raw_folder} is corrupt "
                f"({type(error).__name__}: {error}); delete it to download again, or point data.root at a good copy"
            ) from error

    def _unreadable_file(self) -> str:
        """Name the file torchvision cannot parse, so the error says which one to replace."""
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
        train = self._load(train=True)
        test = self._load(train=False)
        if not 0 <= self.val_size < len(train.targets):
            raise UsageError(
                f"data.val_size={self.val_size} is not allowed; data.val_size must be a whole number from 0 to "
                f"{len(train.targets) - 1} (the training images less one)"
            )
        order = torch.randperm(len(train.targets), generator=torch.Generator().manual_seed(self.seed))
        val_idx, train_idx = order[: self.val_size], order[self.val_size :]
        self.splits = {
            "train": TensorImages(train.data[train_idx], train.targets[train_idx]),
            "val": TensorImages(train.data[val_idx], train.targets[val_idx]),
            "test": TensorImages(test.data, test.targets),
        }

    def _loader(self, split: str) -> DataLoader:
        """Training shards are padded to equal length (DDP needs the same number of steps on every
        process); validation and test shards are not, so that every image counts exactly once."""
        trainer = self.trainer
        world_size = trainer.world_size if trainer else 1
        rank = trainer.global_rank if trainer else 0
        dataset = self.splits[split]
        if split == "train":
            sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=self.shuffle, seed=self.seed)
            loader_class = ResumableLoader
        else:
            sampler = UnrepeatedDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
            loader_class = DataLoader
        return loader_class(
            dataset,
            batch_size=per_process_batch(self.batch_size, world_size),
            sampler=sampler,
            collate_fn=_keep_batch,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def on_after_batch_transfer(self, batch: tuple[torch.Tensor, torch.Tensor], dataloader_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise on the device: a uint8 batch crosses the bus at a quarter of the float size.

        The images get the dtype the precision plugin gives inputs (float64 for `precision=64`,
        float16 for `16-true`): Lightning converts inputs before this hook, while they are uint8.
        """
        images, labels = batch
        dtype = self.trainer.precision_plugin.convert_input(torch.zeros(())).dtype if self.trainer else torch.float32
        return images.to(dtype).div_(255).sub_(MEAN).div_(STD), labels

"""A new data set: a LightningDataModule that does what the framework expects of one (docs/extending.md).

Random images with the class written into their brightness, in any number of classes and
channels, so that a model can learn them and nothing needs downloading.
"""

import torch
from lightning import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from src.data.fashion_mnist import per_process_batch


class RandomImagesDataModule(LightningDataModule):
    """`batch_size` is the global batch: each process gets its share of every batch, as in FashionMNISTDataModule."""

    def __init__(self, batch_size: int = 32, num_classes: int = 3, in_channels: int = 3, image_size: int = 28,
                 train_images: int = 256, test_images: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.image_size = image_size
        self.sizes = {"train": train_images, "val": test_images, "test": test_images}
        self.seed = seed
        self.splits: dict[str, TensorDataset] = {}

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """One image's shape: what a run counts its FLOPs per image on (optional)."""
        return (self.in_channels, self.image_size, self.image_size)

    def setup(self, stage: str | None = None) -> None:
        """Called in the launching process before any DDP process starts, and again in each process."""
        generator = torch.Generator().manual_seed(self.seed)
        for split, n in self.sizes.items():
            labels = torch.randint(0, self.num_classes, (n,), generator=generator)
            noise = torch.rand(n, self.in_channels, self.image_size, self.image_size, generator=generator)
            self.splits[split] = TensorDataset(noise + labels.view(-1, 1, 1, 1).float(), labels)

    def _loader(self, split: str) -> DataLoader:
        """The Trainer runs with use_distributed_sampler=False: the data module shards by rank itself,
        padded for training (every process takes as many steps), unpadded for evaluation (each image once)."""
        world_size = self.trainer.world_size if self.trainer else 1
        rank = self.trainer.global_rank if self.trainer else 0
        dataset = self.splits[split]
        if split == "train":
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=self.seed)
        else:
            sampler = UnrepeatedDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=per_process_batch(self.batch_size, world_size), sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def on_after_batch_transfer(self, batch: list[torch.Tensor], dataloader_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Images in the dtype the precision gives inputs (float64 under precision=64)."""
        images, labels = batch
        dtype = self.trainer.precision_plugin.convert_input(torch.zeros(())).dtype if self.trainer else torch.float32
        return images.to(dtype), labels

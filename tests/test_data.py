import struct
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DistributedSampler
from torchvision.datasets import FashionMNIST

from src.data.fashion_mnist import MEAN, RAW_FILES, STD, FashionMNISTDataModule, TensorImages, augment, per_process_batch
from src.errors import UsageError
from tests.helpers import write_idx, write_tiny_fashion_mnist


def loader_batches(dm: FashionMNISTDataModule, split: str, world_size: int, rank: int, precision: Precision | None = None,
                   device: str = "cpu") -> list:
    class FakeTrainer:  # the attributes the data module reads from Lightning's Trainer
        pass

    trainer = FakeTrainer()
    trainer.world_size, trainer.global_rank, trainer.precision_plugin = world_size, rank, precision or Precision()
    trainer.strategy = SimpleNamespace(root_device=torch.device(device))
    dm.trainer = trainer
    return list(getattr(dm, f"{split}_dataloader")())


def test_tiny_idx_files_are_parsed_by_torchvision_and_kept_as_uint8(tmp_path):
    write_tiny_fashion_mnist(tmp_path, n_train=64, n_test=32)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=16, val_size=8, download=False)
    dm.setup()
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 56, "val": 8, "test": 32}
    for split in dm.splits.values():
        assert split.images.dtype == torch.uint8 and split.images.shape[1:] == (1, 28, 28)
        assert torch.equal(split.images[:, 0, 0, 0].long(), split.labels)  # pixel 0 encodes the label


def test_batches_are_sliced_and_normalised_on_transfer(tmp_path):
    write_tiny_fashion_mnist(tmp_path)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=16, val_size=8, download=False)
    dm.setup()
    images, labels = loader_batches(dm, "test", 1, 0)[0]
    assert images.dtype == torch.uint8 and images.shape == (16, 1, 28, 28) and labels.shape == (16,)
    x, y = dm.on_after_batch_transfer((images, labels), 0)
    assert torch.allclose(x, (images.float() / 255 - MEAN) / STD) and torch.equal(y, labels)


@pytest.mark.parametrize(("plugin", "dtype"), [(DoublePrecision(), torch.float64), (HalfPrecision("bf16-true"), torch.bfloat16),
                                               (MixedPrecision("bf16-mixed", "cpu"), torch.float32)])
def test_batches_get_the_input_dtype_of_the_precision(tmp_path, plugin, dtype):
    write_tiny_fashion_mnist(tmp_path)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=16, val_size=8, download=False)
    dm.setup()
    batch = loader_batches(dm, "test", 1, 0, plugin)[0]
    assert dm.on_after_batch_transfer(batch, 0)[0].dtype == dtype


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_of_each_global_batch_add_up_to_the_single_process_batch(tmp_path, world_size):
    write_tiny_fashion_mnist(tmp_path, n_train=72, n_test=8)
    kwargs = dict(root=str(tmp_path), batch_size=16, val_size=8, download=False, seed=3)
    single = FashionMNISTDataModule(**kwargs)
    single.setup()
    reference = loader_batches(single, "train", 1, 0)
    shards = []
    for rank in range(world_size):
        dm = FashionMNISTDataModule(**kwargs)
        dm.setup()
        shards.append(loader_batches(dm, "train", world_size, rank))
    assert all(len(s) == len(reference) for s in shards)
    for k, (images, labels) in enumerate(reference):
        per_rank = [shards[r][k] for r in range(world_size)]
        assert all(len(b[1]) == 16 // world_size for b in per_rank)
        merged = torch.cat([b[0] for b in per_rank])
        # Same images in the global batch, whichever process holds which.
        assert sorted(map(bytes, merged.flatten(1).numpy())) == sorted(map(bytes, images.flatten(1).numpy()))


def test_each_process_reads_only_its_own_shard(tmp_path):
    write_tiny_fashion_mnist(tmp_path, n_train=72, n_test=8)
    seen = []
    for rank in range(2):
        dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=8, val_size=8, download=False)
        dm.setup()
        seen.append({bytes(img.numpy()) for b in loader_batches(dm, "train", 2, rank) for img in b[0]})
    assert len(seen[0]) == len(seen[1]) == 32 and not seen[0] & seen[1]


def test_global_batch_must_divide_by_the_processes():
    assert per_process_batch(256, 4) == 64
    with pytest.raises(UsageError, match=r"data.batch_size=10 .* 4 processes"):
        per_process_batch(10, 4)


def test_missing_data_names_folder_and_files(tmp_path):
    dm = FashionMNISTDataModule(root=str(tmp_path / "empty"), download=False)
    with pytest.raises(UsageError) as error:
        dm.prepare_data()
    message = str(error.value)
    assert "\n" not in message and "data.root=" in message and str(tmp_path / "empty") in message
    assert all(name in message for name in RAW_FILES)


def test_download_uses_torchvision_and_a_failed_download_is_one_clear_line(tmp_path, monkeypatch):
    calls = []

    def offline_download(self):
        calls.append(self.root)
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(FashionMNIST, "download", offline_download)
    dm = FashionMNISTDataModule(root=str(tmp_path), download=True)
    with pytest.raises(UsageError, match="download failed: Error downloading") as error:
        dm.prepare_data()
    assert calls and "\n" not in str(error.value)


def test_download_fills_a_missing_root(tmp_path, monkeypatch):
    def fake_download(self):  # stands in for the network: writes what the mirror would deliver
        write_tiny_fashion_mnist(tmp_path)

    monkeypatch.setattr(FashionMNIST, "download", fake_download)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=8, val_size=8)
    assert dm.missing_files() == RAW_FILES
    dm.prepare_data()
    dm.setup()
    assert len(dm.splits["test"]) == 32


def test_corrupt_file_is_one_clear_line(tmp_path):
    write_tiny_fashion_mnist(tmp_path)
    raw = tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    raw.write_bytes(raw.read_bytes()[:1000])  # truncated download
    dm = FashionMNISTDataModule(root=str(tmp_path), download=False)
    with pytest.raises(UsageError, match="corrupt") as error:
        dm.setup()
    assert "\n" not in str(error.value)


def test_wrong_magic_number_is_reported_as_corrupt(tmp_path):
    write_tiny_fashion_mnist(tmp_path)
    write_idx(tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte", torch.zeros(4, 2, 2).numpy())
    with pytest.raises(UsageError, match="corrupt"):
        FashionMNISTDataModule(root=str(tmp_path), download=False).setup()


def test_real_copy_matches_its_idx_headers(data_root):
    dm = FashionMNISTDataModule(root=str(data_root), download=False, val_size=5000)
    dm.setup()
    raw = data_root / "FashionMNIST" / "raw"
    n_train = struct.unpack(">I", (raw / "train-labels-idx1-ubyte").read_bytes()[4:8])[0]
    n_test = struct.unpack(">I", (raw / "t10k-labels-idx1-ubyte").read_bytes()[4:8])[0]
    assert len(dm.splits["train"]) + len(dm.splits["val"]) == n_train and len(dm.splits["val"]) == 5000
    assert len(dm.splits["test"]) == n_test
    assert torch.bincount(dm.splits["test"].labels, minlength=10).min() > 0
    pixels = dm.splits["train"].images.float() / 255
    assert pixels.mean().item() == pytest.approx(MEAN, abs=0.01) and pixels.std().item() == pytest.approx(STD, abs=0.01)


def test_tensor_images_fetch_one_item_or_a_batch():
    data = TensorImages(torch.arange(4 * 28 * 28, dtype=torch.uint8).reshape(4, 28, 28), torch.arange(4))
    image, label = data[2]
    batch, labels = data[[3, 1]]
    assert image.shape == (1, 28, 28) and label == 2
    assert batch.shape == (2, 1, 28, 28) and labels.tolist() == [3, 1]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("split", ["val", "test"])
def test_evaluation_shards_hold_every_image_exactly_once(tmp_path, world_size, split):
    write_tiny_fashion_mnist(tmp_path, n_train=64, n_test=31)  # 31 and 9 divide by none of 2, 3, 4
    seen = []
    for rank in range(world_size):
        dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=12, val_size=9, download=False)
        dm.setup()
        seen += [bytes(img.numpy()) for b in loader_batches(dm, split, world_size, rank) for img in b[0]]
    expected = [bytes(img.numpy()) for img in dm.splits[split].images]
    assert sorted(seen) == sorted(expected)


def test_resumed_loader_continues_mid_epoch_with_the_same_batches(tmp_path):
    """A loader restored from `state_dict()` yields what remained of the epoch, on any world size."""
    write_tiny_fashion_mnist(tmp_path, n_train=72, n_test=8)
    kwargs = dict(root=str(tmp_path), batch_size=8, val_size=8, download=False, seed=5)

    def loader(world_size: int, rank: int):
        dm = FashionMNISTDataModule(**kwargs)
        dm.setup()
        loader_batches(dm, "train", world_size, rank)  # attaches the fake trainer
        return dm.train_dataloader()

    unbroken = loader(1, 0)
    unbroken.sampler.set_epoch(1)
    reference = [labels for _, labels in unbroken]

    first = loader(1, 0)
    first.sampler.set_epoch(1)
    iterator = iter(first)
    [next(iterator) for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 1, "batches_seen": 3}

    shards = []
    for rank in range(2):  # resumed on two processes: each shard continues at the same global batch
        resumed = loader(2, rank)
        resumed.load_state_dict(state)
        resumed.sampler.set_epoch(1)
        shards.append([labels for _, labels in resumed])
        assert resumed.state_dict() == {"epoch": 1, "batches_seen": len(reference)}
    assert len(shards[0]) == len(reference) - 3
    for k, labels in enumerate(reference[3:]):
        assert sorted(torch.cat([shards[0][k], shards[1][k]]).tolist()) == sorted(labels.tolist())

    next_epoch = loader(1, 0)
    next_epoch.load_state_dict(state)
    next_epoch.sampler.set_epoch(2)  # a checkpoint of epoch 1 does not shorten epoch 2
    assert len(list(next_epoch)) == len(reference)


@pytest.mark.parametrize("world_size", [1, 4])
def test_shards_are_in_the_order_of_the_distributed_samplers(tmp_path, world_size):
    """Training visits the indices of torch's DistributedSampler (padded), evaluation those of Lightning's
    UnrepeatedDistributedSampler (every image once)."""
    write_tiny_fashion_mnist(tmp_path, n_train=72, n_test=31)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=4 * world_size, val_size=9, download=False, seed=7)
    dm.setup()
    for rank in range(world_size):
        loader_batches(dm, "train", world_size, rank)
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(3)
        sampler = DistributedSampler(range(63), num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(3)
        labels = dm.splits["train"].labels
        assert torch.cat([y for _, y in loader]).tolist() == labels[list(sampler)].tolist()
        unrepeated = UnrepeatedDistributedSampler(range(31), num_replicas=world_size, rank=rank, shuffle=False)
        seen = torch.cat([y for _, y in loader_batches(dm, "test", world_size, rank)])
        assert seen.tolist() == dm.splits["test"].labels[list(unrepeated)].tolist()


def test_loader_keeps_the_split_on_the_device_and_gathers_batches_there(tmp_path):
    write_tiny_fashion_mnist(tmp_path)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=16, val_size=8, download=False)
    dm.setup()
    loader_batches(dm, "train", 1, 0)
    loader = dm.train_dataloader()
    images, labels = next(iter(loader))
    assert images.device == loader.images.device == torch.device("cpu")
    # A view of neither the split nor the host tensors: a gather into a fresh batch.
    assert images.data_ptr() != loader.images.data_ptr() and len(labels) == 16
    assert loader.images.data_ptr() == dm.splits["train"].images.data_ptr()  # on the CPU the split is not copied


@pytest.mark.gpu
def test_on_a_gpu_the_split_moves_once_and_batches_are_gathered_there(tmp_path):
    write_tiny_fashion_mnist(tmp_path)
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=16, val_size=8, download=False)
    dm.setup()
    on_gpu = loader_batches(dm, "train", 1, 0, device="cuda:0")
    on_cpu = loader_batches(dm, "train", 1, 0)
    assert all(x.is_cuda and y.is_cuda for x, y in on_gpu)
    assert all(torch.equal(a.cpu(), b) for (a, _), (b, _) in zip(on_gpu, on_cpu))  # the same batches as on the CPU


def test_augment_shifts_within_the_padding_and_mirrors_whole_images():
    torch.manual_seed(0)
    images = torch.randint(1, 256, (64, 1, 28, 28), dtype=torch.uint8)  # no zero pixel: zeros come from the padding
    assert augment(images, 0, False).equal(images)
    flipped = augment(images, 0, True)
    same = [(flipped[i].equal(images[i]), flipped[i].equal(images[i].flip(-1))) for i in range(64)]
    assert all(a or b for a, b in same) and 10 < sum(b for _, b in same) < 54
    shifted = augment(images, 2, False)
    assert shifted.shape == images.shape
    zero_rows = (shifted == 0).all(dim=3).sum(dim=(1, 2))  # rows of padding brought in by a vertical shift
    assert zero_rows.max() <= 2 and zero_rows.sum() > 0
    for i in range(64):  # the middle 24 x 24 of every shifted image is a window of the original
        windows = {(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                   if shifted[i, 0, 2:26, 2:26].equal(images[i, 0, 2 + dy:26 + dy, 2 + dx:26 + dx])}
        assert windows


@pytest.mark.parametrize(("damage", "said"), [
    ("labels of 200", "train-labels-idx1-ubyte holds labels from 0 to 200, not 0 to 9 (data.num_classes=10)"),
    ("32x32 images", "train-images-idx3-ubyte holds images of 32x32 pixels, not Fashion-MNIST's 28x28"),
    ("fewer labels than images", "train-labels-idx1-ubyte holds 30 labels for the 64 images of train-images-idx3-ubyte"),
])
def test_files_that_parse_but_do_not_fit_are_one_line_naming_the_file(tmp_path, damage, said):
    """Valid IDX files can still be wrong for a run: labels beyond the classes, images of another size, two files of
    different lengths. Each is said before any step, in one line naming the file."""
    raw = write_tiny_fashion_mnist(tmp_path) / "FashionMNIST" / "raw"
    labels = torch.randint(0, 10, (64,)).numpy()
    if damage == "labels of 200":
        labels[3] = 200
        write_idx(raw / "train-labels-idx1-ubyte", labels)
    elif damage == "32x32 images":
        write_idx(raw / "train-images-idx3-ubyte", torch.zeros(64, 32, 32, dtype=torch.uint8).numpy())
    else:
        write_idx(raw / "train-labels-idx1-ubyte", labels[:30])
    dm = FashionMNISTDataModule(root=str(tmp_path), batch_size=16, val_size=8, download=False)
    with pytest.raises(UsageError) as caught:
        dm.setup()
    assert str(caught.value) == f"data.root={tmp_path}: {raw / said.split(' holds ')[0]} holds {said.split(' holds ', 1)[1]}" \
        f"; point data.root at a good copy"

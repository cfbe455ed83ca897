"""strategy=dp: registration, its checks and checkpoint keys on CPU; nn.DataParallel against one device on GPUs."""

import copy
import threading

import pytest
import torch
from hydra.utils import instantiate
from lightning import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf
from torch import nn

import src.strategies  # noqa: F401  the import under test: it registers "dp"
from src.data.fashion_mnist import FashionMNISTDataModule
from src.errors import UsageError
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.models.resnet import resnet18
from src.strategies.dp import DataParallelNet, DataParallelStrategy
from src.launch.workers import processes_per_node
from tests.equivalence import checkpoint, deviation
from tests.helpers import QUICK, REPO, composed, hparams, train, train_here

GPUS = torch.cuda.device_count()
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")


def quiet_trainer(**kwargs) -> Trainer:
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_importing_src_strategies_registers_dp():
    assert StrategyRegistry["dp"]["strategy"] is DataParallelStrategy
    trainer = quiet_trainer(strategy="dp", accelerator="cpu", devices=1)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.world_size == 1 and trainer.global_rank == 0 and trainer.strategy.root_device == torch.device("cpu")


def test_dp_config_is_one_process_whatever_the_devices():
    strategy = instantiate(OmegaConf.load(REPO / "conf" / "strategy" / "dp.yaml"))
    assert isinstance(strategy, DataParallelStrategy) and strategy.net_attribute == "net"
    assert processes_per_node(composed("strategy=dp", "devices=4")) == 1


def test_several_cpu_devices_are_a_usage_error():
    trainer = quiet_trainer(strategy="dp", accelerator="cpu", devices=2)
    with pytest.raises(UsageError, match="strategy=dp devices=2 needs CUDA GPUs"):
        trainer.fit(BoringModel())


def test_cli_dp_on_one_cpu_device_trains_and_logs(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "strategy=dp", "devices=1", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    params = hparams(run_dir)
    assert (params["strategy"], params["world_size"]) == ("dp", 1)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_cli_dp_on_two_cpu_devices_fails_with_one_line(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "strategy=dp", "devices=2", "accelerator=cpu", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: strategy=dp devices=2 needs CUDA GPUs")
    assert "Traceback" not in result.stderr and not run_dir.exists()


@pytest.mark.parametrize("make_net", [LeNet, resnet18])
def test_a_wrapped_net_saves_and_loads_the_keys_of_the_plain_net(make_net):
    plain = Classifier(make_net())
    wrapped = copy.deepcopy(plain)
    wrapped.net = DataParallelNet(wrapped.net)
    saved = wrapped.state_dict()
    assert list(saved) == list(plain.state_dict())
    assert list(saved._metadata) == list(plain.state_dict()._metadata)
    torch.testing.assert_close(dict(saved), dict(plain.state_dict()), check_device=False)

    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    checkpoint_of_another_strategy = plain.state_dict()
    wrapped.load_state_dict(checkpoint_of_another_strategy)  # strict
    assert list(checkpoint_of_another_strategy) == list(saved), "loading leaves the caller's dict as it was"
    assert list(checkpoint_of_another_strategy._metadata) == list(saved._metadata)
    torch.testing.assert_close(dict(wrapped.state_dict()), dict(plain.state_dict()), check_device=False)
    fresh = Classifier(make_net())
    fresh.load_state_dict(wrapped.state_dict())  # and a dp checkpoint loads elsewhere
    torch.testing.assert_close(dict(fresh.state_dict()), dict(plain.state_dict()), check_device=False)


# ---- GPUs: the real replicate / scatter / gather. One GPU serves as two devices ([0, 0]).

def replica_devices() -> list[int]:
    return [0, 1] if GPUS >= 2 else [0, 0]


def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 28, 28, generator=generator).cuda(), torch.randint(0, 10, (n,), generator=generator).cuda()


@pytest.mark.gpu
def test_gradients_loss_and_accuracy_equal_one_device(exact_cuda_math):
    one = Classifier(LeNet()).cuda()
    dp = copy.deepcopy(one)
    dp.net = DataParallelNet(dp.net, device_ids=replica_devices())
    x, y = images(11)  # 11 splits unevenly (6 + 5)
    losses = []
    for module in (one, dp):
        loss, logits, _ = module.model_step((x, y))
        loss.backward()
        module.train_acc(logits, y)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    # The replicas' gradients add in another order than one device's: cuDNN sums a weight gradient over
    # the batch's images and positions, here in two parts of 6 and 5 images. Reordered float32 sums
    # differ by a few units of eps times the sum of the terms' sizes, which is unbounded relative
    # to a gradient entry where terms cancel (an H100 showed 1.5x on one entry of net.3.weight),
    # so each tensor is compared against its largest entry: 1.9e-4 of it at most, measured.
    for (name, a), b in zip(one.named_parameters(), dp.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-3 * a.grad.abs().max().item(), msg=name)
    assert dp.train_acc.compute() == one.train_acc.compute()


@pytest.mark.gpu
def test_scatter_splits_the_batch_like_torch_chunk():
    sizes, lock = [], threading.Lock()

    class Recorder(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                sizes.append(len(x))
            return x

    out = DataParallelNet(Recorder().cuda(), device_ids=replica_devices())(torch.arange(11.0).cuda())
    assert sorted(sizes) == sorted(len(c) for c in torch.arange(11).chunk(len(replica_devices())))
    assert torch.equal(out.cpu(), torch.arange(11.0)), "gathered in the batch's order"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_replica_runs_under_the_callers_autocast_dtype(dtype):
    net = DataParallelNet(LeNet().cuda(), device_ids=replica_devices())
    with torch.autocast("cuda", dtype=dtype):
        out = net(images(8)[0])
    assert out.dtype == dtype


class WhatFitSees(Callback):
    def __init__(self) -> None:
        self.net_types: set[type] = set()
        self.keys: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.net_types.add(type(pl_module.net))
        self.keys = list(pl_module.state_dict())


@pytest.mark.gpu
def test_fit_wraps_only_net_and_unwraps_it_afterwards(tmp_path, data_root):
    module, seen = Classifier(LeNet()), WhatFitSees()
    data = FashionMNISTDataModule(root=str(data_root), batch_size=32, val_size=64)
    trainer = quiet_trainer(strategy="dp", accelerator="gpu", devices=min(GPUS, 2), max_steps=2, callbacks=[seen],
                            limit_val_batches=0, use_distributed_sampler=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=data)
    assert seen.net_types == {DataParallelNet} and type(module.net) is LeNet
    assert seen.keys == list(Classifier(LeNet()).state_dict()), "what a checkpoint saves during fit"


GPU_LENET = ("model=lenet", "accelerator=gpu", "data.batch_size=64", "max_epochs=2", "trainer.limit_train_batches=3",
             "optim.momentum=0.9", "optim.weight_decay=0.001", "trainer.limit_val_batches=0", "trainer.limit_test_batches=1",
             "trainer.enable_progress_bar=false")
# In SGD steps (tests/equivalence.py). TF32 convolutions round a batch and its halves differently.
GPU_TOLERANCE = 2e-2


@pytest.mark.gpu
@pytest.mark.slow
def test_cli_dp_checkpoint_resumes_under_one_device_and_matches_it(tmp_path, data_root):
    runs = {name: tmp_path / name for name in ("one", "dp", "resumed")}
    results = [
        train(f"data.root={data_root}", *GPU_LENET, f"hydra.run.dir={runs['one']}"),
        train(f"data.root={data_root}", *GPU_LENET, "strategy=dp", "devices=1", "max_epochs=1", f"hydra.run.dir={runs['dp']}"),
    ]
    results.append(train(f"data.root={data_root}", *GPU_LENET, f"ckpt_path={runs['dp'] / 'checkpoints' / 'last.ckpt'}",
                         f"hydra.run.dir={runs['resumed']}"))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert deviation(checkpoint(runs["resumed"]), checkpoint(runs["one"])) < GPU_TOLERANCE


@pytest.mark.gpu
@pytest.mark.slow
@needs_two_gpus
def test_cli_dp_on_two_gpus_matches_one_gpu(tmp_path, data_root):
    one, dp = tmp_path / "one", tmp_path / "dp"
    for run_dir, extra in ((one, ()), (dp, ("strategy=dp", "devices=2"))):
        result = train(f"data.root={data_root}", *GPU_LENET, *extra, f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert hparams(dp)["world_size"] == 1 and hparams(dp)["devices"] == 2
    assert deviation(checkpoint(dp), checkpoint(one)) < GPU_TOLERANCE

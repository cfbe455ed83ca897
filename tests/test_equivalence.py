"""Data-parallel training computes what one process computes (docs/equivalence.md).

(a) the book's from-scratch data parallelism, written out below, equals one process at the same global batch;
(b) the real command line under DDP with 4 processes, and with 2 taking over from dp's first epoch, ends with one
    process's LeNet parameters;
(c) dp's reduction (the loss of the gathered logits) gives the one-device gradient, also for uneven shards;
(d) ResNet-18's BatchNorm makes 2-process DDP differ from one process, and sync_batchnorm=true restores it: in float64,
    where only rounding parts them, in tests/test_sync_batchnorm.py.

Distances are in lengths of one SGD step (tests/equivalence.py), so a tolerance reads as
"the runs ended this fraction of a step apart".
"""

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call

from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.lenet import LeNet
from src.models.module import Classifier
from tests.equivalence import checkpoint, deviation, distance, last_step_norm
from tests.helpers import hparams, train_here

SGD = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
BATCH, STEPS = 32, 4
# float32 sums in another order: measured 2e-7 to 5e-7 of a step in (a) and (b).
SAME_RESULT = 1e-5
# Relative gradient error of float32 sums in another order: measured up to 2.4e-6 in (c).
SAME_GRADIENT = 2e-5
# Wrong reductions and per-process BatchNorm statistics: measured 0.6 to 1.0 of a step apart.
DIFFERENT_RESULT = 0.1


# ---- (a) The oracle: data parallelism from scratch, as the book writes it.

def allreduce_mean(tensors: list[torch.Tensor]) -> None:
    """Sum every device's copy into the first, divide by their number, copy the result back to all."""
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total += tensor
    for tensor in tensors:
        tensor.copy_(total / len(tensors))


def book_data_parallel(net: nn.Module, batches, world: int, reduce: Callable = allreduce_mean):
    """A copy of the model per device, the batch split in `world` shards, gradients all-reduced, the same update everywhere."""
    replicas = [copy.deepcopy(net) for _ in range(world)]
    optimizers = [torch.optim.SGD(r.parameters(), **SGD) for r in replicas]
    for x, y in batches:
        for replica, x_shard, y_shard in zip(replicas, x.chunk(world), y.chunk(world)):
            replica.zero_grad()
            nn.functional.cross_entropy(replica(x_shard), y_shard).backward()
        for grads in zip(*[[p.grad for p in r.parameters()] for r in replicas]):
            reduce(list(grads))
        for optimizer in optimizers:
            optimizer.step()
    return replicas, optimizers


def one_process(net: nn.Module, batches):
    net = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), **SGD)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return net, optimizer


@pytest.fixture(scope="module")
def real_batches(data_root) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first training batches, normalised as the data module does on the device."""
    data = FashionMNISTDataModule(root=str(data_root))
    data.setup()
    train_split = data.splits["train"]
    return [data.on_after_batch_transfer(train_split[list(range(i * BATCH, (i + 1) * BATCH))], 0) for i in range(STEPS)]


def state(net: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"state_dict": net.state_dict(), "optimizer_states": [optimizer.state_dict()]}


@pytest.mark.parametrize("world", [2, 4])
def test_a_book_data_parallel_equals_one_process_at_the_same_global_batch(real_batches, world):
    torch.manual_seed(0)
    net = LeNet()
    replicas, optimizers = book_data_parallel(net, real_batches, world)
    reference = state(*one_process(net, real_batches))
    for replica in replicas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replica.parameters(), replicas[0].parameters()))
    assert deviation(state(replicas[0], optimizers[0]), reference) < SAME_RESULT
    assert distance(dict(net.named_parameters()), dict(replicas[0].named_parameters())) > STEPS / 2 * last_step_norm(
        reference["optimizer_states"][0]
    ), "the parameters moved by several steps"


def test_a_summing_without_dividing_by_the_world_is_caught(real_batches):
    def allreduce_sum(tensors: list[torch.Tensor]) -> None:
        total = sum(t.clone() for t in tensors)
        for tensor in tensors:
            tensor.copy_(total)

    torch.manual_seed(0)
    net = LeNet()
    replicas, optimizers = book_data_parallel(net, real_batches, 2, reduce=allreduce_sum)
    assert deviation(state(replicas[0], optimizers[0]), state(*one_process(net, real_batches))) > DIFFERENT_RESULT


# ---- (b): the real command line.

# fp32: equivalence up to fp32 rounding is the claim; bf16 autocast rounds differently per batch split.
COMMON = ("precision=32", "optim.lr=0.1", "optim.momentum=0.9", "optim.weight_decay=0.001", "trainer.limit_val_batches=0",
          "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
# Two epochs of two steps: a checkpoint after the first epoch resumes exactly (the sampler reshuffles per epoch).
# The book's N(0, 0.01) start, with which the bounds below were measured (Kaiming's larger weights scale the rounding).
LENET = ("model=lenet", "model.net.init=normal", f"data.batch_size={BATCH}", "max_epochs=2", "trainer.limit_train_batches=2", *COMMON)
RESNET = ("model=resnet18", "data.batch_size=16", "trainer.max_steps=1", *COMMON)


@pytest.fixture(scope="module")
def cli(tmp_path_factory, data_root) -> Callable[..., Path]:
    """Run the command once per name in this module, in this process (a DDP run's ranks are processes it starts);
    returns the run folder."""
    runs: dict[str, Path] = {}

    def run(name: str, *overrides: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            result = train_here(f"data.root={data_root}", *overrides, f"hydra.run.dir={run_dir}")
            assert result.returncode == 0, result.stderr[-3000:]
            runs[name] = run_dir
        return runs[name]

    return run


def assert_ends_where_one_process_does(ddp: dict, one: dict) -> None:
    """The parameters, and SGD's momentum buffers, of the same optimizer step."""
    assert ddp["global_step"] == one["global_step"] == 4
    assert deviation(ddp, one) < SAME_RESULT
    momentum = [s["momentum_buffer"] for s in ddp["optimizer_states"][0]["state"].values()]
    reference = [s["momentum_buffer"] for s in one["optimizer_states"][0]["state"].values()]
    for a, b in zip(momentum, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_b_ddp_on_four_processes_ends_with_the_parameters_of_one_process(cli):
    """Four: a mean over the world that divided by 2, or shards that were halves, would pass on two (the test below)."""
    one = checkpoint(cli("lenet_one", *LENET))
    run_dir = cli("lenet_ddp4", *LENET, "strategy=ddp", "devices=4")
    assert hparams(run_dir)["world_size"] == 4
    assert_ends_where_one_process_does(checkpoint(run_dir), one)


@pytest.mark.slow
def test_b_dp_checkpoint_resumes_under_ddp_and_ends_where_one_process_does(cli):
    """DDP on two processes, taking over from dp's first epoch, ends where one process does, momentum and all."""
    one = checkpoint(cli("lenet_one", *LENET))
    dp_dir = cli("lenet_dp_first_epoch", *LENET, "strategy=dp", "devices=1", "max_epochs=1")
    first_epoch = checkpoint(dp_dir)
    assert first_epoch["global_step"] == 2
    run_dir = cli("lenet_ddp2_resumed", *LENET, "strategy=ddp", "devices=2", f"ckpt_path={dp_dir / 'checkpoints' / 'last.ckpt'}")
    assert hparams(run_dir)["world_size"] == 2
    assert_ends_where_one_process_does(checkpoint(run_dir), one)


# ---- (c) dp's reduction, apart from CUDA.

class EmulatedDataParallel(nn.Module):
    """nn.DataParallel's autograd graph on CPU: scatter as torch.chunk, one replica per shard whose
    parameters are copies of the root's (so backward adds the replicas' gradients, as replicate's
    does), gather as concatenation. The GPU tests in test_dp.py check the real one against this."""

    def __init__(self, net: nn.Module, devices: int) -> None:
        super().__init__()
        self.net, self.devices = net, devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for shard in x.chunk(self.devices):
            replica = {name: p.clone() for name, p in self.net.named_parameters()}
            outputs.append(functional_call(self.net, replica, (shard,)))
        return torch.cat(outputs)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("batch, devices", [(32, 2), (32, 4), (10, 4), (7, 3)])
def test_c_loss_of_the_gathered_logits_gives_the_one_device_gradient(real_batches, batch, devices):
    x, y = (t[:batch] for t in real_batches[0])
    torch.manual_seed(0)
    one = Classifier(LeNet())
    dp = copy.deepcopy(one)
    dp.net = EmulatedDataParallel(dp.net, devices)
    for module in (one, dp):
        loss, logits, _ = module.model_step((x, y))  # the Classifier's own loss, as training_step runs it
        loss.backward()
        module.train_acc(logits, y)
    errors = {name: relative_error(b.grad, a.grad) for (name, a), b in zip(one.named_parameters(), dp.parameters())}
    assert max(errors.values()) < SAME_GRADIENT, errors
    assert dp.train_acc.compute() == one.train_acc.compute()


def test_c_averaging_per_replica_losses_is_wrong_for_uneven_shards(real_batches):
    """What Lightning 1's training_step_end did: the mean of the replicas' mean losses weighs a short shard too much."""
    x, y = (t[:10] for t in real_batches[0])
    torch.manual_seed(0)
    net = LeNet()
    nn.functional.cross_entropy(net(x), y).backward()
    right = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch.stack([nn.functional.cross_entropy(net(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4))]).mean().backward()
    assert max(relative_error(p.grad, g) for p, g in zip(net.parameters(), right)) > DIFFERENT_RESULT

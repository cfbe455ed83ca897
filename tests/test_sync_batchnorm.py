"""AllReduceBatchNorm against BatchNorm on the whole batch, in a real 2-process gloo group on CPU; on a GPU, torch's
SyncBatchNorm the same way over NCCL, in both memory layouts; and the command line's `sync_batchnorm=true` on two gloo
ranks against one process, in float64. On CPU both gloo checks share one start of their 2 ranks.
"""

import copy
import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from src.strategies.sync_batchnorm import AllReduceBatchNorm, AllReduceBatchNorm1d, AllReduceBatchNorm2d, SyncBatchNormPlugin
from tests.equivalence import checkpoint, deviation, distance, running_stats
from tests.helpers import hparams, once, start_ranks, train_as_torchrun, train_here
from tests.test_equivalence import DIFFERENT_RESULT, LENET, RESNET

WORLD = 2
STEPS = 3
LR = 0.1
# float64 leaves only rounding: anything above this is a wrong formula, not noise.
TOL = dict(rtol=1e-9, atol=1e-11)


def bn_net() -> nn.Module:
    """BatchNorm over images (2d) and over features (1d), one with momentum, one with the cumulative average."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 6), nn.BatchNorm1d(6, momentum=None), nn.ReLU(), nn.Linear(6, 3),
    ).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    # Offsets far from 0 make a variance formula that cancels digits visible.
    return [(torch.randn(10, 1, 8, 8, generator=generator, dtype=torch.float64) * 3 + 50,
             torch.randint(0, 3, (10,), generator=generator)) for _ in range(STEPS)]


def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Uneven shards (4 and 6 of 10) to check that each process's count is weighted."""
    return tensor[:4] if rank == 0 else tensor[4:]


def train(net: nn.Module, rank: int | None, place: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> dict[str, object]:
    """SGD on the summed loss / global batch; `rank` None is one process on the whole batch. `place` puts the
    images where the network is, in its memory layout."""
    outputs, input_grads = [], []
    for x, y in batches():
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        x = place(x).clone().requires_grad_()
        y = y.to(x.device)
        out = net(x)
        nn.functional.cross_entropy(out, y, reduction="sum").div(10).backward()
        for p in net.parameters():
            if rank is not None:
                dist.all_reduce(p.grad)
            p.data -= LR * p.grad
            p.grad = None
        outputs.append(out.detach())
        input_grads.append(x.grad)
    net.eval()
    x_eval = place(batches()[0][0] if rank is None else shard(batches()[0][0], rank))
    return {"outputs": outputs, "input_grads": input_grads, "eval": net(x_eval).detach(), "state": net.state_dict()}


def far_from_zero() -> torch.Tensor:
    """float32 activations whose mean is 1000 standard deviations away from 0."""
    return torch.randn(10, 3, 5, 5, generator=torch.Generator().manual_seed(2)) + 1000


def _worker(rank: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        result = train(AllReduceBatchNorm.convert(bn_net()), rank)
        result["float32"] = AllReduceBatchNorm2d(3)(shard(far_from_zero(), rank)).detach()
        try:
            AllReduceBatchNorm2d(3)(torch.ones(4, 3))
        except ValueError as error:
            result["wrong_size"] = str(error)
        torch.save(result, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory, data_root) -> Path:
    """One start of 2 gloo ranks for the module, shared between test processes (`once`): the float64 oracle's DDP runs,
    each the command line in both ranks, as torchrun's ranks; then `_worker`'s layers. Its folder."""

    def make(folder: Path) -> None:
        ddp = {(case, "synced"): ["strategy=ddp", "devices=2", "sync_batchnorm=true"] for case in FLOAT64_ORACLE}
        ddp["resnet18", "per_process"] = ["strategy=ddp", "devices=2"]
        layers = functools.partial(_worker, store=str(folder / "store"), results=str(folder / "result"))
        train_as_torchrun([[f"data.root={data_root}", *in_float64(FLOAT64_ORACLE[case]), *args,
                            f"hydra.run.dir={folder / case / name}"] for (case, name), args in ddp.items()],
                          folder, also=[layers])

    return once(tmp_path_factory, "sync_batchnorm_gloo", make)


@pytest.fixture(scope="module")
def two_processes(gloo_ranks: Path) -> list[dict[str, object]]:
    """What each of the 2 gloo ranks computed in `_worker`."""
    return [torch.load(gloo_ranks / f"result.{rank}", weights_only=False) for rank in range(WORLD)]


@pytest.mark.slow
def test_forward_and_input_gradients_equal_batchnorm_on_the_whole_batch(two_processes):
    one = train(bn_net(), None)
    for step in range(STEPS):
        torch.testing.assert_close(torch.cat([r["outputs"][step] for r in two_processes]), one["outputs"][step], **TOL)
        torch.testing.assert_close(torch.cat([r["input_grads"][step] for r in two_processes]), one["input_grads"][step], **TOL)


@pytest.mark.slow
def test_parameters_and_running_statistics_after_training_equal_one_process(two_processes):
    one = train(bn_net(), None)
    for result in two_processes:
        assert result["state"].keys() == one["state"].keys()
        for key, value in one["state"].items():
            torch.testing.assert_close(result["state"][key], value, **TOL, msg=key)
    assert one["state"]["5.num_batches_tracked"] == STEPS


@pytest.mark.slow
def test_eval_uses_the_synchronised_running_statistics(two_processes):
    one = train(bn_net(), None)
    torch.testing.assert_close(torch.cat([r["eval"] for r in two_processes]), one["eval"], **TOL)


@pytest.mark.slow
def test_float32_statistics_keep_their_digits_far_from_zero(two_processes):
    exact = nn.functional.batch_norm(far_from_zero().double(), None, None, training=True, eps=1e-5)
    torch.testing.assert_close(torch.cat([r["float32"] for r in two_processes]).double(), exact, rtol=0, atol=1e-3)


@pytest.mark.slow
def test_synchronised_input_of_the_wrong_size_is_refused_as_by_batchnorm(two_processes):
    assert all(r["wrong_size"] == "expected 4D input (got 2D input)" for r in two_processes)


def test_per_process_statistics_would_differ():
    """The same shards through plain BatchNorm give other outputs: the check above has teeth."""
    x, _ = batches()[0]
    net = bn_net()
    whole = net(x)
    per_shard = torch.cat([net(shard(x, rank)) for rank in range(WORLD)])
    assert (whole - per_shard).abs().max() > 1e-3


def test_without_a_process_group_it_is_plain_batchnorm():
    plain = bn_net()
    converted = AllReduceBatchNorm.convert(copy.deepcopy(plain))
    x, y = batches()[0]
    for net in (plain, converted):
        nn.functional.cross_entropy(net(x), y).backward()
    for (name, a), b in zip(plain.named_parameters(), converted.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(converted.state_dict(), plain.state_dict(), rtol=0, atol=0)


def test_cpu_plugin_converts_in_place_of_the_same_tensors_and_reverts():
    net = bn_net()
    before = {name: p for name, p in net.named_parameters()}
    state = copy.deepcopy(net.state_dict())
    synced = SyncBatchNormPlugin(cuda=False).apply(net)
    layers = [m for m in synced.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in layers] == [AllReduceBatchNorm2d, AllReduceBatchNorm1d]
    assert all(p is before[name] for name, p in synced.named_parameters()), "the optimizer keeps working on them"
    torch.testing.assert_close(synced.state_dict(), state, rtol=0, atol=0)
    reverted = SyncBatchNormPlugin(cuda=False).revert(synced)
    assert not any(isinstance(m, (AllReduceBatchNorm, nn.SyncBatchNorm)) for m in reverted.modules())
    assert [type(m) for m in reverted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [nn.BatchNorm2d, nn.BatchNorm1d]
    torch.testing.assert_close(reverted.state_dict(), state, rtol=0, atol=0)


def test_cuda_plugin_keeps_torchs_syncbatchnorm():
    synced = SyncBatchNormPlugin(cuda=True).apply(bn_net())
    layers = [m for m in synced.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in layers] == [nn.SyncBatchNorm, nn.SyncBatchNorm]
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in SyncBatchNormPlugin(cuda=True).revert(synced).modules())


LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def on_gpu(layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: tensor.cuda().to(memory_format=LAYOUTS[layout]) if tensor.dim() == 4 else tensor.cuda()


def bn_net_on_gpu(layout: str) -> nn.Module:
    return bn_net().cuda().to(memory_format=LAYOUTS[layout])


def _nccl_worker(rank: int, store: str, results: str) -> None:
    # Two ranks on the one GPU: each its own host to NCCL (tests/test_gpu_ddp.py says why).
    os.environ.update(NCCL_HOSTID=f"syncbn-rank{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            device_id=torch.device("cuda", 0))
    try:
        result = {}
        for layout in LAYOUTS:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(bn_net_on_gpu(layout))
            result[layout] = train(net, rank, on_gpu(layout))
        torch.save(result, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_gpu_ranks(tmp_path_factory) -> list[dict[str, dict[str, object]]]:
    folder = tmp_path_factory.mktemp("nccl")
    start_ranks(_nccl_worker, str(folder / "store"), str(folder / "result"), nprocs=WORLD)
    return [torch.load(folder / f"result.{rank}", weights_only=False) for rank in range(WORLD)]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_syncbatchnorm_over_nccl_equals_batchnorm_on_the_whole_batch(two_gpu_ranks, layout):
    """float64 on CUDA: no TF32, so only rounding separates them, in the layout the GPU default trains in too."""
    one = train(bn_net_on_gpu(layout), None, on_gpu(layout))
    for step in range(STEPS):
        for key in ("outputs", "input_grads"):
            torch.testing.assert_close(torch.cat([r[layout][key][step] for r in two_gpu_ranks]), one[key][step], **TOL,
                                       msg=f"{key} of step {step}")
    for key, value in one["state"].items():
        torch.testing.assert_close(two_gpu_ranks[0][layout]["state"][key], value, **TOL, msg=key)
    torch.testing.assert_close(torch.cat([r[layout]["eval"] for r in two_gpu_ranks]), one["eval"], **TOL)


# The oracle of tests/test_equivalence.py (d) in float64, where only rounding can part two ranks from one process:
# BatchNorm divides by the batch's standard deviation, which magnifies the float32 rounding of summing in another order
# (LeNet with batch norm ended 2.5e-2 of a step apart in fp32, over the 2e-2 that ReLU flips allow; 4e-13 in float64).
FLOAT64_ORACLE = {
    "lenet_bn": (*LENET, "model.net.batch_norm=true"),
    "resnet18": RESNET,
}
SAME_IN_FLOAT64 = 1e-9  # lengths of one SGD step (tests/equivalence.py)


def in_float64(args: tuple[str, ...]) -> list[str]:
    return [arg for arg in args if not arg.startswith("precision=")] + ["precision=64"]


@pytest.mark.slow
def test_sync_batchnorm_on_two_gloo_ranks_ends_where_one_process_does_in_float64(tmp_path, data_root, gloo_ranks):
    """ResNet-18's per-process statistics, too (tests/test_equivalence.py's (d)): without sync_batchnorm its two ranks
    end far from one process, parameters and running statistics, so the sync is what brings them back. The runs of
    two processes, of both models, are `gloo_ranks`'; those of one process run in this one."""
    for case, args in FLOAT64_ORACLE.items():
        result = train_here(f"data.root={data_root}", *in_float64(args), f"hydra.run.dir={tmp_path / case / 'one'}")
        assert result.returncode == 0, result.stderr[-3000:]
    for case in FLOAT64_ORACLE:
        settings = hparams(gloo_ranks / case / "synced")
        assert (settings["precision_used"], settings["world_size"]) == ("64-true", 2)
        one, synced = checkpoint(tmp_path / case / "one"), checkpoint(gloo_ranks / case / "synced")
        assert deviation(synced, one) < SAME_IN_FLOAT64, case
    one = checkpoint(tmp_path / "resnet18" / "one")
    synced, per_process = (checkpoint(gloo_ranks / "resnet18" / name) for name in ("synced", "per_process"))
    assert deviation(per_process, one) > DIFFERENT_RESULT
    # Running statistics start at mean 0, variance 1; compared with how far they moved (measured: 0.12 and 1.2e-14).
    stats = {name: running_stats(run["state_dict"]) for name, run in (("one", one), ("synced", synced),
                                                                       ("per_process", per_process))}
    start = {k: torch.zeros_like(v) if k.endswith("mean") else torch.ones_like(v) for k, v in stats["one"].items()}
    moved = distance(stats["one"], start)
    assert distance(stats["per_process"], stats["one"]) > 0.02 * moved
    assert distance(stats["synced"], stats["one"]) < SAME_IN_FLOAT64 * moved

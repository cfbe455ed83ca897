"""Two NCCL ranks on the one GPU of this machine, each a torchrun node of its own.

NCCL refuses two ranks of one host on one device ("Duplicate GPU detected"). It tells hosts apart by a
hash that `NCCL_HOSTID` sets: with a different one each, the two ranks are two hosts to NCCL, which
connects them with its socket transport over the loopback interface. That runs the whole multi-rank
GPU path (NCCL, every DDP hook, SyncBatchNorm, stopping and resuming) where a machine has one GPU.
`benchmarks/gpu_check.sh ddp2` runs this module.
"""

import os
import re
import signal
from pathlib import Path

import pytest

from src.models.lenet import LeNet
from src.models.resnet import resnet18
from tests.equivalence import checkpoint, deviation
from tests.helpers import QUICK, TorchrunNodes, hparams, run_cli, scalars, train
from tests.test_comm_hooks import BATCHES, WARMUP, powersgd_payload
from tests.test_equivalence import DIFFERENT_RESULT, LENET, RESNET
from tests.test_stopping import WAIT_S, checkpointed_epoch, wait_for
from tests.test_sync_batchnorm import SAME_IN_FLOAT64, in_float64

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TWO_RANKS = ("accelerator=gpu", "devices=1", "num_nodes=2")
HOOKS = {"ddp": "none", "ddp_fp16": "fp16", "ddp_bf16": "bf16", "ddp_powersgd": "powersgd", "ddp_powersgd_fp16": "powersgd_fp16"}
NETS = {"lenet": LeNet, "resnet18": resnet18}


def nccl_node(node: int) -> dict[str, str]:
    """Launcher `node`'s NCCL: a host of its own, reached by sockets over loopback."""
    return {"NCCL_HOSTID": f"gpu-check-node{node}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def two_ranks(run_dir: Path, *args: str) -> list[str]:
    """A run of two NCCL ranks that must succeed; their output."""
    with TorchrunNodes(2, *TWO_RANKS, *args, f"hydra.run.dir={run_dir}", node_env=nccl_node) as nodes:
        statuses = nodes.wait()
    assert statuses == [0, 0], "\n".join(log[-3000:] for log in nodes.logs)
    return nodes.logs


@pytest.mark.parametrize("model", list(NETS))
@pytest.mark.parametrize("strategy", list(HOOKS))
def test_every_hook_runs_over_nccl_and_counts_what_it_sends(tmp_path, data_root, model, strategy):
    run_dir = tmp_path / "run"
    logs = two_ranks(run_dir, *QUICK, f"model={model}", f"strategy={strategy}", f"strategy.start_powersgd_iter={WARMUP}",
                     f"trainer.limit_train_batches={BATCHES}", "trainer.log_every_n_steps=1")
    assert not any("Grad strides do not match" in log or "not counted" in log for log in logs)
    assert hparams(run_dir)["world_size"] == 2
    shapes = [p.shape for p in NETS[model]().parameters()]
    params = sum(shape.numel() for shape in shapes)
    hook = HOOKS[strategy]
    element_bytes = 2 if hook in ("fp16", "bf16", "powersgd_fp16") else 4
    expected = [params * element_bytes] * BATCHES
    if hook.startswith("powersgd"):
        expected[WARMUP:] = [powersgd_payload(rank=1, element_bytes=element_bytes, shapes=shapes)] * (BATCHES - WARMUP)
    logged = scalars(run_dir)
    assert logged["xfer/bytes_per_step"] == expected
    assert logged["xfer/compression_ratio"] == pytest.approx([params * 4 / sent for sent in expected], rel=1e-6)
    print(f"{model} {strategy}: {expected[-1]} bytes a step, compression {params * 4 / expected[-1]:.1f}x")


CASES = {  # the same first steps on one process and on two ranks; whether they must end where one process does
    "lenet": ((*LENET,), True),
    "lenet_bn_sync": ((*LENET, "model.net.batch_norm=true", "sync_batchnorm=true"), True),
    "resnet18_sync": ((*RESNET, "sync_batchnorm=true"), True),
    "resnet18_per_rank_bn": ((*RESNET,), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_end_with_the_weights_of_one_process(tmp_path, data_root, case):
    """The CPU tests' equivalence oracle (tests/test_equivalence.py, tests/test_sync_batchnorm.py) on CUDA, in float64
    (no TF32 then, and BatchNorm has only float64 rounding to magnify): SyncBatchNorm over NCCL restores one process's
    result, and per-rank BatchNorm statistics move it away (the oracle can fail)."""
    args, same = CASES[case]
    common = (f"data.root={data_root}", "accelerator=gpu", "trainer.benchmark=false", "cuda_graphs=false", *in_float64(args))
    one = run_cli("src.train", *common, f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two_ranks(tmp_path / "two", *common, "strategy=ddp")
    apart = deviation(checkpoint(tmp_path / "two"), checkpoint(tmp_path / "one"))
    print(f"{case}: two ranks end {apart:.2e} of a step from one process")
    assert apart < SAME_IN_FLOAT64 if same else apart > DIFFERENT_RESULT


# Long enough to be signalled mid-epoch: 50 epochs of 100 steps, each checkpointed in `checkpoints/last.ckpt`.
LONG = (*QUICK, "max_epochs=50", "data.batch_size=64", "trainer.limit_train_batches=100", "strategy=ddp",
        "strategy.timeout_s=60")


@pytest.mark.parametrize("model", list(NETS))
def test_sigterm_to_one_rank_stops_the_run_with_one_line_and_it_resumes(tmp_path, data_root, model):
    run_dir, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    with TorchrunNodes(2, *TWO_RANKS, *LONG, f"model={model}", f"hydra.run.dir={run_dir}", node_env=nccl_node) as nodes:
        def training() -> bool:
            for launcher in nodes.launchers:
                if launcher.poll() is not None:
                    pytest.fail(f"a launcher ended before the signal:\n{launcher.communicate()[0][-3000:]}")
            return checkpointed_epoch(last) >= 1 and len(nodes.workers()) == 2

        wait_for(training, "a checkpoint of the second epoch")
        os.kill(nodes.workers()[0], signal.SIGTERM)
        statuses = nodes.wait(timeout=WAIT_S)
    errors = [line for log in nodes.logs for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, "\n".join(log[-3000:] for log in nodes.logs)
    assert re.match(rf"error: run stopped by SIGTERM( during epoch \d+ \(step \d+\))?; {last} holds the last finished epoch",
                    errors[0]), errors[0]
    assert 0 not in statuses
    print(f"{model}: {errors[0]}")

    epoch = checkpointed_epoch(last)
    two_ranks(run_dir, *LONG, f"model={model}", f"max_epochs={epoch + 2}", "ckpt_path=last")
    assert checkpointed_epoch(last) == epoch + 1

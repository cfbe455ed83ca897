"""What a CPU can check of the GPU path: the choices made for CUDA, NCCL's environment, how its deaths are told.

The runs themselves are in tests/test_gpu.py and tests/test_gpu_ddp.py, for a machine with a GPU.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from src.launch import stops, workers
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.optim import build_optimizer
from src.strategies import ddp
from tests.helpers import QUICK, composed, train_here

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def configured_optimizer(precision: str, device: torch.device, *overrides: str, clip: float | None = None) -> torch.optim.Optimizer:
    """The optimizer the Classifier builds from `conf/optim` for a Trainer of `precision` on `device` (a stand-in)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA loss scaler on a machine without CUDA: made, and switched off
        plugin = MixedPrecision(precision, device.type)
    module = Classifier(LeNet(), build_optimizer(composed(*overrides).optim, 256))
    module._trainer = SimpleNamespace(precision_plugin=plugin, strategy=SimpleNamespace(root_device=device),
                                      gradient_clip_val=clip)
    return module.configure_optimizers()


@pytest.mark.parametrize(("optim", "precision", "device", "clip", "fused"), [
    ("sgd", "16-mixed", CUDA, None, True),
    ("adam", "16-mixed", CUDA, None, True),
    ("sgd", "bf16-mixed", CUDA, None, False),  # no loss scaler, nothing read on the host
    ("sgd", "16-mixed", CPU, None, False),
    ("sgd", "16-mixed", CUDA, 1.0, False),  # clipping needs the gradients unscaled before the step
])
def test_16_mixed_on_cuda_takes_the_fused_optimizer(optim, precision, device, clip, fused):
    """GradScaler.step reads found_inf on the host for other optimizers: a wait for the GPU every step."""
    optimizer = configured_optimizer(precision, device, f"optim={optim}", clip=clip)
    assert bool(optimizer.defaults.get("fused")) is fused
    assert optimizer.defaults["lr"] == composed(f"optim={optim}").optim.lr


def test_a_configured_foreach_is_kept():
    optimizer = configured_optimizer("16-mixed", CUDA, "+optim.foreach=true")
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults.get("fused")


def nccl_environment(cfg) -> str | None:
    """In a worker: NCCL's error handling, as the process group will read it."""
    import os

    return os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.mark.slow  # the worker is a process; this one is its launcher
def test_workers_get_nccls_watchdog_that_ends_a_timed_out_rank(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)  # and what `start` sets here goes with the test
    assert workers.start(nccl_environment, OmegaConf.create({"devices": 1}), 1) == "3"


def died(exitcode: int, pid: int = 4242) -> ChildFailedError:
    """The agent's report of rank 0 ending with `exitcode` (negative: the signal that killed it)."""
    return ChildFailedError("train", {0: ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="")})


@pytest.mark.parametrize(("overrides", "line"), [
    (("accelerator=gpu",), "rank 0 (pid 4242): a collective waited strategy.timeout_s=60 s without an answer from "
                           "another rank; run stopped"),
    (("accelerator=cpu",), "rank 0 (pid 4242) died: killed by SIGABRT; run stopped"),
    (("accelerator=gpu", "strategy.process_group_backend=gloo"), "rank 0 (pid 4242) died: killed by SIGABRT; run stopped"),
])
def test_a_rank_that_nccls_watchdog_ended_is_told_as_a_timeout(overrides, line):
    cfg = composed("strategy=ddp", "strategy.timeout_s=60", *overrides)
    failure = workers._rank_failure(died(-6), "", cfg)
    assert isinstance(failure, stops.RankFailed) and failure.line == line


def test_nccls_own_timeout_words_are_a_timeout():
    error = RuntimeError("[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: "
                         "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=60000) ran for 60042 milliseconds before timing out.")
    failure = stops.rank_failure(error, composed("strategy=ddp", "strategy.timeout_s=60"))
    assert failure is not None and failure.timed_out
    assert failure.line == "a collective waited strategy.timeout_s=60 s without an answer from another rank; run stopped"


@pytest.mark.parametrize(("device", "device_id"), [(CUDA, CUDA), (CPU, None)])
def test_a_torchrun_restart_joins_its_group_on_its_device(monkeypatch, device, device_id):
    """As Lightning 2.6 passes it: NCCL then binds the group to the device at once (one communicator, no guess)."""
    calls = []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "LOCAL_RANK": "0", "NODE_RANK": "0",
                        "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ddp, "attempt_store", lambda *args: dist.HashStore())
    strategy = ddp.CommHookDDPStrategy(process_group_backend="gloo")
    strategy.parallel_devices, strategy.cluster_environment = [device], LightningEnvironment()
    strategy.setup_distributed()
    assert "store" in calls[0] and calls[0]["device_id"] == device_id


def test_the_launching_process_makes_no_cuda_context_before_its_ranks_start(monkeypatch, tmp_path):
    """A stand-in GPU machine (CUDA counts one device, NVML describes an H100): `src.train strategy=ddp devices=1`
    names its run (precision=auto: bf16-mixed) and reaches the start of its rank without a call that initializes
    CUDA in this process, which would hold memory on the GPU for the whole run."""
    from src import sysinfo
    from src.errors import UsageError

    initialized, started = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: initialized.append("CUDA initialized"))
    monkeypatch.setattr(sysinfo, "nvml_gpus", lambda: [sysinfo.described(0, "NVIDIA H100", 80 * 2**30, 9, 0)])

    def start(task, cfg, nprocs):
        started.append((cfg.precision_used, nprocs))
        raise UsageError("the rank would start here")

    monkeypatch.setattr(workers, "start", start)
    result = train_here(*QUICK, "accelerator=gpu", "strategy=ddp", "devices=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (2, "error: the rank would start here")
    assert started == [("bf16-mixed", 1)] and initialized == []


def test_a_job_run_in_this_process_gives_its_gpu_memory_back_before_a_sweeps_next_job(monkeypatch):
    """What PyTorch's allocator kept for a one-process job would stay taken on the GPU through the later jobs."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cache emptied"))
    assert workers.launch(lambda cfg: calls.append("job") or "result", composed("accelerator=cpu")) == "result"
    assert calls == ["job", "cache emptied"]

"""Runs that need a CUDA GPU: skipped where there is none (see tests/conftest.py).

`benchmarks/gpu_check.sh` runs these on a GPU machine together with the speed measurements.
"""

import copy
import functools
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from lightning import Callback, Trainer
from omegaconf import DictConfig

from src.data.fashion_mnist import FashionMNISTDataModule
from src.fast_path import FastSteps
from src.models.lenet import LeNet
from src.models.module import WARM_STEPS, Classifier
from src.models.resnet import resnet18
from src.optim import Schedule
from tests.helpers import QUICK, REPO, hparams, scalars, train, user_env
from tests.test_sync_free import project_callbacks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
NETS = {"lenet": LeNet, "resnet18": resnet18}


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_16_mixed_on_one_gpu(tmp_path, data_root, model, strategy):
    run_dir = tmp_path / "run"
    result = train(*QUICK, f"model={model}", f"strategy={strategy}", "devices=1", "accelerator=gpu",
                   "precision=16-mixed", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    params = hparams(run_dir)
    assert params["precision_used"] == "16-mixed" and params["accelerator"] == "cuda"
    assert {"test/acc", "time/epoch_s"} <= set(scalars(run_dir))


@pytest.mark.parametrize("strategy", ["ddp_fp16", "ddp_powersgd"])
def test_one_process_of_ddp_over_nccl_runs_its_hook_on_every_bucket(tmp_path, data_root, strategy):
    """One process sends nothing, so it logs no bytes; tests/test_gpu_ddp.py counts them between two ranks."""
    run_dir = tmp_path / "run"
    result = train(*QUICK, "model=resnet18", f"strategy={strategy}", "devices=1", "accelerator=gpu",
                   "trainer.limit_train_batches=12", "strategy.start_powersgd_iter=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not counted" not in result.stderr and "Grad strides do not match" not in result.stderr
    logged = scalars(run_dir)
    assert logged["xfer/buckets_per_step_epoch"][-1] >= 1
    assert not any(tag.startswith(("xfer/bytes_per_step", "xfer/compression_ratio")) for tag in logged)


def test_channels_last_under_ddp_gets_buckets_of_its_strides(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train(*QUICK, "model=resnet18", "strategy=ddp", "devices=1", "accelerator=gpu", "channels_last=true",
                   f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Grad strides do not match" not in result.stderr


def test_the_default_on_one_gpu_uses_cuda_graphs_and_several_steps_per_batch(tmp_path, data_root):
    run_dir = tmp_path / "run"
    # 16 steps: debug=quick's 4 would make `auto` take 4 steps a batch, the largest that divides them
    result = train(*QUICK, "model=resnet18", "trainer.limit_train_batches=16", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    params = hparams(run_dir)
    assert (params["cuda_graphs"], params["steps_per_execution"]) == (1, 8)  # TensorBoard keeps bools as numbers
    assert "CUDA graph of the training step captured in" in result.stderr + result.stdout


class SyncsAreErrors(Callback):
    """CUDA's sync detector raises on every host wait from batch `after` until the epoch ends."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx >= self.after:
            torch.cuda.set_sync_debug_mode("error")
            self.checked += 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
@pytest.mark.parametrize("fast", [FastSteps(8, cuda_graphs=True), FastSteps(1, cuda_graphs=False)], ids=["graphs", "eager"])
def test_no_host_sync_in_training_steps(tmp_path, data_root, model, fast):
    """The default path (and the eager one) with the project's callbacks and the default progress bar."""
    module = Classifier(NETS[model](), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    data = FashionMNISTDataModule(root=str(data_root), batch_size=256, download=False)
    if fast.manual:
        module.use_fast_steps(fast, step_batch_size=256)
        data.steps_per_execution = fast.steps_per_execution
    syncs = SyncsAreErrors(after=WARM_STEPS + 1)  # the graph is captured within the first batches
    trainer = Trainer(
        accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=12, limit_val_batches=0, num_sanity_val_steps=0,
        precision="bf16-mixed", logger=False, enable_checkpointing=False, use_distributed_sampler=False,
        callbacks=[syncs, *project_callbacks(tmp_path)], benchmark=True,
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert syncs.checked == 12 - WARM_STEPS - 1 and trainer.global_step == 12 * fast.steps_per_execution


GRAPH_STEP, GRAPH_STEPS = 64, 8  # an epoch of 7 full batches and one of 40 images: the uneven last batch


def images_for(steps: int, data_root) -> int:
    """data.val_size that leaves `steps` - 1 full training batches and one of 40 images (whatever the copy holds)."""
    whole = FashionMNISTDataModule(root=str(data_root), val_size=0, download=False)
    whole.setup()
    return len(whole.splits["train"]) - ((steps - 1) * GRAPH_STEP + 40)


@pytest.mark.parametrize(("model", "compiled"), [("lenet", False), ("resnet18", False), ("lenet", True)])
def test_cuda_graph_steps_train_what_eager_steps_train(data_root, model, compiled, exact_cuda_math):
    """The same 24 optimizer steps, eager one per batch and as graph replays eight per batch: the same weights. Three
    epochs of 7 replayed steps and an uneven last batch (eager in both), each validated (Lightning sets the gradients
    to None before validating), under 16-mixed (the loss scaler's tensor inside the graph, the fused optimizer's step
    outside it) and a cosine schedule with warm-up. Compiled: the graph holds the compiled kernels (`cuda_graphs=true
    compile=true`), against them run eagerly."""
    torch.manual_seed(0)
    reference = Classifier(NETS[model](), functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                           schedule=Schedule("cosine", warmup=0.25))
    modules = {"eager": reference, "graphs": copy.deepcopy(reference)}
    for module in modules.values() if compiled else ():
        module.net.compile()
    modules["graphs"].use_fast_steps(FastSteps(GRAPH_STEPS, cuda_graphs=True, compiled=compiled), step_batch_size=GRAPH_STEP)
    val_size = images_for(GRAPH_STEPS, data_root)
    for name, module in modules.items():
        data = FashionMNISTDataModule(root=str(data_root), batch_size=GRAPH_STEP, val_size=val_size, download=False)
        data.steps_per_execution = module.fast_steps.steps_per_execution
        Trainer(accelerator="gpu", devices=1, max_epochs=3, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                precision="16-mixed", enable_checkpointing=False, enable_progress_bar=False, use_distributed_sampler=False,
                deterministic=True).fit(module, datamodule=data)
        assert module.trainer.global_step == 3 * GRAPH_STEPS and module.trainer.optimizers[0].defaults["fused"]
    assert modules["graphs"].graphed is not None
    for (key, a), b in zip(modules["eager"].state_dict().items(), modules["graphs"].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=key)


class HostCheckedLeNet(LeNet):
    """A user's network that checks its input on the host in every forward pass, which a CUDA graph cannot hold."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x.abs().max()).item():
            raise ValueError("non-finite input")
        return super().forward(x)


def test_a_network_that_waits_in_its_forward_pass_trains_eagerly_instead_of_in_a_graph(data_root, caplog):
    module = Classifier(HostCheckedLeNet(), functools.partial(torch.optim.SGD, lr=0.1))
    module.use_fast_steps(FastSteps(8, cuda_graphs=True), step_batch_size=64)
    data = FashionMNISTDataModule(root=str(data_root), batch_size=64, download=False)
    data.steps_per_execution = 8
    with caplog.at_level("WARNING", logger="src.models.module"):
        Trainer(accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, use_distributed_sampler=False).fit(module, datamodule=data)
    assert module.graphed is None and module.trainer.global_step == 16
    said = [r.getMessage() for r in caplog.records if r.name == "src.models.module"]
    assert len(said) == 1 and said[0].startswith("cuda_graphs: the training step cannot be captured"), said
    print(said[0])


class CountedSyncs(Callback):
    """The host's waits for the GPU from batch `after` to the end of the epoch, as CUDA's sync detector warns of them."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.syncs = 0
        self._caught: warnings.catch_warnings | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.after:
            self._caught = warnings.catch_warnings(record=True)
            self._warned = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")
        if self._caught is not None:
            self._caught.__exit__(None, None, None)
            self.syncs = sum("synchroniz" in str(warning.message) for warning in self._warned)


@pytest.mark.parametrize("fast", [FastSteps(8, cuda_graphs=True), FastSteps(1, cuda_graphs=False)], ids=["graphs", "eager"])
@pytest.mark.parametrize("foreach", [False, True], ids=["default", "foreach"])
def test_16_mixed_steps_wait_for_the_gpu_only_where_the_optimizer_is_not_fused(tmp_path, data_root, fast, foreach):
    """GradScaler.step reads found_inf on the host (`.item()`) unless the optimizer takes it on the GPU (fused, which
    the Classifier chooses under 16-mixed): an optimizer configured with `foreach` keeps the wait, as a control."""
    optimizer = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, **({"foreach": True} if foreach else {}))
    module = Classifier(LeNet(), optimizer)
    data = FashionMNISTDataModule(root=str(data_root), batch_size=256, download=False)
    if fast.manual:
        module.use_fast_steps(fast, step_batch_size=256)
        data.steps_per_execution = fast.steps_per_execution
    counted = CountedSyncs(after=WARM_STEPS + 1)
    Trainer(accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=12, limit_val_batches=0, num_sanity_val_steps=0,
            precision="16-mixed", logger=False, enable_checkpointing=False, use_distributed_sampler=False,
            callbacks=[counted, *project_callbacks(tmp_path)], benchmark=True).fit(module, datamodule=data)
    steps = (12 - WARM_STEPS - 1) * fast.steps_per_execution
    print(f"16-mixed, {'foreach' if foreach else 'default'} optimizer, {fast}: {counted.syncs} host waits in {steps} steps")
    assert counted.syncs >= steps if foreach else counted.syncs == 0


def test_a_parallel_sweep_packs_its_jobs_on_the_one_gpu(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    result = train("-m", *QUICK, "hydra/launcher=parallel", "hydra.launcher.jobs_per_gpu=2", "seed=1,2",
                   f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 jobs, 2 at a time" in result.stdout + result.stderr
    runs = [run for run in sweep.iterdir() if (run / "result.json").is_file()]
    assert len(runs) == 2 and all(hparams(run)["accelerator"] == "cuda" for run in runs)


def test_a_diverging_loss_stops_a_graphed_run_with_one_line(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train(*QUICK, "optim.lr=1e30", "trainer.limit_train_batches=6", f"hydra.run.dir={run_dir}")
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train/loss is nan at step ") and "with learning rate 1e+30" in last
    assert "Traceback" not in result.stderr and not run_dir.exists()


def cuda_and_nccl(cfg: DictConfig) -> dict[str, float]:
    """In a worker: a CUDA kernel, then an NCCL all-reduce over the agent's world of one."""
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    x = torch.full((4,), float(cfg.value), device="cuda").square()
    dist.all_reduce(x)
    return {"sum": x.sum().item(), "world": dist.get_world_size()}


SPAWNED_WORKER = """
from omegaconf import OmegaConf
from src.launch import workers
from tests.test_gpu import cuda_and_nccl
print(workers.start(cuda_and_nccl, OmegaConf.create({"devices": 1, "value": 3}), 1))
"""


def test_a_worker_the_launcher_starts_runs_cuda_and_nccl():
    result = subprocess.run([sys.executable, "-c", SPAWNED_WORKER], cwd=REPO, env=user_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "{'sum': 36.0, 'world': 1}", result.stdout

"""DDP with a communication hook picked by name (none, fp16, bf16, PowerSGD) or import path (docs/extending.md),
on every device (Lightning registers hooks only on CUDA), on a process group of its own that counts what it sends."""

import importlib
import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from src.callbacks.run_state import all_ranks
from src.errors import UsageError
from src.strategies.comm import CommMeter, Hook

# Hooks whose state is the process group.
ALL_REDUCE_HOOKS: dict[str, Hook] = {
    "none": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
HOOKS = (*ALL_REDUCE_HOOKS, "powersgd", "powersgd_fp16")
MIB = 2**20
# PowerSGD's state between steps (its generator only draws the first Q, which the saved Q replaces).
POWERSGD_STATE = ("iter", "error_dict", "p_memory_dict", "q_memory_dict")


def import_hook(path: str) -> Hook | None:
    module_name, _, name = path.rpartition(".")
    if not module_name:
        return None
    try:
        found = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
    return found if callable(found) else None


def attempt_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """Rank 0 serves the store, unless torchrun's agent already serves one there: an undocumented variable says so
    (read first: a failed bind costs a line of torch's error log), else the port being taken tells."""
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        try:
            return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
        except dist.DistNetworkError:  # the port is taken: the agent serves its store there
            pass
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def one_bucket_cap_mb(model: nn.Module) -> float:
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return float(math.ceil(grad_bytes / MIB) + 1)


def lay_out_in_backward_order(model: DistributedDataParallel, sample_shape: tuple[int, ...] | None,
                              device: torch.device) -> int:
    """DDP's buckets laid out now, as DDP itself lays them out after its first step: in the order backward makes the
    gradients, so that a bucket goes to the hook while backward goes on; and the same on a resume, because PowerSGD's
    saved state is by bucket. One backward pass of zeros, in eval mode (BatchNorm keeps its statistics), before the
    hook is registered, its gradients dropped: DDP's iterations it took (1), or 0 where the data module names no
    `sample_shape` and the buckets go in parameter order instead (backward waits for the first layer to send).
    Private: no public API lays out DDP's buckets."""
    module, training = model.module, model.module.training
    if sample_shape is None:
        model.reducer._push_all_rebuilt_params()  # private, as `_rebuild_buckets`: the parameters' order
    else:
        module.eval()
        try:
            model(torch.zeros(2, *sample_shape, device=device)).float().sum().backward()  # DDP notes the order
        finally:
            module.train(training)
    model.reducer._rebuild_buckets()  # private: no public API lays out DDP's buckets
    for param in module.parameters():
        param.grad = None
    return 0 if sample_shape is None else 1


class CommHookDDPStrategy(DDPStrategy):
    """Lightning's DDP with a named, measured hook on every device; `ddp_kwargs` (gradient_as_bucket_view, static_graph,
    find_unused_parameters) go to DistributedDataParallel."""

    def __init__(self, hook: str = "none", hook_state: Callable[..., Any] | None = None, powersgd_rank: int = 1,
                 start_powersgd_iter: int = 10, timeout_s: float = 300, process_group_backend: str | None = None,
                 bucket_cap_mb: float | None = None, **ddp_kwargs: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))
        self.hook, self.hook_state, self.timeout_s = hook, hook_state, timeout_s
        self.powersgd_rank, self.start_powersgd_iter = powersgd_rank, start_powersgd_iter
        self.bucket_cap_mb, self.ddp_kwargs = bucket_cap_mb, ddp_kwargs
        self.comm_meter: CommMeter | None = None
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        self._resumed_powersgd: list[dict[str, Any]] | None = None  # every rank's, from the checkpoint resumed
        self.warm_iterations = 0  # DDP's iterations before training (`lay_out_in_backward_order`)

    def set_world_ranks(self) -> None:
        """Called once the devices are known, before any process group: in a rank that torchrun or SLURM started, the
        launcher's `check` has not run."""
        self.check_backend(cuda=self.root_device.type == "cuda")
        super().set_world_ranks()

    def check_backend(self, cuda: bool) -> None:
        """The one check src/config.py cannot make: it needs the devices."""
        if self.process_group_backend == "nccl" and not cuda:
            raise UsageError("strategy.process_group_backend=nccl needs CUDA devices; on CPU use null or gloo")

    def backend(self) -> str:
        if dist.is_initialized():
            return dist.get_backend()
        return self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def setup_distributed(self) -> None:
        """Under torchrun, each restart attempt meets under keys of its own: the agent's store outlives a restart,
        and the dead attempt's addresses in it would fail gloo's connect."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and not dist.is_initialized():
            self.set_world_ranks()
            env = self.cluster_environment
            assert env is not None
            rank, world_size, timeout = env.global_rank(), env.world_size(), timedelta(seconds=self.timeout_s)
            store = attempt_store(env.main_address, env.main_port, rank, world_size, timeout)
            dist.init_process_group(self.backend(), store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                                    world_size=world_size, timeout=timeout,
                                    device_id=self.root_device if self.root_device.type == "cuda" else None)
        super().setup_distributed()

    def configure_ddp(self) -> None:  # Lightning's own registers a hook on CUDA only
        device_ids = self.determine_ddp_device_ids()
        with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext():  # as Lightning does
            self.model = DistributedDataParallel(self.model, device_ids=device_ids,
                                                 bucket_cap_mb=self.ddp_bucket_cap_mb(self.model), **self.ddp_kwargs)
        if self.hook.startswith("powersgd"):
            shape = getattr(self.lightning_module.trainer.datamodule, "sample_shape", None)
            self.warm_iterations = lay_out_in_backward_order(self.model, shape, self.root_device)
        self.register_hook()

    def ddp_bucket_cap_mb(self, model: nn.Module) -> float | None:
        """PowerSGD under gloo gets one bucket: its later all-reduces, from future callbacks on gloo's threads, would
        run in a different order on each rank and fail (`gloo::EnforceNotMet ... op.preamble.length`) or hang."""
        configured = self.bucket_cap_mb
        if not (self.hook.startswith("powersgd") and self.backend() == "gloo"):
            return configured
        if configured is not None and configured < one_bucket_cap_mb(model):
            rank_zero_warn(f"strategy.bucket_cap_mb={configured} is ignored: PowerSGD under gloo needs one DDP bucket")
        return max(configured or 0.0, one_bucket_cap_mb(model))

    def build_hook(self, group: dist.ProcessGroup) -> tuple[Any, Hook]:
        if self.hook in ALL_REDUCE_HOOKS:
            return group, ALL_REDUCE_HOOKS[self.hook]
        if self.hook not in HOOKS:  # a hook of your own: with its state if it keeps one, else with the process group
            return (group if self.hook_state is None else self.hook_state(process_group=group)), self.own_hook()
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=self.powersgd_rank,
                                            start_powerSGD_iter=self.start_powersgd_iter)
        if self.hook == "powersgd_fp16":
            return state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
        return state, powerSGD_hook.powerSGD_hook

    def own_hook(self) -> Hook:
        """The hook of one's own that `strategy.hook` names by its import path."""
        hook = import_hook(self.hook)
        if hook is None:
            raise UsageError(f"strategy.hook={self.hook}: no function of that name can be imported")
        return hook

    def check(self, cuda: bool) -> None:
        """What each rank would find only as it builds DDP, asked by the launcher before it starts them (a hook state
        that cannot be located has failed already, as this strategy was built): the backend must suit the devices, and a
        hook of one's own must import."""
        self.check_backend(cuda)
        if self.hook not in HOOKS:
            self.own_hook()

    def register_hook(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.comm_meter = CommMeter(device_timed=self.backend() == "nccl")
        group = self.comm_meter.new_group(self.backend(), timeout=timedelta(seconds=self.timeout_s))
        state, hook = self.build_hook(group)
        if isinstance(state, powerSGD_hook.PowerSGDState):
            self.powersgd = state
            if self._resumed_powersgd is not None and len(self._resumed_powersgd) == self.world_size:
                for key, value in move_data_to_device(self._resumed_powersgd[self.global_rank], self.root_device).items():
                    setattr(state, key, value)
        self.model.register_comm_hook(state, self.comm_meter.wrap(hook))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """With PowerSGD, every rank's state too (as tensors and numbers: read weights-only). Every rank calls this."""
        if self.powersgd is not None:
            checkpoint["powersgd"] = all_ranks({key: move_data_to_device(getattr(self.powersgd, key), "cpu")
                                                for key in POWERSGD_STATE})
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A resumed run's PowerSGD state waits for the hook, registered after this."""
        self._resumed_powersgd = checkpoint.get("powersgd")
        super().load_model_state_dict(checkpoint, strict=strict)

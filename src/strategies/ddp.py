"""DDP with gradient compression picked by name: fp16, bf16 or PowerSGD communication hooks.

Lightning registers communication hooks only on CUDA; this strategy registers them on every
device, on a process group of their own whose backend counts what they send (`CommMeter`). `none`
registers torch's plain `allreduce_hook`, which reduces exactly as DDP's built-in all-reduce does.
A hook of your own is named by its import path, `hook: my_package.hooks.my_hook`: a function
`(process_group, bucket) -> Future[Tensor]` like torch's `allreduce_hook`, or, given `hook_state`
(a Hydra partial called with `process_group=`), `(state, bucket) -> Future[Tensor]` (docs/extending.md).
"""

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

# Hooks whose state is just the process group; the PowerSGD ones keep a PowerSGDState.
ALL_REDUCE_HOOKS: dict[str, Hook] = {
    "none": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
HOOKS = (*ALL_REDUCE_HOOKS, "powersgd", "powersgd_fp16")
MIB = 2**20
# What PowerSGD carries from step to step (its generator only draws the first Q, which the saved Q then replaces).
POWERSGD_STATE = ("iter", "error_dict", "p_memory_dict", "q_memory_dict")


def import_hook(path: str) -> Hook | None:
    """The function that `path` (`package.module.function`) names, or None when there is none."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        return None
    try:
        found = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
    return found if callable(found) else None


def attempt_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store the processes meet on: rank 0 serves it, unless torchrun's agent already serves one there.

    torchrun's c10d rendezvous may lend its workers the agent's store at MASTER_ADDR:MASTER_PORT, and
    says so only in an environment variable it does not document (read first: a failed bind costs a
    line of torch's error log); where that is missing, the port being taken tells the same.
    """
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        try:
            return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
        except dist.DistNetworkError:  # the port is taken: the agent serves its store there
            pass
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def one_bucket_cap_mb(model: nn.Module) -> float:
    """A DDP bucket cap that holds every gradient of `model` in one bucket."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return float(math.ceil(grad_bytes / MIB) + 1)


class CommHookDDPStrategy(DDPStrategy):
    """Lightning's DDP with a named, measured communication hook that also runs on CPU (gloo)."""

    def __init__(
        self,
        hook: str = "none",
        hook_state: Callable[..., Any] | None = None,
        powersgd_rank: int = 1,
        start_powersgd_iter: int = 10,
        timeout_s: float = 300,
        process_group_backend: str | None = None,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))
        self.hook = hook
        self.hook_state = hook_state
        self.powersgd_rank = powersgd_rank
        self.start_powersgd_iter = start_powersgd_iter
        self.timeout_s = timeout_s
        # DistributedDataParallel's own options, passed to it in `configure_ddp`.
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.comm_meter: CommMeter | None = None
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        self._resumed_powersgd: list[dict[str, Any]] | None = None  # every rank's, from the checkpoint resumed

    def set_world_ranks(self) -> None:
        """The Trainer calls this once it has given the strategy its devices, before any process group: the one check
        the config cannot make (src/config.py makes the others), of the backend against the device."""
        if self.process_group_backend == "nccl" and self.root_device.type != "cuda":
            raise UsageError("strategy.process_group_backend=nccl needs CUDA devices; on CPU use null or gloo")
        super().set_world_ranks()

    def backend(self) -> str:
        """The process group's backend: as set, else the one torch picks for the device."""
        if dist.is_initialized():
            return dist.get_backend()
        return self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def setup_distributed(self) -> None:
        """Under torchrun, every restart attempt of the group meets under keys of its own.

        torchrun's c10d rendezvous lends its workers the launcher's store, which outlives a
        restart; the default process group's keys in it still hold the addresses of the dead
        attempt, and gloo's connect then fails. A prefix per attempt keeps the attempts apart.
        """
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and not dist.is_initialized():
            self.set_world_ranks()
            env = self.cluster_environment
            assert env is not None
            rank, world_size = env.global_rank(), env.world_size()
            timeout = timedelta(seconds=self.timeout_s)  # valid: set_world_ranks checked it
            store = attempt_store(env.main_address, env.main_port, rank, world_size, timeout)
            dist.init_process_group(self.backend(), store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                                    world_size=world_size, timeout=timeout,
                                    device_id=self.root_device if self.root_device.type == "cuda" else None)
        super().setup_distributed()

    def configure_ddp(self) -> None:
        """Wrap the model in DDP with this strategy's options, then register the hook on every device type.

        Lightning's own method registers a hook on CUDA only.
        """
        device_ids = self.determine_ddp_device_ids()
        with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext():  # as Lightning does
            self.model = DistributedDataParallel(
                self.model, device_ids=device_ids, bucket_cap_mb=self.ddp_bucket_cap_mb(self.model),
                gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph,
                find_unused_parameters=self.find_unused_parameters,
            )
        if self.hook.startswith("powersgd"):
            # PowerSGD keeps its state by bucket, and DDP would lay its buckets out anew after the first step (by the
            # order gradients came in): in a resumed run that step would find the saved state in another layout. Laid
            # out now, by the parameters' order, they stay so in every run (their all-reduces then wait for the last).
            self.model.reducer._push_all_rebuilt_params()
            self.model.reducer._rebuild_buckets()
        self.register_hook()

    def ddp_bucket_cap_mb(self, model: nn.Module) -> float | None:
        """PowerSGD under gloo gets one bucket; otherwise `bucket_cap_mb` as set.

        PowerSGD issues its second and third all-reduce of a bucket from future callbacks on
        gloo's threads. With several buckets those run concurrently and in a different order on
        each rank, which fails (`gloo::EnforceNotMet ... op.preamble.length <= op.nbytes`) or hangs.
        An explicit cap also caps DDP's first bucket, so a cap above the model's size means one bucket.
        """
        configured = self.bucket_cap_mb
        if not (self.hook.startswith("powersgd") and self.backend() == "gloo"):
            return configured
        if configured is not None and configured < one_bucket_cap_mb(model):
            rank_zero_warn(f"strategy.bucket_cap_mb={configured} is ignored: PowerSGD under gloo needs one DDP bucket")
        return max(configured or 0.0, one_bucket_cap_mb(model))

    def build_hook(self, group: dist.ProcessGroup) -> tuple[Any, Hook]:
        """The hook named by `hook` and the state it is called with."""
        if self.hook in ALL_REDUCE_HOOKS:
            return group, ALL_REDUCE_HOOKS[self.hook]
        if self.hook not in HOOKS:  # a hook of your own: with its state if it keeps one, else with the process group
            hook = import_hook(self.hook)
            if hook is None:
                raise UsageError(f"strategy.hook={self.hook}: no function of that name can be imported")
            return (group if self.hook_state is None else self.hook_state(process_group=group)), hook
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=self.start_powersgd_iter,
        )
        if self.hook == "powersgd_fp16":
            return state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
        return state, powerSGD_hook.powerSGD_hook

    def register_hook(self) -> None:
        """Register the hook on the DDP model, on a process group of its own that the meter counts."""
        assert isinstance(self.model, DistributedDataParallel)
        self.comm_meter = CommMeter(device_timed=self.backend() == "nccl")
        # The hook's own group, over the run's backend; new_group's own default timeout is 30 min.
        group = self.comm_meter.new_group(self.backend(), timeout=timedelta(seconds=self.timeout_s))
        state, hook = self.build_hook(group)
        if isinstance(state, powerSGD_hook.PowerSGDState):
            self.powersgd = state
            if self._resumed_powersgd is not None and len(self._resumed_powersgd) == self.world_size:
                for key, value in move_data_to_device(self._resumed_powersgd[self.global_rank], self.root_device).items():
                    setattr(state, key, value)
        self.model.register_comm_hook(state, self.comm_meter.wrap(hook))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """With PowerSGD, every rank's state goes into the checkpoint too: its step count, its own error feedback, its P
        and Q (tensors and numbers: checkpoints are read weights-only). Every rank calls this; rank 0 writes."""
        if self.powersgd is not None:
            checkpoint["powersgd"] = all_ranks({key: move_data_to_device(getattr(self.powersgd, key), "cpu")
                                                for key in POWERSGD_STATE})
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A resumed run's PowerSGD state waits here for the hook, which DDP's setup registers after this."""
        self._resumed_powersgd = checkpoint.get("powersgd")
        super().load_model_state_dict(checkpoint, strict=strict)

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
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.rendezvous import _create_c10d_store
from torch.nn.parallel import DistributedDataParallel

from src.errors import UsageError
from src.strategies.comm import CommMeter, Hook

# Hooks whose state is just the process group; the PowerSGD ones keep a PowerSGDState.
ALL_REDUCE_HOOKS: dict[str, Hook] = {
    "none": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
HOOKS = (*ALL_REDUCE_HOOKS, "powersgd", "powersgd_fp16")
BACKENDS = ("gloo", "nccl", "mpi")
MIB = 2**20


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        super().__init__(
            process_group_backend=process_group_backend,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        self.hook = hook
        self.hook_state = hook_state
        self.powersgd_rank = powersgd_rank
        self.start_powersgd_iter = start_powersgd_iter
        self.timeout_s = timeout_s
        self.bucket_cap_mb = bucket_cap_mb
        self.comm_meter: CommMeter | None = None

    def check_options(self) -> None:
        """Reject bad settings with one line naming the option.

        Called when the Trainer takes the strategy, before any process starts: the backend
        check needs the devices, and Hydra's `instantiate` would wrap an error raised in
        `__init__` into a multi-line traceback.
        """
        if self.hook not in HOOKS and (not isinstance(self.hook, str) or import_hook(self.hook) is None):
            raise UsageError(f"strategy.hook={self.hook} is not an option; choose one of: {', '.join(HOOKS)}, "
                             "or the import path of a hook function (package.module.function)")
        if self.hook_state is not None and self.hook in HOOKS:
            raise UsageError(f"strategy.hook_state is not allowed with strategy.hook={self.hook}; it is for a hook named by "
                             "its import path (the built-in hooks make their own state)")
        if self.hook_state is not None and not callable(self.hook_state):
            raise UsageError(f"strategy.hook_state={self.hook_state} is not allowed; it must be null or a config with "
                             "_target_ and _partial_: true (it is called with process_group=)")
        if not _is_int(self.powersgd_rank) or self.powersgd_rank < 1:
            raise UsageError(f"strategy.powersgd_rank={self.powersgd_rank} is not allowed; it must be a whole number of at least 1")
        if not _is_int(self.start_powersgd_iter) or self.start_powersgd_iter < 2:
            raise UsageError(
                f"strategy.start_powersgd_iter={self.start_powersgd_iter} is not allowed; it must be a whole number of "
                "at least 2 (PowerSGD's error feedback needs plain all-reduce steps first)"
            )
        if not _is_number(self.timeout_s) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise UsageError(f"strategy.timeout_s={self.timeout_s} is not allowed; it must be a finite number of seconds above 0")
        if self.bucket_cap_mb is not None and (not _is_number(self.bucket_cap_mb) or self.bucket_cap_mb <= 0):
            raise UsageError(f"strategy.bucket_cap_mb={self.bucket_cap_mb} is not allowed; it must be null or a number of MiB above 0")
        for key in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
            if not isinstance(self._ddp_kwargs[key], bool):
                raise UsageError(f"strategy.{key}={self._ddp_kwargs[key]} is not allowed; choose one of: true, false")
        backend = self._process_group_backend
        if backend is not None and backend not in BACKENDS:
            raise UsageError(f"strategy.process_group_backend={backend} is not an option; choose one of: null, {', '.join(BACKENDS)}")
        if backend == "nccl" and self.root_device.type != "cuda":
            raise UsageError("strategy.process_group_backend=nccl needs CUDA devices; on CPU use null or gloo")

    def _configure_launcher(self) -> None:
        self.check_options()
        self._timeout = timedelta(seconds=self.timeout_s)
        super()._configure_launcher()

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
            store = _create_c10d_store(env.main_address, env.main_port, rank, world_size, self._timeout)
            dist.init_process_group(
                self._get_process_group_backend(), store=dist.PrefixStore(f"attempt_{attempt}", store),
                rank=rank, world_size=world_size, timeout=self._timeout,
            )
        super().setup_distributed()

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        self._ddp_kwargs["bucket_cap_mb"] = self.ddp_bucket_cap_mb(model)
        return super()._setup_model(model)

    def ddp_bucket_cap_mb(self, model: nn.Module) -> float | None:
        """PowerSGD under gloo gets one bucket; otherwise `bucket_cap_mb` as set.

        PowerSGD issues its second and third all-reduce of a bucket from future callbacks on
        gloo's threads. With several buckets those run concurrently and in a different order on
        each rank, which fails (`gloo::EnforceNotMet ... op.preamble.length <= op.nbytes`) or hangs.
        An explicit cap also caps DDP's first bucket, so a cap above the model's size means one bucket.
        """
        configured = self.bucket_cap_mb
        if not (self.hook.startswith("powersgd") and self._get_process_group_backend() == "gloo"):
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
            assert hook is not None, "check_options refuses a hook that cannot be imported"
            return (group if self.hook_state is None else self.hook_state(process_group=group)), hook
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=self.start_powersgd_iter,
        )
        if self.hook == "powersgd_fp16":
            return state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
        return state, powerSGD_hook.powerSGD_hook

    def _register_ddp_hooks(self) -> None:
        """Register on every device type; Lightning's own method registers on CUDA only."""
        assert isinstance(self.model, DistributedDataParallel)
        self.comm_meter = CommMeter()
        # The hook's own group, over the run's backend, counted by the meter; new_group's own default timeout is 30 min.
        group = self.comm_meter.new_group(self._get_process_group_backend(), timeout=self._timeout)
        state, hook = self.build_hook(group)
        self.model.register_comm_hook(state, self.comm_meter.wrap(hook))

"""`strategy=dp`: one process splits each batch over the node's GPUs with nn.DataParallel.

Lightning 2 removed its `dp` strategy; this is the book's concise multi-GPU chapter in Lightning.
Lightning 1 wrapped the whole LightningModule in nn.DataParallel, so `training_step` ran inside
every replica: the replicas copied the `forward` that Lightning patches to route steps and the
root's `_device`, metrics updated there vanished with the replica, and the per-replica losses
needed `training_step_end`, which Lightning 2 no longer calls.

Here only the LightningModule's `net` is data-parallel. The steps run once, on the first GPU:
`net`'s forward scatters the batch over the GPUs, runs one replica per GPU and gathers the
logits back, so loss, accuracy and logging see the whole batch exactly as on one device.
Backward runs through the gather and the replication, which add every replica's gradient into
the one set of parameters on the first GPU; with the cross-entropy averaged over the gathered
batch that sum is the one-device gradient, also when the batch does not split evenly.

BatchNorm layers normalise with each GPU's shard and keep the first replica's running
statistics, as nn.DataParallel always does; `sync_batchnorm` needs strategy=ddp. Without CUDA
nn.DataParallel does nothing, so on CPU dp runs on one device only.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning import Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from torch import nn

from src.errors import UsageError


def _move_keys(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Rename in place the keys that start with `old` to start with `new`."""
    moved = {new + key[len(old):]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(old)]}
    state_dict.update(moved)


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load `<prefix><key>` into `<prefix>module.<key>`.

    The metadata is left alone: it is the caller's object, and it only holds format versions,
    which BatchNorm does not need when `num_batches_tracked` is present.
    """
    _move_keys(state_dict, prefix, prefix + "module.")


def _under_autocast(replica: nn.Module, dtype: torch.dtype) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cuda", dtype=dtype):
            return replica(*args, **kwargs)

    return run


class DataParallelNet(nn.DataParallel):
    """nn.DataParallel whose checkpoints carry the wrapped net's own keys (no `module.` level).

    A checkpoint written under dp therefore resumes under every other strategy, and the other way round.
    """

    def __init__(self, net: nn.Module, device_ids: Sequence[int | torch.device] | None = None) -> None:
        super().__init__(net, device_ids=device_ids)
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped net's own: its keys, and torch's per-module metadata, have no `module.` level."""
        return self.module.state_dict(*args, **kwargs)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """Run the replicas under the caller's autocast dtype.

        torch's worker threads re-enter autocast with its default dtype, float16, which would turn
        bf16-mixed into float16 on every GPU.
        """
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            replicas = [_under_autocast(replica, dtype) for replica in replicas]  # type: ignore[misc]
        return super().parallel_apply(replicas, inputs, kwargs)


class DataParallelStrategy(ParallelStrategy):
    """One process; the LightningModule's `net_attribute` module runs data-parallel over the CUDA devices."""

    strategy_name = "dp"

    def __init__(self, net_attribute: str = "net", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net_attribute = net_attribute

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "the Trainer sets parallel_devices before the strategy is used"
        return self.parallel_devices[0]

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def check_devices(self) -> None:
        """Reject what nn.DataParallel cannot do, before the run sets anything up."""
        devices = self.parallel_devices or []
        if len(devices) > 1 and any(device.type != "cuda" for device in devices):
            raise UsageError(
                f"strategy=dp devices={len(devices)} needs CUDA GPUs (nn.DataParallel splits a batch only over GPUs); "
                f"on {devices[0].type} use devices=1, or strategy=ddp for {len(devices)} processes"
            )
        # The Trainer hands a strategy its `sync_batchnorm` plugin only in this attribute; no public API says.
        if len(devices) > 1 and getattr(self, "_layer_sync", None) is not None:
            raise UsageError(
                "sync_batchnorm=true does not work with strategy=dp (each GPU's replica normalises with its own "
                "shard); use strategy=ddp"
            )

    def setup_environment(self) -> None:
        """Check the devices at the run's first step: dp starts no process, so nothing ran before it."""
        self.check_devices()
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Trainer) -> None:
        """Wrap `net_attribute` of the LightningModule, which stays the model Lightning drives."""
        super().setup(trainer)
        model = self.model
        net = getattr(model, self.net_attribute, None)
        if not isinstance(net, nn.Module):
            raise UsageError(
                f"strategy.net_attribute={self.net_attribute}: {type(model).__name__} has no nn.Module of that name"
            )
        if self.root_device.type == "cuda" and not isinstance(net, DataParallelNet):
            setattr(model, self.net_attribute, DataParallelNet(net, device_ids=self.parallel_devices))

    def teardown(self) -> None:
        module = self.lightning_module
        net = getattr(module, self.net_attribute, None) if module is not None else None
        if isinstance(net, DataParallelNet):
            setattr(module, self.net_attribute, net.module)
        super().teardown()

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor


if DataParallelStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        DataParallelStrategy.strategy_name,
        DataParallelStrategy,
        description="One process, each batch split over the GPUs by nn.DataParallel",
    )

"""`strategy=dp`: one process splits each batch over the node's GPUs with nn.DataParallel (gone from Lightning 2).
Only the module's `net` is wrapped (Lightning 1 wrapped it all, and metrics updated in replicas vanished)."""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning import Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from torch import nn

from src.errors import UsageError


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load `<prefix><key>` into `<prefix>module.<key>`; the metadata (format versions only) is the caller's."""
    keys = [key for key in state_dict if key.startswith(prefix)]
    state_dict.update({prefix + "module." + key[len(prefix):]: state_dict.pop(key) for key in keys})


def _under_autocast(replica: nn.Module, dtype: torch.dtype) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cuda", dtype=dtype):
            return replica(*args, **kwargs)

    return run


class DataParallelNet(nn.DataParallel):
    """Checkpoints carry the wrapped net's own keys (no `module.` level), so they resume under every strategy."""

    def __init__(self, net: nn.Module, device_ids: Sequence[int | torch.device] | None = None) -> None:
        super().__init__(net, device_ids=device_ids)
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """Under the caller's autocast dtype: torch's worker threads re-enter autocast with float16."""
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            replicas = [_under_autocast(replica, dtype) for replica in replicas]  # type: ignore[misc]
        return super().parallel_apply(replicas, inputs, kwargs)


class DataParallelStrategy(ParallelStrategy):
    """One process; the LightningModule's `net_attribute` module runs data-parallel over the CUDA devices."""

    strategy_name = "dp"
    # One process, whatever a launcher's environment variables say (they would set the cluster environment's ranks).
    global_rank = local_rank = node_rank = 0
    world_size = 1

    def __init__(self, net_attribute: str = "net", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net_attribute = net_attribute

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "the Trainer sets parallel_devices before the strategy is used"
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # a new dict each time, as Lightning's: its readers may change it

    def check_devices(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) > 1 and any(device.type != "cuda" for device in devices):
            raise UsageError(
                f"strategy=dp devices={len(devices)} needs CUDA GPUs (nn.DataParallel splits a batch only over GPUs); "
                f"on {devices[0].type} use devices=1, or strategy=ddp for {len(devices)} processes"
            )

    def setup_environment(self) -> None:
        self.check_devices()  # dp starts no process, so nothing ran before this
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)  # the LightningModule stays the model Lightning drives
        model = self.model
        net = getattr(model, self.net_attribute, None)
        if not isinstance(net, nn.Module):
            raise UsageError(f"strategy.net_attribute={self.net_attribute}: {type(model).__name__} has no nn.Module "
                             "of that name")
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
    StrategyRegistry.register(DataParallelStrategy.strategy_name, DataParallelStrategy,
                              description="One process, each batch split over the GPUs by nn.DataParallel")

"""`sync_batchnorm=true` on every device: BatchNorm statistics over the global batch. torch's nn.SyncBatchNorm refuses
CPU input (and DDP a CPU model holding one), so `AllReduceBatchNorm1d/2d/3d` add their per-channel sums over the
processes with a differentiable all-reduce. On CUDA the plugin keeps torch's."""

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn

BatchNorm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d


class _AllReduceSum(torch.autograd.Function):
    """Sum over the processes; backward sums the output gradients likewise, as every output depends on every input.
    (torch.distributed.nn.functional.all_reduce does the same but is deprecated.)"""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None


def _layer_like(layer_class: type[BatchNorm], module: BatchNorm, **kwargs: Any) -> BatchNorm:
    """A `layer_class` with the options and mode of `module`, sharing its parameters and buffers."""
    if module.affine and module.bias is None:  # torch 2.11 has no `bias` option: an affine layer has one there
        kwargs["bias"] = False
    layer = layer_class(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                        **kwargs)
    if module.affine:
        layer.weight, layer.bias = module.weight, module.bias
    layer.running_mean, layer.running_var = module.running_mean, module.running_var
    layer.num_batches_tracked, layer.training = module.num_batches_tracked, module.training
    return layer


class AllReduceBatchNorm:
    """BatchNorm over the batch of all processes of `process_group` (default: all) in training, as torch's
    SyncBatchNorm. One class per input size."""

    input_dims: tuple[int, ...]  # the input dimensions the torch class it extends accepts

    def __init__(self, *args: Any, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        if dist.get_world_size(group) == 1:
            return super().forward(input)
        if input.dim() not in self.input_dims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self.input_dims)} input (got {input.dim()}D input)")
        return self.synchronised(input, group)

    def synchronised(self, input: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = input.to(torch.promote_types(input.dtype, torch.float32))  # float16 and bfloat16 statistics in float32
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = x.new_full((1,), x.numel() / x.size(1))
        totals = _AllReduceSum.apply(torch.cat([x.sum(dims), local_count]), group)
        count = totals[-1]
        mean = totals[:-1] / count
        centered = x - mean.view(shape)
        # A second all-reduce of squared deviations: E[x^2] - E[x]^2 loses digits when |mean| >> std.
        var = _AllReduceSum.apply((centered * centered).sum(dims), group) / count
        if self.track_running_stats:
            self.update_running_stats(mean.detach(), var.detach(), count.item())
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def update_running_stats(self, mean: Tensor, var: Tensor, count: float) -> None:
        assert self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    @staticmethod
    def convert(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Every BatchNorm layer of `module` replaced by its AllReduceBatchNorm class, sharing parameters and buffers."""
        return _swap_layers(module, SYNCED, process_group=process_group)

    @staticmethod
    def revert(module: nn.Module) -> nn.Module:
        return _swap_layers(module, {synced: plain for plain, synced in SYNCED.items()})


class AllReduceBatchNorm1d(AllReduceBatchNorm, nn.BatchNorm1d):
    input_dims = (2, 3)


class AllReduceBatchNorm2d(AllReduceBatchNorm, nn.BatchNorm2d):
    input_dims = (4,)


class AllReduceBatchNorm3d(AllReduceBatchNorm, nn.BatchNorm3d):
    input_dims = (5,)


SYNCED: dict[type[BatchNorm], type[BatchNorm]] = {
    nn.BatchNorm1d: AllReduceBatchNorm1d, nn.BatchNorm2d: AllReduceBatchNorm2d, nn.BatchNorm3d: AllReduceBatchNorm3d,
}


def _swap_layers(module: nn.Module, classes: dict[type[BatchNorm], type[BatchNorm]], **kwargs: Any) -> nn.Module:
    """`module` with each layer that is an instance of a key of `classes` made one of its value class."""
    new_class = next((new for old, new in classes.items() if isinstance(module, old)), None)
    swapped = _layer_like(new_class, module, **kwargs) if new_class not in (None, type(module)) else module
    for name, child in module.named_children():
        swapped.add_module(name, _swap_layers(child, classes, **kwargs))
    return swapped


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's sync-BatchNorm plugin for CUDA and CPU. `cuda` says where the model will run: DDP converts the
    layers before it moves the model to its device."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def apply(self, model: nn.Module) -> nn.Module:
        return super().apply(model) if self.cuda else AllReduceBatchNorm.convert(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return super().revert(AllReduceBatchNorm.revert(model))

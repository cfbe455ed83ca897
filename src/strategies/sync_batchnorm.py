"""`sync_batchnorm=true` on every device: BatchNorm statistics over the global batch, also on CPU.

torch's nn.SyncBatchNorm refuses CPU input, and DDP refuses any nn.SyncBatchNorm in a CPU model,
so Lightning's `sync_batchnorm=True` fails under DDP on CPU (gloo). `AllReduceBatchNorm` is a
BatchNorm layer (`AllReduceBatchNorm1d/2d/3d`, each a torch `nn.BatchNorm1d/2d/3d`) that adds its
per-channel sums over all processes with a differentiable all-reduce, whose backward adds the
gradients of every process's loss, as torch's CUDA kernels do. On CUDA the plugin keeps torch's
SyncBatchNorm.
"""

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn

BatchNorm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d


class _AllReduceSum(torch.autograd.Function):
    """Sum over the processes of `group`; backward sums the output gradients the same way.

    Every process's output depends on every process's input, so the gradient of one input is
    the sum of all processes' output gradients. (torch.distributed.nn.functional.all_reduce
    does the same but is deprecated.)
    """

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


def all_reduce(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Differentiable sum of `tensor` over all processes of `group`."""
    return _AllReduceSum.apply(tensor, group)


def _copy_state(source: BatchNorm, target: BatchNorm) -> BatchNorm:
    """Give `target` the parameters, buffers and mode of `source` (the same tensors, not copies)."""
    if source.affine:
        target.weight = source.weight
        target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.training = source.training
    return target


def _layer_like(layer_class: type[BatchNorm], module: BatchNorm, **kwargs: Any) -> BatchNorm:
    """A `layer_class` with the options of `module`, sharing its parameters and buffers."""
    if module.affine and module.bias is None:  # torch 2.11 has no `bias` option: an affine layer has one there
        kwargs["bias"] = False
    layer = layer_class(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                        **kwargs)
    return _copy_state(module, layer)


class AllReduceBatchNorm:
    """BatchNorm over the batch of all processes of `process_group` (default: all), on any device.

    In training, inside a process group of several processes, it normalises with the mean and
    biased variance of the global batch and updates the running statistics as BatchNorm does
    (unbiased variance; momentum, or the cumulative average when momentum is None). Otherwise,
    as torch's SyncBatchNorm, it is plain BatchNorm. One class per input size, as torch's.
    """

    input_dims: tuple[int, ...]  # the input dimensions the torch class it extends accepts

    def __init__(self, *args: Any, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and self.world_size() > 1):
            return super().forward(input)
        if input.dim() not in self.input_dims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self.input_dims)} input (got {input.dim()}D input)")
        return self.synchronised(input)

    def group(self) -> dist.ProcessGroup:
        return self.process_group or dist.group.WORLD

    def world_size(self) -> int:
        return dist.get_world_size(self.group())

    def synchronised(self, input: Tensor) -> Tensor:
        x = input.to(torch.promote_types(input.dtype, torch.float32))  # float16 and bfloat16 statistics in float32
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = x.new_full((1,), x.numel() / x.size(1))
        totals = all_reduce(torch.cat([x.sum(dims), local_count]), group=self.group())
        count = totals[-1]
        mean = totals[:-1] / count
        centered = x - mean.view(shape)
        # A second all-reduce of squared deviations: E[x^2] - E[x]^2 loses digits when |mean| >> std.
        var = all_reduce((centered * centered).sum(dims), group=self.group()) / count
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
        """Replace every BatchNorm layer of `module` by its AllReduceBatchNorm class, sharing its parameters and buffers."""
        converted = module
        synced = next((s for plain, s in SYNCED.items() if isinstance(module, plain)), None)
        if synced is not None and not isinstance(module, AllReduceBatchNorm):
            converted = _layer_like(synced, module, process_group=process_group)
        for name, child in module.named_children():
            converted.add_module(name, AllReduceBatchNorm.convert(child, process_group))
        return converted

    @staticmethod
    def revert(module: nn.Module) -> nn.Module:
        """Undo `convert`: the plain torch BatchNorm layers of the same input sizes."""
        converted = module
        plain = next((p for p, synced in SYNCED.items() if isinstance(module, synced)), None)
        if plain is not None:
            converted = _layer_like(plain, module)
        for name, child in module.named_children():
            converted.add_module(name, AllReduceBatchNorm.revert(child))
        return converted


class AllReduceBatchNorm1d(AllReduceBatchNorm, nn.BatchNorm1d):
    input_dims = (2, 3)


class AllReduceBatchNorm2d(AllReduceBatchNorm, nn.BatchNorm2d):
    input_dims = (4,)


class AllReduceBatchNorm3d(AllReduceBatchNorm, nn.BatchNorm3d):
    input_dims = (5,)


SYNCED: dict[type[BatchNorm], type[BatchNorm]] = {
    nn.BatchNorm1d: AllReduceBatchNorm1d, nn.BatchNorm2d: AllReduceBatchNorm2d, nn.BatchNorm3d: AllReduceBatchNorm3d,
}


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's sync-BatchNorm plugin for CUDA and CPU: `Trainer(plugins=[SyncBatchNormPlugin(cuda=...)])`.

    `cuda` says where the model will run: DDP converts the layers before it moves the model to
    its device, so the layers' device cannot tell yet.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def apply(self, model: nn.Module) -> nn.Module:
        return super().apply(model) if self.cuda else AllReduceBatchNorm.convert(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return super().revert(AllReduceBatchNorm.revert(model))

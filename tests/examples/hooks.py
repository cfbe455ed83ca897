"""New DDP communication hooks: a function `(process_group, bucket) -> Future[Tensor]`, or
`(state, bucket) -> Future[Tensor]` for a hook that keeps state between calls.

DDP calls it once per gradient bucket; the future's value replaces the bucket's gradients on
every process. `CommHookDDPStrategy` passes the process group it made for the hook, so that
`xfer/*` counts what the hook's `dist.all_reduce` calls send.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def fp16_allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's mean over the processes, sent as float16: half the bytes of fp32.

    Divides before the sum, so that large gradients do not overflow float16's range.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(group.size())
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(future.value()[0])
        return buffer

    return work.get_future().then(decompress)


class WarmupState:
    """The state of `fp16_after_warmup_hook`: its process group and the optimizer steps seen so far."""

    def __init__(self, process_group: dist.ProcessGroup, warmup_steps: int) -> None:
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.step = 0


def fp16_after_warmup_hook(state: WarmupState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain fp32 all-reduce for the first `warmup_steps` optimizer steps, then float16, as PowerSGD warms up."""
    hook = default_hooks.allreduce_hook if state.step < state.warmup_steps else fp16_allreduce_hook
    if bucket.is_last():
        state.step += 1
    return hook(state.process_group, bucket)

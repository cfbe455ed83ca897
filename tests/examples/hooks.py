"""A new DDP communication hook: a function `(process_group, bucket) -> Future[Tensor]`.

DDP calls it once per gradient bucket; the future's value replaces the bucket's gradients on
every process. `CommHookDDPStrategy` passes the process group it made for the hook, so that
`comm/*` counts what the hook's `dist.all_reduce` calls send.
"""

import torch
import torch.distributed as dist


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

"""The settings that make the same training faster on the hardware at hand.

- `precision=auto`: what `python -m src.sysinfo` recommends for the devices in use: bf16 autocast
  where they compute bf16 natively (CPUs with AVX512-BF16 or AMX, GPUs from Ampere on), fp16
  autocast on older GPUs with tensor cores, fp32 elsewhere.
- `channels_last=true`: weights and inputs in NHWC order, the layout oneDNN and cuDNN convolve
  fastest; the numbers are the same.
- `compile=true`: `torch.compile` on the network, in place, so that checkpoints keep their keys.
- `trainer.benchmark=true`: cuDNN times its convolution algorithms once and keeps the fastest.

`benchmarks/speed.py` measures each; docs/results.md has the figures.
"""

import torch
from torch import nn

from src.sysinfo import cpu_has_bf16, gpu_info, recommend_precision


def auto_precision(accelerator: str) -> str:
    gpus = [gpu_info(i) for i in range(torch.cuda.device_count())] if accelerator == "gpu" else []
    return recommend_precision(gpus, cpu_has_bf16())[0]


def cudnn_benchmark(benchmark: bool | None, deterministic: object) -> bool:
    """`trainer.benchmark`, on by default: Lightning's default leaves cuDNN's autotuning off."""
    return (not deterministic) if benchmark is None else benchmark


def speed_up(net: nn.Module, channels_last: bool, compile: bool) -> nn.Module:
    """Apply the layout and compilation settings to `net` in place, before any device or wrapper sees it."""
    if channels_last:
        net.to(memory_format=torch.channels_last)
    if compile:
        net.compile()
    return net

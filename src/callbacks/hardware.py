"""How much of the hardware a run used: `usage/tflops_per_s` per device, `usage/mfu`, `usage/peak_memory_mib`. A step's
FLOPs are counted once, on a meta-device copy; Lightning's ThroughputMonitor would synchronize CUDA after every batch.
"""

import contextlib
import copy
import logging
import resource
import statistics
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from torch import nn

from src.callbacks import RunFigures, last_trained, log_scalars
from src.callbacks.timing import EpochTimer

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
                  "16-true": torch.float16, "32-true": torch.float32, "64-true": torch.float64}
MIB = 2**20
PROC_STATUS, PROC_CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def count_flops(net: nn.Module, sample_shape: Sequence[int], batch: int, precision: Any = None) -> int:
    """Of a forward and backward pass over `batch` samples, under `precision` (a Lightning plugin) if given."""
    meta = copy.deepcopy(net).to("meta")
    for module in meta.modules():
        # A synchronized BatchNorm cannot all-reduce meta tensors; the counter counts no normalisation anyway.
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)):
            module.eval()
    images, context = torch.empty(batch, *sample_shape, device="meta"), contextlib.nullcontext()
    if precision is not None:
        images, context = precision.convert_input(images), precision.forward_context()
    with context:
        # `forward`, not the call: a compiled network would compile its copy; hooks on the network itself do no FLOPs.
        return measure_flops(meta, lambda: meta.forward(images), lambda out: out.float().sum())


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        return None, f"precision {precision} has no compute dtype in the peak table"
    if device.type != "cuda":
        return None, f"Lightning's table of peak FLOP/s lists GPUs and TPUs, not a {device.type.upper()}"
    with warnings.catch_warnings():  # Lightning warns about an unlisted GPU; the reason is returned instead
        warnings.simplefilter("ignore")
        peak = get_available_flops(device, dtype)
    if peak is None:
        return None, f"Lightning's table of peak FLOP/s has no {precision} entry for {torch.cuda.get_device_name(device)}"
    return float(peak), ""


def reset_peak_memory(device: torch.device) -> None:
    """From here on: a sequential sweep's or search's earlier jobs ran in this process too. On CPU, Linux keeps the
    process's peak resident size (VmHWM) until told (`/proc/self/clear_refs`); elsewhere it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        PROC_CLEAR_REFS.write_text("5")


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: the allocator's peak of allocated memory; elsewhere the process's peak resident size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    with contextlib.suppress(OSError, StopIteration, ValueError):
        return int(next(line for line in PROC_STATUS.read_text().splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / MIB if sys.platform == "darwin" else peak / 1024


class HardwareUse(RunFigures):
    """Comes after EpochTimer (conf/callbacks/default.yaml), whose figures it reads. A network it cannot count logs
    memory alone, with the reason in one line; MFU needs the device in Lightning's table of peaks."""

    def __init__(self) -> None:
        self.flops_per_sample: float | None = None
        self.peak: float | None = None
        self.tflops_per_s: list[float] = []
        self.mfu: list[float] = []
        self.peak_memory: float | None = None
        self._epochs = 0  # the timer's epochs already turned into figures

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = pl_module.device
        reset_peak_memory(device)
        self._epochs = len(self._samples_per_s(trainer))
        shape = getattr(trainer.datamodule, "sample_shape", None)
        batch = getattr(trainer.datamodule, "batch_size", 0) // trainer.world_size
        counted, why = 0, "the data module names no sample_shape" if shape is None else "the data module names no batch_size"
        if shape is not None and batch > 0:
            try:
                counted = count_flops(getattr(pl_module, "net", pl_module), shape, batch, trainer.precision_plugin)
                why = "" if counted else "torch's FLOP counter found no matrix product or convolution"
            except Exception as error:  # noqa: BLE001  a network the counter cannot run leaves the run untouched
                why = f"counting on the meta device failed ({type(error).__name__}: {' '.join(str(error).split())[:200]})"
        self.flops_per_sample = counted / batch if counted else None
        self.peak, no_peak = peak_flops(device, str(trainer.precision))
        if not trainer.is_global_zero:
            return
        if counted:
            log.info(f"a training step (forward and backward pass) is {counted / batch / 1e6:.4g} MFLOP an image, "
                     f"{counted / 1e9:.4g} GFLOP a process at {batch} images (torch.utils.flop_counter)")
        else:
            log.info(f"usage/tflops_per_s and usage/mfu are not logged: {why}")
        if counted and self.peak is None:
            log.info(f"usage/mfu is not logged: {no_peak}")

    @staticmethod
    def _samples_per_s(trainer: Trainer) -> list[float]:
        """The EpochTimer's figures so far; none where the run has no EpochTimer."""
        timer = next((c for c in trainer.callbacks if isinstance(c, EpochTimer)), None)
        return timer.samples_per_s if timer is not None else []

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        samples_per_s = self._samples_per_s(trainer)
        figures = {}
        if len(samples_per_s) > self._epochs and self.flops_per_sample:
            self._epochs = len(samples_per_s)
            per_device = self.flops_per_sample * samples_per_s[-1] / (trainer.num_devices * trainer.num_nodes)
            self.tflops_per_s.append(per_device / 1e12)
            figures["usage/tflops_per_s"] = self.tflops_per_s[-1]
            if self.peak:
                self.mfu.append(per_device / self.peak)
                figures["usage/mfu"] = self.mfu[-1]
        self.peak_memory = peak_memory_mib(pl_module.device)
        figures["usage/peak_memory_mib"] = self.peak_memory
        log_scalars(trainer, figures)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        medians = {f"{name}_median": value for name, value in self.summary().items() if name != "usage/peak_memory_mib"}
        if medians:
            epoch, step = last_trained(trainer)
            log_scalars(trainer, medians, step, epoch)

    def state_dict(self) -> dict[str, Any]:
        """A resumed run's medians cover all its epochs."""
        return {"tflops_per_s": list(self.tflops_per_s), "mfu": list(self.mfu), "peak_memory": self.peak_memory}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.not_taken_up:
            return
        self.tflops_per_s, self.mfu, self.peak_memory = list(state["tflops_per_s"]), list(state["mfu"]), state["peak_memory"]

    def summary(self) -> dict[str, float]:
        """Medians over the epochs, and peak memory, of what was measured."""
        figures = {"usage/tflops_per_s": self.tflops_per_s, "usage/mfu": self.mfu}
        summary = {name: statistics.median(values) for name, values in figures.items() if values}
        if self.peak_memory is not None:
            summary["usage/peak_memory_mib"] = self.peak_memory
        return summary

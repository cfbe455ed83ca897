"""What each training epoch competed with, so that a speed figure taken on a busy machine says so: the process's CPU
seconds against its wall seconds times its threads (`usage/cpu_share`), the runnable tasks on the machine beyond the
run's own (`usage/others_runnable`, Linux), and on a GPU its utilization (`usage/gpu_util`, through NVML)."""

import os
import statistics
import time
from collections.abc import Callable

import torch
from lightning import LightningModule, Trainer

from src.callbacks import RunFigures, log_scalars
from src.launch.load import runnable_tasks
from src.sysinfo import NvmlUtilization

SAMPLE_EVERY_S = 0.5  # at a batch end at most this often: a read of /proc/stat costs tens of microseconds
OTHERS_DISTURB = 0.5  # mean runnable tasks beyond the run's own, with the cores then oversubscribed
# ... and the process got less of its threads' CPU time than this: a quiet 2-rank DDP run on 2 cores counts about one
# runnable task beyond its compute threads (its communication) and got 0.92-0.97; beside one busy loop, 0.23-0.41.
SHARE_DISTURBED = 0.8


def is_disturbed(others: float | None, own: int, cores: int, cpu_share: float) -> bool:
    """Other work ran beside the run for half a core on average, the run's threads and it wanted more cores than the
    machine has, and the run got less CPU time than its threads could use: the epoch time measured the machine's load
    as well as the setting."""
    return (others is not None and others >= OTHERS_DISTURB and own + others > cores
            and cpu_share < SHARE_DISTURBED)


class EpochLoad:
    """One epoch's samples; the figures at its end. Apart from Lightning, so that tests feed it known samples."""

    def __init__(self, own: int, threads: int, cores: int, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.own, self.threads, self.cores, self.clock, self.cpu_clock = own, threads, cores, clock, cpu_clock
        self.others: list[int] = []
        self.gpu: list[float] = []
        self.started, self.cpu_started = clock(), cpu_clock()
        self.sampled_at = self.started

    def due(self) -> bool:
        return self.clock() - self.sampled_at >= SAMPLE_EVERY_S

    def sample(self, runnable: int | None, gpu_util: float | None = None) -> None:
        self.sampled_at = self.clock()
        if runnable is not None:
            self.others.append(max(0, runnable - self.own))
        if gpu_util is not None:
            self.gpu.append(gpu_util)

    def figures(self) -> dict[str, float]:
        wall, cpu = self.clock() - self.started, self.cpu_clock() - self.cpu_started
        others = statistics.mean(self.others) if self.others else None
        share = cpu / (wall * self.threads) if wall > 0 else 1.0
        figures = {"usage/cpu_share": share,
                   "usage/disturbed": float(is_disturbed(others, self.own, self.cores, share))}
        if others is not None:
            figures["usage/others_runnable"] = others
        if self.gpu:
            figures["usage/gpu_util"] = statistics.mean(self.gpu)
        return figures


class Disturbance(RunFigures):
    """Logs each epoch's figures, and keeps which epochs were disturbed for the result line (`verdict`) and a resumed
    run. The run's own tasks are its processes on this node times their threads."""

    def __init__(self) -> None:
        self.disturbed: list[bool] = []
        self._epoch: EpochLoad | None = None
        self._gpu: NvmlUtilization | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            self._gpu = NvmlUtilization(pl_module.device.index or 0)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        threads = torch.get_num_threads()
        own = trainer.world_size // max(1, trainer.num_nodes) * threads
        self._epoch = EpochLoad(own, threads, os.cpu_count() or 1)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A run resumed mid-epoch gets no `on_train_epoch_start`."""
        self.on_train_epoch_start(trainer, pl_module)

    def _sample(self) -> None:
        if self._epoch is not None:
            self._epoch.sample(runnable_tasks(), self._gpu.read() if self._gpu else None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._epoch is not None and self._epoch.due():
            self._sample()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._epoch is None:
            return
        self._sample()
        figures = self._epoch.figures()
        self.disturbed.append(bool(figures["usage/disturbed"]))
        log_scalars(trainer, figures)
        self._epoch = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def verdict(self) -> str:
        """The result line's part, where some epoch was disturbed."""
        count = sum(self.disturbed)
        if not count:
            return ""
        return (f"{count} of {len(self.disturbed)} epoch times disturbed: other work ran beside the run "
                "(usage/others_runnable in TensorBoard); time settings against each other on a quiet machine")

    def state_dict(self) -> dict[str, list[bool]]:
        return {"disturbed": list(self.disturbed)}

    def load_state_dict(self, state: dict[str, list[bool]]) -> None:
        if not self.not_taken_up:
            self.disturbed = [bool(flag) for flag in state["disturbed"]]

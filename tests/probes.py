"""Callbacks that show, from inside a run's processes, what they see (`+callbacks.probe._target_=tests.probes.ShowVariable`),
and DDP hooks that show what DDP runs (`strategy.hook=tests.probes.noted_allreduce_hook`)."""

import os
import time

import torch
import torch.distributed as dist
from lightning import Callback, LightningModule, Trainer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

HOOK_NOTES = "HOOK_NOTES"  # the environment variable naming the file noted_allreduce_hook appends to
HOOK_SLEEP_S = 0.02  # what sleeping_allreduce_hook waits before it all-reduces


class ShowVariable(Callback):
    """Writes `<name>=<value> rank <r>` to standard output from every process as training starts."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # One write: the processes share one output, and a print may write its line and its end apart.
        os.write(1, f"{self.name}={os.environ.get(self.name)} rank {trainer.global_rank}\n".encode())


def noted_allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's plain all-reduce hook that first appends a line with the bucket's size to the file `$HOOK_NOTES` names."""
    with open(os.environ[HOOK_NOTES], "a") as notes:
        notes.write(f"{bucket.buffer().numel()}\n")
    return default_hooks.allreduce_hook(process_group, bucket)


def sleeping_allreduce_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's plain all-reduce hook after a sleep of HOOK_SLEEP_S: a hook that takes at least that long, on any
    machine, however loaded."""
    time.sleep(HOOK_SLEEP_S)
    return default_hooks.allreduce_hook(process_group, bucket)


class ShowPlacement(Callback):
    """Writes `placement rank <r>: cores=<c,...> threads=<n> CUDA_VISIBLE_DEVICES=<v> pid=<pid>` from every process as
    training starts: the cores it may run on, torch's threads, the GPUs it sees, and which process it is."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        line = (f"placement rank {trainer.global_rank}: cores={cores} threads={torch.get_num_threads()} "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} pid={os.getpid()}\n")
        os.write(1, line.encode())

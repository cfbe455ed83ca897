"""Which process this is: its rank, its cores, and who started it (a person, torch's elastic agent, torchrun or
SLURM)."""

import os
from datetime import datetime


def external_rank() -> str | None:
    """The global rank torchrun or SLURM's srun gave this process; None where a person or `src.launch.workers` started
    it. Told apart as Lightning does: torchrun's four variables, or SLURM's task count outside an interactive job."""
    if {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= os.environ.keys():
        return os.environ["RANK"]
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return os.environ.get("SLURM_PROCID")
    return None


def is_rank_zero() -> bool:
    """True in the process that speaks and writes for the run, where no Trainer is at hand to ask."""
    return external_rank() in (None, "0")


def rank_argv(argv: list[str]) -> list[str]:
    """Under torchrun or SLURM every process runs the command line: only rank 0 writes `train.log`."""
    rank = external_rank()
    return argv if rank in (None, "0") else [*argv, f"hydra.job.name=train_rank_{rank}"]


def run_stamp() -> str:
    """The run folder's stamp: the launcher's run id, the same on every node (their clocks differ), else the time."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def usable_cores() -> list[int]:
    """This process's affinity where the system tells it (`taskset`, SLURM or a parallel sweep narrow it), else all."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))

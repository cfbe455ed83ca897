"""Which process this is: its rank, and who started it (a person, torch's elastic agent, torchrun or SLURM)."""

import os
from datetime import datetime



def external_rank() -> str | None:
    """The global rank that torchrun or SLURM's srun gave this process, starting every process of the run themselves;
    None where a person (or this project's own launcher, `src.launch.workers`) did. Told apart as Lightning tells its
    cluster environments apart: torchrun's four variables, or SLURM's task count outside an interactive job."""
    if {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= os.environ.keys():
        return os.environ["RANK"]
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return os.environ.get("SLURM_PROCID")
    return None


def is_rank_zero() -> bool:
    """True in the run's first process (global rank 0), the one that speaks and writes for the run, where no Trainer
    is at hand to ask (`trainer.is_global_zero`)."""
    return external_rank() in (None, "0")


def rank_argv(argv: list[str]) -> list[str]:
    """argv for this process: under torchrun or SLURM every process runs the command line, and only rank 0 writes
    the run's records and `train.log`; the others log under their own names."""
    rank = external_rank()
    if rank in (None, "0"):
        return argv
    return [*argv, f"hydra.job.name=train_rank_{rank}"]


def run_stamp() -> str:
    """The run folder's stamp, the same in every process of a run started by torchrun or SLURM.

    Processes on several nodes start at slightly different times, so a clock reading would
    give each its own folder; the launcher's run id names the run instead.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")

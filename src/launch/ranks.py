"""Which process this is: its rank, and who started it (a person, torch's elastic agent, torchrun or SLURM)."""

import os
from datetime import datetime

from lightning_utilities.core.rank_zero import rank_zero_only  # Lightning's, without importing Lightning


# Where Lightning reads a process's rank at import, in its order.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def is_rank_zero() -> bool:
    """True in the run's first process (global rank 0), the one that speaks and writes for the run.

    The one place to ask "am I rank zero" where no Trainer is at hand: entry points, config
    checks, the config file, error reports. It reads Lightning's own record of the rank, taken
    from the launcher's environment (RANK, LOCAL_RANK, SLURM_PROCID) at import and set to the
    global rank once the strategy knows it, so it agrees with Lightning's `rank_zero_only`
    functions. Where a trainer is at hand (callbacks, after `Trainer.fit`), ask Lightning's
    `trainer.is_global_zero` instead.
    """
    rank = getattr(rank_zero_only, "rank", None)  # set once Lightning is imported, which entry points leave until needed
    if rank is None:  # as Lightning will read it
        rank = next((int(os.environ[name]) for name in RANK_VARIABLES if name in os.environ), 0)
    return rank == 0


def external_rank() -> str | None:
    """The global rank given by torchrun or SLURM, which start every process themselves."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID")


def rank_argv(argv: list[str]) -> list[str]:
    """argv for this process: under torchrun or SLURM every process runs the command line, and
    only rank 0 writes the config and `train.log`; the others log under their own names."""
    rank = external_rank()
    if rank in (None, "0"):
        return argv
    return [*argv, "hydra.output_subdir=null", f"hydra.job.name=train_rank_{rank}"]


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


def is_launching_process() -> bool:
    """True in the process a person started; False in a worker, or under torchrun or SLURM."""
    return "LOCAL_RANK" not in os.environ

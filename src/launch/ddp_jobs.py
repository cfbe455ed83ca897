"""DDP child processes that re-run exactly their own Hydra job, also inside a multirun sweep.

Lightning's DDP starts ranks 1..N-1 by re-running the parent's command line. Under
`python -m src.train -m ...` that command is the whole sweep, so each child would re-run
every job, write stray sweep folders and pair with the right job only by luck. Here the
parent, just before it launches its children, stores its job's own overrides and folder in
the environment (which the children inherit), and a child rebuilds its argv from them.
The parent also undoes, after each job, the environment and process group that Lightning
leaves behind, so the next job of the sweep can have another number of devices.
"""

import json
from datetime import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities import rank_zero_only

JOB_ARGS = "DPTRAIN_JOB_ARGS"
# Set in the parent by Lightning's launcher; left behind, they make the next job believe
# that its processes were started by someone else.
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", JOB_ARGS)


def quote(value: str) -> str:
    """Quote a value for Hydra's override grammar: sweep folders hold `=` and `,`."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def job_args() -> list[str]:
    """The command-line arguments that re-create the current job in run mode, in its own folder.

    `hydra.searchpath` goes along: the job's group options may live in a folder it adds.
    """
    hydra_cfg = HydraConfig.get()
    searchpath = [o for o in hydra_cfg.overrides.hydra if o.split("=", 1)[0].lstrip("+") == "hydra.searchpath"]
    return [*searchpath, *hydra_cfg.overrides.task, f"hydra.run.dir={quote(hydra_cfg.runtime.output_dir)}", "hydra.output_subdir=null"]


def is_rank_zero() -> bool:
    """True in the run's first process (global rank 0), the one that speaks and writes for the run.

    The one place to ask "am I rank zero" where no Trainer is at hand: entry points, config
    checks, the config file, error reports, signal handling. It reads Lightning's own record of
    the rank, taken from the launcher's environment (RANK, LOCAL_RANK, SLURM_PROCID) at import and
    set to the global rank once the strategy knows it, so it agrees with Lightning's
    `rank_zero_only` functions. Where a trainer is at hand (callbacks, after `Trainer.fit`), ask
    Lightning's `trainer.is_global_zero` instead.
    """
    return rank_zero_only.rank == 0


def external_rank() -> str | None:
    """The global rank given by torchrun or SLURM, which start every process themselves."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID")


def child_argv(argv: list[str]) -> list[str]:
    """argv for this process, so that only one process per run writes the config and `train.log`.

    A DDP child of a stored job gets the job's own arguments; a non-zero rank started by
    torchrun or SLURM keeps its arguments but writes no config and logs under its own name.
    """
    stored = os.environ.get(JOB_ARGS)
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if stored is not None and local_rank != "0":
        return [argv[0], *json.loads(stored), f"hydra.job.name=train_ddp_process_{local_rank}"]
    rank = external_rank()
    if stored is None and rank not in (None, "0"):
        return [*argv, "hydra.output_subdir=null", f"hydra.job.name=train_rank_{rank}"]
    return argv


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
    """True in the process a person started; False in a DDP child or under torchrun/SLURM."""
    return "LOCAL_RANK" not in os.environ


@contextmanager
def job_scope() -> Iterator[None]:
    """Around one job in the launching process: export its arguments, then clean up after it."""
    if not (is_launching_process() and HydraConfig.initialized()):
        yield
        return
    saved = {name: os.environ.get(name) for name in LAUNCHER_ENV}
    os.environ[JOB_ARGS] = json.dumps(job_args())
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

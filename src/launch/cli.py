"""What every entry point (`src.train`, `src.eval`) does around its task.

The command line is checked before Hydra starts; a signal, a dead or stuck process stops the
run cleanly (`src.launch.stopping`); bad input and a diverged loss end in one `error:` line and leave no
folder that could pass for a result; in a sweep, a failed job fails alone and the sweep exits
non-zero at its end.
"""

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src import checks
from src.launch import stopping
from src.launch.console import counted, print_error
from src.launch.ddp_jobs import child_argv, is_rank_zero
from src.errors import TrainingDiverged, UsageError

# Sweep jobs stopped by bad input or a diverged loss, with their exit status.
failed_jobs: dict[str, int] = {}


def holds_only_settings(output_dir: Path) -> bool:
    """True for a folder with nothing but Hydra's settings and logs: no checkpoint, no TensorBoard run."""
    settings = (".hydra", "config.yaml")
    return output_dir.is_dir() and all(p.name in settings or p.suffix == ".log" for p in output_dir.iterdir())


def report_failure(error: UsageError | TrainingDiverged, output_dir: Path, new_folder: bool) -> int:
    """One `error:` line from the first process, and no folder that could pass for a result; the exit status.

    Only a folder this run started is removed: a resumed run's folder keeps its checkpoints.
    """
    if is_rank_zero():
        print_error(str(error))
        if new_folder:
            shutil.rmtree(output_dir, ignore_errors=True)
    return 2 if isinstance(error, UsageError) else 1


def run_job(task: Callable[[DictConfig], dict[str, float]], cfg: DictConfig) -> float | None:
    """One Hydra job: the task's `test/acc`, or its failure reported and remembered."""
    new_folder = holds_only_settings(Path(cfg.output_dir))
    try:
        with stopping.stop_cleanly():
            metrics = task(cfg)
    except (UsageError, TrainingDiverged) as error:
        status = report_failure(error, Path(cfg.output_dir), new_folder)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(status)
        failed_jobs[" ".join(HydraConfig.get().overrides.task)] = status
        return None
    return metrics.get("test/acc")


def run_entry(hydra_main: Callable[[], object]) -> None:
    """Check the command line, run the Hydra entry, and exit non-zero if any sweep job failed."""
    sys.argv = child_argv(sys.argv)
    stopping.install()
    try:
        checks.check_overrides(sys.argv[1:])
        checks.check_run_dir(sys.argv[1:])
    except UsageError as error:
        if is_rank_zero():  # under torchrun every process checks the same command line
            print_error(str(error))
        sys.exit(2)
    with stopping.stop_cleanly():  # a signal outside a job: while Hydra starts, between sweep jobs
        hydra_main()
    if failed_jobs:
        print_error(f"{counted(len(failed_jobs), 'sweep job')} failed: {' | '.join(failed_jobs)}")
        sys.exit(max(failed_jobs.values()))
    stopping.end_child()

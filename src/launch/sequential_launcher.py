"""`hydra/launcher=sequential`, the default: one job after another in this process, as Hydra's basic launcher runs
them, with a line as each job starts and ends (`src.launch.progress`). Every job's config is composed before the first
runs, so that a bad value in a sweep is refused before any job has run."""

from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from src.launch.naming import job_dirname
from src.launch.progress import Progress


class SequentialLauncher(Launcher):
    """Hydra's basic launcher, which says nothing between its jobs, with the progress lines."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                   for overrides in job_overrides]
        progress = Progress(len(configs), initial_job_idx, sweep_dir)
        returns = []
        for number, config in enumerate(configs, initial_job_idx):
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = number
            name = job_dirname(config)
            progress.started(number, name)
            job = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)  # the job set its own
            progress.ended(number, name, job)
            returns.append(job)
        return returns

"""`hydra/launcher=sequential`, the default: Hydra's basic launcher, one job after another in this process, with a
line as each job starts and ends (`src.launch.progress`)."""

from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from src.launch.naming import job_dirname
from src.launch.progress import Progress


class ProjectLauncher(Launcher):
    """What the sequential and parallel launchers share: Hydra's setup, and each job's config."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def start_sweep(self) -> Path:
        """Hydra's globals and logging, and the sweep's folder."""
        assert self.config is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        return sweep_dir

    def job_config(self, number: int, overrides: Sequence[str]) -> DictConfig:
        """A job's config, composed as Hydra's basic launcher composes it."""
        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = config.hydra.job.num = number
        return config


class SequentialLauncher(ProjectLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        sweep_dir = self.start_sweep()
        # every job composed before the first runs: a bad value in a sweep is refused before any job has run
        configs = [self.job_config(number, job) for number, job in enumerate(job_overrides, initial_job_idx)]
        progress = Progress(len(configs), initial_job_idx, sweep_dir)
        returns = []
        for number, config in enumerate(configs, initial_job_idx):
            name = job_dirname(config)
            progress.started(number, name)
            job = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)  # the job set its own
            progress.ended(number, name, job)
            returns.append(job)
        return returns

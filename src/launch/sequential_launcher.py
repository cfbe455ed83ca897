"""`hydra/launcher=sequential`, the default: Hydra's basic launcher, one job after another in this process, with a
line as each job starts and ends (`src.launch.progress`)."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from src.launch.naming import job_dirname
from src.launch.progress import Progress


@dataclass
class Job:
    number: int
    overrides: list[str]
    config: DictConfig
    name: str
    devices: int = 1  # processes it starts, for the parallel launcher's slots
    gpu: bool = False
    resumes: bool = False  # it goes on from the checkpoints its folder holds (`ckpt_path=auto` in a resumed sweep)


def resumes(config: DictConfig, folder: Path) -> bool:
    """Whether a job goes on from its folder's checkpoints, as `src.resume.check` decides it will (an app without
    `ckpt_path` never does)."""
    from src.checkpoints import CKPT_WORDS, has_checkpoints  # torch: once a sweep of this project runs

    return str(config.get("ckpt_path")) in CKPT_WORDS and has_checkpoints(folder)


class ProjectLauncher(Launcher):
    """What the sequential and parallel launchers share: Hydra's setup, each job's config and the progress lines."""

    config: DictConfig | None = None
    hydra_context: HydraContext | None = None
    task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # every job composed before the first runs: a bad value in a sweep is refused before any job has run
        jobs = [self.job(number, list(overrides)) for number, overrides in enumerate(job_overrides, initial_job_idx)]
        returns = self.run(jobs, Progress(len(jobs), initial_job_idx, sweep_dir), sweep_dir)
        return [returns[job.number] for job in jobs]

    def job(self, number: int, overrides: list[str]) -> Job:
        """A job's config, composed as Hydra's basic launcher composes it."""
        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config):
            config.hydra.job.id = config.hydra.job.num = number
        name = job_dirname(config)
        return Job(number, overrides, config, name, resumes=resumes(config, Path(str(self.config.hydra.sweep.dir)) / name))

    def run(self, jobs: list[Job], progress: Progress, sweep_dir: Path) -> dict[int, JobReturn]:
        """Each job's JobReturn, by its number."""
        raise NotImplementedError


class SequentialLauncher(ProjectLauncher):
    def run(self, jobs: list[Job], progress: Progress, sweep_dir: Path) -> dict[int, JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        returns = {}
        for job in jobs:
            progress.started(job.number, job.name, job.resumes)
            returns[job.number] = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                                          config=job.config, job_dir_key="hydra.sweep.dir",
                                          job_subdir_key="hydra.sweep.subdir")
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)  # the job set its own
            progress.ended(job.number, job.name, returns[job.number])
        return returns

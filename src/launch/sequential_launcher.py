"""`hydra/launcher=sequential`, the default: Hydra's basic launcher, one job after another in this process, with a
line as each job starts and ends (`src.launch.progress`); each job's own log lines go to its log file alone."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from src.folders import check_below
from src.launch import lock
from src.launch.naming import job_dirname
from src.launch.console import lines_to_files
from src.launch.progress import Progress, quiet
from src.records import CKPT_WORDS, has_checkpoints


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
    return str(config.get("ckpt_path")) in CKPT_WORDS and has_checkpoints(folder)


class ProjectLauncher(Launcher):
    """What the sequential and parallel launchers share: Hydra's setup, each job's config and the progress lines."""

    config: DictConfig | None = None
    hydra_context: HydraContext | None = None
    task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = self.begin()
        with lock.held(sweep_dir, "sweep"):  # one writer a sweep folder from its first job, a new one's too
            # every job composed before the first runs: a bad value in a sweep is refused before any job has run
            jobs = [self.job(number, list(overrides)) for number, overrides in enumerate(job_overrides, initial_job_idx)]
            returns = self.run(jobs, Progress(len(jobs), initial_job_idx, sweep_dir), sweep_dir, jobs)
        return [quiet(returns[job.number]) for job in jobs]

    def launch_each(self, next_job: Callable[[], tuple[int, list[str]] | None], count: int, first: int,
                    at_once: int | None, ended: Callable[[int, JobReturn], None]) -> list[JobReturn]:
        """Up to `count` jobs, each taken from `next_job` (its number and overrides) only once a place is free for it,
        and each told to `ended` as it ends: a search asks for its next trial knowing how every trial before it ended,
        and a short trial's place goes to the next one while the others run on. At most `at_once` run at once."""
        sweep_dir = self.begin()

        def jobs() -> Iterator[Job]:
            while (taken := next_job()) is not None:
                yield self.job(*taken)

        assert self.config is not None
        alike = [Job(first, [], self.config, "")] * min(count, at_once or count)  # how many fit, as the command asks
        with lock.held(sweep_dir, "sweep"):
            returns = self.run(jobs(), Progress(count, first, sweep_dir, on_end=ended), sweep_dir, alike)
        return [quiet(job) for job in returns.values()]

    def begin(self) -> Path:
        """Hydra's logging and the sweep's folder, as Hydra's basic launcher sets them up."""
        assert self.config is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        return sweep_dir

    def job(self, number: int, overrides: list[str]) -> Job:
        """A job's config, composed as Hydra's basic launcher composes it."""
        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config):
            config.hydra.job.id = config.hydra.job.num = number
        name, sweep_dir = job_dirname(config), Path(str(self.config.hydra.sweep.dir))
        check_below(sweep_dir, sweep_dir / name)  # a job writes in a folder of the sweep's own, never through a link
        return Job(number, overrides, config, name, resumes=resumes(config, sweep_dir / name))

    def run(self, jobs: Iterable[Job], progress: Progress, sweep_dir: Path, alike: list[Job]) -> dict[int, JobReturn]:
        """Each job's JobReturn, by its number, the jobs taken one at a time as they can start; `alike` stands for
        them where their number and needs decide how many run at once."""
        raise NotImplementedError


class InFiles:
    """A sweep job's task whose log lines go to the job's log files alone (`lines_to_files`, once Hydra's `run_job`
    has set the job's logging up), its warnings kept for its end line."""

    def __init__(self, task: TaskFunction) -> None:
        self.task = task
        self.warned: list[str] = []

    def __call__(self, cfg: DictConfig) -> Any:
        with lines_to_files() as kept:
            try:
                return self.task(cfg)
            finally:
                self.warned = kept.lines


class SequentialLauncher(ProjectLauncher):
    def run(self, jobs: Iterable[Job], progress: Progress, sweep_dir: Path, alike: list[Job]) -> dict[int, JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        returns = {}
        for job in jobs:
            progress.started(job.number, job.name, job.resumes)
            task = InFiles(self.task_function)
            returns[job.number] = run_job(hydra_context=self.hydra_context, task_function=task, config=job.config,
                                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)  # the job set its own
            progress.ended(job.number, job.name, returns[job.number], task.warned)
        return returns

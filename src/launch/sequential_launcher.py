"""`hydra/launcher=sequential`, the default: one job after another in this process, as Hydra's basic
launcher runs them, with a line as each job starts and ends (`src.launch.progress`).

A job's unexpected exception fails that job alone, as under the parallel and SLURM launchers: its
traceback is printed, the next job runs, and the sweep exits non-zero naming it.
"""

from collections.abc import Sequence
from pathlib import Path

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from omegaconf import open_dict

from src.launch import forkserver
from src.launch.naming import job_dirname
from src.launch.progress import Progress, settled


class SequentialLauncher(BasicLauncher):
    """Hydra's basic launcher; `launch` replaced, because Hydra's says nothing between its jobs and
    leaves a job's exception for its sweeper to raise after the last job, with no report."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        progress = Progress(len(job_overrides), initial_job_idx, sweep_dir)
        returns = []
        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                   for overrides in job_overrides]
        for config in configs:  # the first DDP job's workers: their server imports the code while earlier jobs run
            forkserver.start_early(config)
        for number, config in enumerate(configs, initial_job_idx):
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = number
            name = job_dirname(config)
            progress.started(number, name)
            job = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)  # the job set its own
            returns.append(settled(job, name))
            progress.ended(number, name, job.return_value)
        return returns

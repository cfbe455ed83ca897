"""`hydra/launcher=slurm`: hydra-submitit-launcher's SLURM launcher, with a progress line as each job starts and ends;
a failed job fails the sweep naming it, a stop signal cancels the array, a job SLURM can never start ends the sweep in
one line. Each task runs as rank N, resumes when requeued (`ckpt_path=auto`), and exits non-zero when it fails."""

import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf, open_dict
from submitit.core.utils import UncompletedJobError, cloudpickle_dump, temporary_save_path

from src.errors import RunFailed, UsageError
from src.launch.naming import job_folder_name
from src.launch.progress import Progress, failure, last_error_line, quiet, value
from src.launch.sequential_launcher import resumes
from src.launch.stops import RankFailed, RunStopped, handle_stop_signals, ignore_stop_signals
from src.slurm import slurm_output

log = logging.getLogger(__name__)

POLL_S = 5.0
# Pending reasons SLURM gives a job that cannot start on its partition however long it waits.
NEVER_STARTS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "PartitionCpuLimit",
                "BadConstraints", "Resources_Unavailable")


class SlurmLauncher(SubmititSlurmLauncher):
    """The plugin's wait cannot be stopped and turns a failed job into a traceback, and its job exits 0 whatever the
    task returned: `launch` (on the submitting machine) and `__call__` (in each SLURM task) replace them."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        if shutil.which("sbatch") is None or shutil.which("srun") is None:  # else submitit's traceback
            raise UsageError("hydra/launcher=slurm needs a SLURM cluster, and this machine has no sbatch or srun on its "
                             "PATH; submit from a SLURM login node, or choose hydra/launcher=sequential or parallel")
        params = dict(self.params)
        folder = str(params.pop("submitit_folder"))
        base = Path(folder.split("%", 1)[0])  # `<sweep>/.submitit/%j`: the folder above the jobs' own
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(base)
        executor = submitit.AutoExecutor(cluster="slurm", folder=folder, slurm_max_num_timeout=params.pop("max_num_timeout"))
        shared = set(OmegaConf.structured(BaseQueueConf).keys())  # the rest are slurm_-prefixed for submitit
        executor.update_parameters(**{name if name in shared else f"slurm_{name}": value for name, value in params.items()})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
        goes_on = []  # whether each job resumes from its folder's checkpoints, for its lines
        for number, overrides in zip(numbers, job_overrides):
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))  # refused before sbatch
            goes_on.append(resumes(config, sweep_dir / job_folder_name(sweep_dir, list(overrides), number)))
        arguments = [(list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state())
                     for number, overrides in zip(numbers, job_overrides)]
        try:
            jobs = executor.map_array(self, *zip(*arguments))
        except (submitit.core.utils.FailedJobError, subprocess.SubprocessError) as error:
            said = str(error).strip().splitlines()
            raise UsageError(f"sbatch refused the sweep: {said[-1].removeprefix('sbatch: error: ') if said else error}") from None
        progress = Progress(len(jobs), initial_job_idx, sweep_dir)
        try:
            return wait(jobs, [list(overrides) for overrides in job_overrides], list(numbers), sweep_dir, progress,
                        goes_on)
        except RunStopped as stop:
            cancel(jobs)
            raise RunStopped(stop.signum, f"; cancelled SLURM job {jobs[0].job_id.split('_')[0]}") from None

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict[type, Singleton]) -> JobReturn:
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        # submitit's own handler only logs SIGTERM (it waits for a requeue), and Lightning's start installs the run's:
        # until then, `scancel` of a starting job went unheard and the job trained on until SLURM's SIGKILL
        handle_stop_signals()
        Singleton.set_state(singleton_state)
        setup_globals()
        config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        environment = submitit.JobEnvironment()
        with open_dict(config):
            config.hydra.job.id = environment.job_id
            config.hydra.job.num = job_num
            if environment.global_rank:  # as src.launch.ranks.rank_argv does under sbatch + srun
                config.hydra.job.name = f"{config.hydra.job.name}_rank_{environment.global_rank}"
            if "ckpt_path" in config and not OmegaConf.is_missing(config, "ckpt_path") and config.ckpt_path is None:
                config.ckpt_path = "auto"  # a requeued job runs again in its folder, and resumes there
        job = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                      job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir")
        failed = failure(job, "")
        if failed is not None:
            # The JobReturn as submitit would write it, for the submitter; then the exit status submitit would make 0.
            with temporary_save_path(environment.paths.result_pickle) as path:
                cloudpickle_dump(("success", job), path)
            sys.exit(failed.status)
        return job

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's timeout or preemption signal: requeue, deaf to the SIGTERM `scontrol requeue` sends next."""
        ignore_stop_signals()
        log.info("requeued by SLURM: the next attempt resumes from this run's last checkpoint")
        return super().checkpoint(*args, **kwargs)


def wait(jobs: list[submitit.Job], overrides: list[list[str]], numbers: list[int], sweep_dir: Path,
         progress: Progress, goes_on: list[bool] | None = None) -> list[JobReturn]:
    """Each job's JobReturn, once every job has ended, with a line as each starts (SLURM runs it) and ends; `goes_on`
    says which jobs resume from their folder's checkpoints."""
    array_id = jobs[0].job_id.split("_")[0]
    returns: dict[int, JobReturn] = {}
    started: set[int] = set()
    while True:
        listed = queue(array_id)
        running = {job_id for job_id, state, _ in listed or [] if state == "RUNNING"}
        for index, job in enumerate(jobs):
            # all gone from the queue: without sacct, submitit would wait for a result for ever
            done = index not in returns and (listed == [] or job.done())
            if index not in started and (done or job.job_id in running):
                started.add(index)
                progress.started(numbers[index], job_folder_name(sweep_dir, overrides[index], numbers[index]),
                                 bool(goes_on and goes_on[index]))
            if done:
                name = job_folder_name(sweep_dir, overrides[index], numbers[index])
                returns[index] = result(job, overrides[index])
                progress.ended(numbers[index], name, returns[index])
        if len(returns) == len(jobs):
            return [quiet(returns[index]) for index in range(len(jobs))]  # each job's line said how it failed
        impossible = never_starts(listed or [])
        if impossible:
            cancel(jobs)
            raise UsageError(impossible)
        time.sleep(POLL_S)


def queue(array_id: str) -> list[tuple[str, str, str]] | None:
    """(job id, state, reason) of the array's jobs still in SLURM's queue; None when squeue cannot tell."""
    listing = slurm_output("squeue", "--noheader", "--array", "--jobs", array_id, "--format=%i|%T|%r")
    if listing is None:
        return None
    return [tuple((line.strip().split("|") + ["", ""])[:3]) for line in listing.splitlines() if line.strip()]


def never_starts(listed: list[tuple[str, str, str]]) -> str | None:
    """The line that says why a pending job cannot start on its partition; None if none is stuck."""
    for job_id, state, reason in listed:
        if state == "PENDING" and reason in NEVER_STARTS:
            job = scontrol("job", job_id)
            name = job.get("Partition", "?")
            partition = scontrol("partition", name)
            asked = " ".join(f"{key}={job.get(key, '?')}" for key in ("NumNodes", "NumTasks", "NumCPUs", "TimeLimit"))
            limits = " ".join(f"{key}={partition.get(key, '?')}" for key in ("TotalNodes", "TotalCPUs", "MaxNodes", "MaxTime"))
            return (f"SLURM job {job_id} can never start ({reason}): it asks for {asked}; partition {name} has "
                    f"{limits}; the sweep's jobs are cancelled")
    return None


def scontrol(kind: str, name: str) -> dict[str, str]:
    """`scontrol show <kind> <name>` as a dict; empty when it cannot tell."""
    out = slurm_output("scontrol", "show", kind, "--oneliner", name) or ""
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def cancel(jobs: list[submitit.Job]) -> None:
    array_id = jobs[0].job_id.split("_")[0]
    subprocess.run(["scancel", array_id], capture_output=True, timeout=60)
    log.info(f"cancelled SLURM job {array_id}")


def check_private(folder: Path) -> None:
    """submitit's folder, its folders and the one above it are the user's own and writable by no one else: submitit
    unpickles what lies there, and whoever could replace a file could run code in this account."""
    for path in [folder.parent, folder, *(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink())]:
        info = path.lstat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022 or stat.S_ISLNK(info.st_mode):
            raise UsageError(f"{path} is not private to this user (owner uid {info.st_uid}, mode "
                             f"{stat.filemode(info.st_mode)}): submitit reads pickles from it, which could run code; "
                             f"make it yours alone (chmod go-w), or give another hydra.sweep.dir")


def result(job: submitit.Job, overrides: Sequence[str]) -> JobReturn:
    """Rank 0's JobReturn; for a job that left none, a failure with its last `error:` line (its stderr), else the last
    line of what submitit says."""
    check_private(Path(job.paths.result_pickle).parent)  # `<sweep>/.submitit/<job id>`, and submitit's folder above it
    try:
        if not job.paths.result_pickle.exists():  # gone from the queue without one: submitit would wait for it
            raise UncompletedJobError("no result")
        returned: JobReturn = job.results()[0]
    except (UncompletedJobError, submitit.core.utils.FailedJobError) as error:
        said = [line.strip() for line in str(error).splitlines() if line.strip()]
        line = last_error_line(job.stderr() or "") or (
            f"ended {job.state} without a result" + (f" ({said[-1][:200]})" if said else ""))
        returned = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
        returned.return_value = RankFailed(f"{line} (SLURM job {job.job_id})")
    said = value(returned)
    if returned.status == JobStatus.FAILED and type(said) in (UsageError, RunFailed):  # the job's own line, with its id
        returned.return_value = type(said)(f"{said} (SLURM job {job.job_id})")
    return returned

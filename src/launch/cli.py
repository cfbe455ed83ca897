"""What every entry point (`src.train`, `src.eval`) does around its task.

The command line is checked before Hydra starts; a signal or a failed rank ends the run with one
`error:` line (`src.launch.workers`); bad input and a diverged loss end in one `error:` line and
leave no folder that could pass for a result; in a sweep, a failed job fails alone and the sweep
exits non-zero at its end.
"""

import logging
import os
import string
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src import checks, resume
from src.errors import TrainingDiverged, UsageError
from src.launch import stops
from src.launch.console import counted, print_error, print_line
from src.launch.naming import unclaim_dir
from src.launch.ranks import is_rank_zero, rank_argv
from src.launch.stops import RankFailed, RunStopped, signal_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobFailed:
    """A sweep job that ended with an `error:` line: its value to Hydra, also across a SLURM job's pickle."""

    line: str
    status: int


@dataclass(frozen=True)
class Result:
    """What a run returns (rank 0's, under local DDP): its final metrics, the line it ended with, and whether it
    went on from a checkpoint of its folder."""

    metrics: dict[str, float]
    line: str
    resumed: bool = False


@dataclass(frozen=True)
class JobDone:
    """A job that ended well, as a sweep's launcher and its progress lines see it: its `test/acc`, its result line,
    whether it went on from a checkpoint (`resumed`), and whether it only read back an earlier finished run of its
    folder (`skipped`)."""

    test_acc: float | None
    line: str
    resumed: bool = False
    skipped: bool = False


# Sweep jobs that failed, by their folder's name in the sweep: filled where the job ran, or by the launcher that waited for it.
failed_jobs: dict[str, JobFailed] = {}


def holds_only_settings(output_dir: Path) -> bool:
    """True for a folder with nothing but Hydra's settings and logs: no checkpoint, no TensorBoard run."""
    settings = (".hydra", "config.yaml")
    return output_dir.is_dir() and all(p.name in settings or p.suffix == ".log" for p in output_dir.iterdir())


def report_failure(error: UsageError | TrainingDiverged, output_dir: Path, new_folder: bool) -> int:
    """One `error:` line from the first process, and no folder that could pass for a result; the exit status.

    Only a folder this run started is removed: a resumed run's folder keeps its checkpoints. Every
    process removes it, since under SLURM each one runs the Hydra job and the last may recreate it.
    """
    if is_rank_zero():
        print_error(str(error))
    if new_folder:
        unclaim_dir(output_dir)
    return 2 if isinstance(error, UsageError) else 1


def kept(output_dir: Path) -> str:
    """What a stopped run leaves to resume from, and the command that resumes it (a sweep's, in a sweep)."""
    last = output_dir / "checkpoints" / "last.ckpt"
    sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    again = (f"python -m src.train -m hydra.sweep.dir={HydraConfig.get().sweep.dir} ckpt_path=auto" if sweep
             else f"python -m src.train ckpt_path=last hydra.run.dir={output_dir}")
    if not any((output_dir / "checkpoints").glob("*.ckpt")) and not sweep:
        return "no epoch finished, so there is no checkpoint"
    held = f"{last} holds the last finished epoch" if last.is_file() else "no epoch finished yet"
    return f"{held}; resume with: {again}"


def end_run(line: str, status: int) -> NoReturn:
    """The run stopped: one line from the first process, then the exit status."""
    if is_rank_zero():
        try:
            print_error(line)
        except (OSError, ValueError):  # SIGHUP: the terminal may be gone
            pass
    sys.exit(status)


@contextmanager
def own_process_group() -> Iterator[None]:
    """A DDP job on one device runs in this process, where Lightning's launcher leaves its process group
    and its environment (LOCAL_RANK, which tells the next job that someone else started its processes)."""
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")}
    try:
        yield
    finally:
        import torch.distributed as dist  # imported by then: the job ran

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_job(task: Callable[[DictConfig], Result], cfg: DictConfig) -> JobDone | JobFailed:
    """One Hydra job: how the task ended, or its failure reported and remembered."""
    output_dir = Path(cfg.output_dir)
    new_folder = holds_only_settings(output_dir)
    line = resume.finished(cfg)
    if line is not None:
        if is_rank_zero():
            log.info(f"finished before, not run again: {line}")
        return JobDone(float(line.split("test/acc=", 1)[1].split()[0]), line, skipped=True)
    try:
        with own_process_group():
            result = task(cfg)
    except (UsageError, TrainingDiverged) as error:
        status = report_failure(error, output_dir, new_folder)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(status)
        failed = JobFailed(str(error), status)
        failed_jobs[HydraConfig.get().sweep.subdir] = failed
        return failed
    except RunStopped as stop:
        end_run(f"run stopped by {signal_name(stop.signum)}{stop.where}; {kept(output_dir)}", 128 + stop.signum)
    except RankFailed as failure:
        end_run(f"{failure.line}; {kept(output_dir)}", 1)
    except Exception as error:  # under torchrun or SLURM: a collective that lost its peer or timed out
        failure = stops.rank_failure(error, cfg)
        if failure is None:
            raise
        end_run(f"{failure.line}; {kept(output_dir)}", 1)
    return JobDone(result.metrics.get("test/acc"), result.line, resumed=result.resumed)


def quick_help(config_name: str, args: list[str]) -> str | None:
    """`--help` as Hydra renders the config's help template, without Hydra's walk over its own ninety-odd config
    groups to fill `$APP_CONFIG_GROUPS` (1.2 to 1.7 s of a 1.8 s answer on a 2-core machine): this project's
    groups are the folders of conf/. None where Hydra should answer: a template that asks for more, or a
    `hydra.searchpath` that adds options."""
    if not {"--help", "-h"} & set(args) or any(arg.startswith("hydra.searchpath") for arg in args):
        return None
    with initialize_config_dir(config_dir=str(checks.CONF_DIR), version_base="1.3"):
        template = compose(config_name, return_hydra_config=True).hydra.help.template
    if {"$CONFIG", "$FLAGS_HELP", "$HYDRA_CONFIG_GROUPS"} & {word for word in template.split() if word.startswith("$")}:
        return None
    groups = sorted(folder.name for folder in checks.CONF_DIR.iterdir() if checks.is_group(folder.name))
    listed = "".join(f"{group}: {', '.join(checks.group_options(group))}\n" for group in groups)
    return string.Template(template).substitute(APP_CONFIG_GROUPS=listed)


def run_entry(hydra_main: Callable[[], object], resumes: bool = False, config_name: str = "train") -> None:
    """Check the command line, run the Hydra entry, sum a sweep up, and exit non-zero if any of its jobs failed.
    With `resumes` (training), a command that resumes a run folder takes that run's own settings first (`src.resume`)."""
    sys.argv = rank_argv(sys.argv)
    stops.handle_stop_signals()
    if (text := quick_help(config_name, sys.argv[1:])) is not None:
        print(text)
        return
    try:
        checks.check_flags(sys.argv[1:])
        checks.check_overrides(sys.argv[1:])
        checks.check_run_dir(sys.argv[1:])
        if resumes:
            sys.argv = [sys.argv[0], *resume.with_run_config(sys.argv[1:])]
    except UsageError as error:
        if is_rank_zero():  # under torchrun every process checks the same command line
            print_error(str(error))
        sys.exit(2)
    from src.launch import progress  # it reads this module's job endings

    progress.tally = None
    try:
        hydra_main()
    except RunStopped as stop:  # outside a job: while Hydra starts, between sweep jobs
        end_run(f"run stopped by {signal_name(stop.signum)}{stop.where}", 128 + stop.signum)
    if progress.tally is not None:
        print_line(progress.tally.summary())
    if failed_jobs:
        jobs = " | ".join(f"{job}: {failed.line}" for job, failed in failed_jobs.items())
        print_error(f"{counted(len(failed_jobs), 'sweep job')} failed: {jobs}")
        sys.exit(max(failed.status for failed in failed_jobs.values()))

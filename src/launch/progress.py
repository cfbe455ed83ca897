"""Where a sweep is: a line as each job starts (or resumes) and ends (`job 2/4 done: <name>: <its line> (elapsed 1:22,
about 0:41 left)`), and a summary. Fed from Hydra's `JobReturn` alone, so it serves any Hydra app: a value's `line` is shown, its
`resumed`, `skipped` and `pruned` counted; the time left is the ended jobs' mean length over the most jobs seen running
at once."""

import contextlib
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from src.errors import RunFailed, UsageError
from src.launch.console import print_line
from src.launch.stops import RankFailed
from src.records import shown


@dataclass(frozen=True)
class Failure:
    name: str
    line: str
    status: int  # the exit status it earns
    error: BaseException | None = None


def value(job: JobReturn) -> object:
    """A job's return value, or for a failed job the exception it raised."""
    if job.status != JobStatus.FAILED:
        return job.return_value
    # A failed job's getter writes a line of its own to stderr, then raises its exception: that line goes nowhere.
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return job.return_value
        except Exception as error:  # Hydra keeps a failed job's `Exception`
            error.__traceback__ = error.__traceback__.tb_next.tb_next  # as it was, without this frame and the getter's
            return error


class QuietReturn(JobReturn):
    """Hydra's JobReturn, whose failed value a sweeper reads (to raise it) without Hydra's `Error executing job with
    overrides: [...]` on stderr: the job's end line has said how it failed."""

    kept: Any = None  # what the job returned, or the exception it failed with

    @property
    def return_value(self) -> Any:
        if self.status == JobStatus.FAILED:
            raise self.kept
        return self.kept

    @return_value.setter
    def return_value(self, value: Any) -> None:
        self.kept = value


def quiet(job: JobReturn) -> JobReturn:
    """`job` as a launcher hands it back to its sweeper (`QuietReturn`)."""
    back = QuietReturn(overrides=job.overrides, cfg=job.cfg, hydra_cfg=job.hydra_cfg, working_dir=job.working_dir,
                       task_name=job.task_name, status=job.status)
    back.return_value = value(job)
    return back


def failure(job: JobReturn, name: str) -> Failure | None:
    """How a job failed; None for a job that ended well."""
    if job.status != JobStatus.FAILED:
        return None
    error = value(job)
    own = isinstance(error, (UsageError, RunFailed, RankFailed))  # exceptions that are their own line
    line = shown(" ".join((str(error) if own else f"{type(error).__name__}: {error}").split()))
    status = 2 if isinstance(error, UsageError) else 1
    return Failure(shown(name), line, status, error if isinstance(error, BaseException) else None)


def log_file(job: JobReturn) -> Path | None:
    """The log file a job wrote (`<its folder>/<its entry>.log`, Hydra's default), where there is one."""
    folder = OmegaConf.select(job.hydra_cfg, "hydra.runtime.output_dir") if job.hydra_cfg is not None else None
    entry = OmegaConf.select(job.hydra_cfg, "hydra.job.name") if job.hydra_cfg is not None else None
    log = Path(str(folder)) / f"{entry}.log" if folder and entry else None
    return log if log is not None and log.is_file() else None


def last_error_line(text: str) -> str | None:
    """The last `error: ...` line a job printed."""
    errors = [line.removeprefix("error: ").strip() for line in text.splitlines() if line.startswith("error: ")]
    return errors[-1] if errors else None


def clock_time(seconds: float) -> str:
    """`0:41`, `12:05`, `1:02:03`."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Tally:
    """How the jobs of this command's sweep ended, across the launcher's calls."""

    total: int = 0
    done: int = 0
    resumed: int = 0
    skipped: int = 0
    pruned: int = 0
    failures: list[Failure] = field(default_factory=list)
    sweep_dir: Path | None = None
    noun: str = "job"
    before: int = 0  # jobs of the sweep that ended before this command (a resumed search)
    note: Callable[[], str] | None = None  # said after the times of each line
    appendix: str = ""  # added to the end of the sweep's report
    lengths: list[float] = field(default_factory=list)  # how long each job ended so far ran
    widest: int = 0  # the most jobs seen running at once
    began: float | None = None  # when the first launcher call began

    def summary(self, report: Path | None) -> str:
        """`sweep of 4 jobs: 3 done, 0 resumed, 0 skipped, 1 failed; report: <path>`; jobs not ended were not run."""
        pruned = f"{self.pruned} pruned, " if self.pruned else ""
        counts = f"{self.done} done, {self.resumed} resumed, {self.skipped} skipped, {pruned}{len(self.failures)} failed"
        ended = self.done + self.resumed + self.skipped + self.pruned + len(self.failures)
        if ended < self.total - self.before:
            counts += f", {self.total - self.before - ended} not run"
        if self.before:
            counts += f", {self.before} ended before"
        noun = self.noun if self.total == 1 else f"{self.noun}s"
        return f"sweep of {self.total} {noun}: {counts}; report: {report or 'none written'}"


# This command's sweep, once a launcher has started it (a sweeper that launches batch by batch, Optuna's, sets it).
tally: Tally | None = None


@dataclass
class Progress:
    """The lines of one launcher call: jobs numbered from `first` (Hydra's initial job index) out of `first + count`."""

    count: int
    first: int = 0
    sweep_dir: Path | None = None
    clock: Callable[[], float] = time.monotonic
    say: Callable[[str], None] = print_line
    on_end: Callable[[int, JobReturn], None] | None = None  # told each job's return as it ends, before its line
    running: dict[int, float] = field(default_factory=dict, init=False)  # job number -> when it started
    tally: Tally = field(init=False)  # the command's, shared with the launcher's other calls

    def __post_init__(self) -> None:
        global tally
        if tally is None:
            tally = Tally(sweep_dir=self.sweep_dir, before=self.first)
        tally.began = self.clock() if tally.began is None else tally.began
        tally.total = max(tally.total, self.first + self.count)
        self.tally = tally

    def started(self, number: int, name: str, resumes: bool = False) -> None:
        """`resumes`: the job goes on from its folder's checkpoints, as its launcher knows before it starts."""
        self.running[number] = self.clock()
        self.tally.widest = max(self.tally.widest, len(self.running))
        said = "resumed" if resumes else "started"
        self.say(f"{self.tally.noun} {number + 1}/{self.tally.total} {said}: {shown(name)} ({self.times()})")

    def ended(self, number: int, name: str, job: JobReturn, warned: Sequence[str] = ()) -> None:
        """`warned`: the warnings the job logged (`warning: ...`), said at the end of its line: its other lines are in
        its log alone."""
        if self.on_end is not None:
            self.on_end(number, job)
        now = self.clock()
        self.tally.lengths.append(now - self.running.pop(number, now))
        failed = failure(job, name)
        if failed is not None:
            self.tally.failures.append(failed)
            log = log_file(job)
            said = f"failed: {failed.name}: {failed.line}" + (f"; its log: {shown(str(log))}" if log else "")
        else:
            result = job.return_value
            counted = next((word for word in ("skipped", "pruned", "resumed") if getattr(result, word, False)), "done")
            setattr(self.tally, counted, getattr(self.tally, counted) + 1)
            line = getattr(result, "line", "")
            said = f"{'done after resuming' if counted == 'resumed' else counted}: {shown(name)}" + (
                f": {shown(line)}" if line else "")
        said += "".join(f"; {shown(warning)}" for warning in dict.fromkeys(warned))
        self.say(f"{self.tally.noun} {number + 1}/{self.tally.total} {said} ({self.times()})")

    def stopped(self, number: int, name: str, line: str) -> None:
        """A job ended by the sweep's stop signal; it counts as not run."""
        self.running.pop(number, None)
        self.say(f"{self.tally.noun} {number + 1}/{self.tally.total} stopped: {shown(name)}: {shown(line)} "
                 f"({self.times()})")

    def left(self) -> float | None:
        """Seconds until the last job ends; None before any has ended."""
        lengths = self.tally.lengths
        if not lengths:
            return None
        mean = sum(lengths) / len(lengths)
        now = self.clock()
        running = sum(max(mean - (now - start), 0.0) for start in self.running.values())
        waiting = self.tally.total - self.tally.before - len(lengths) - len(self.running)
        return (running + waiting * mean) / max(self.tally.widest, 1)

    def times(self) -> str:
        left, note = self.left(), self.tally.note() if self.tally.note else ""
        return f"elapsed {clock_time(self.clock() - (self.tally.began or 0.0))}, " + (
            "time left not known yet" if left is None else f"about {clock_time(left)} left") + (f"; {note}" if note else "")

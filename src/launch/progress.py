"""Where a sweep is: one line as each job starts and as it ends, and one summary when the sweep ends.

    job 2/4 started: lenet_auto_1dev_32-true_seed=2 (elapsed 0:41, about 1:20 left)
    job 2/4 done: lenet_auto_1dev_32-true_seed=2: test/acc=0.7012 ... -> outputs/multirun/... (elapsed 1:22, about 0:41 left)
    sweep of 4 jobs: 3 done, 0 resumed, 0 skipped, 1 failed; report: outputs/multirun/.../report.md

Every launcher (sequential, parallel, SLURM) feeds the same `Progress` from the process that waits for the jobs. It
reads only Hydra's `JobReturn`, so it serves any Hydra app: a task's value that has a `line` (the project's `Result`)
is shown, and its `resumed` and `skipped` are counted. The time left is the mean length of the jobs ended so far,
spread over the most jobs seen running at once.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus

from src.errors import TrainingDiverged, UsageError
from src.launch.console import print_line
from src.launch.stops import RankFailed


@dataclass(frozen=True)
class Failure:
    """A job that failed: its folder's name, its one line, the exit status it earns, and its exception."""

    name: str
    line: str
    status: int
    error: BaseException | None = None


def value(job: JobReturn) -> object:
    """A job's return value, or for a failed job the exception it raised: `JobReturn.return_value` would raise that
    exception after writing a line of its own to stderr, so the field behind it is read (Hydra names it in the
    constructor; no public getter leaves stderr alone)."""
    return job._return_value


def failure(job: JobReturn, name: str) -> Failure | None:
    """How a job failed, from its JobReturn; None for a job that ended well."""
    if job.status != JobStatus.FAILED:
        return None
    error = value(job)
    said = isinstance(error, (UsageError, TrainingDiverged, RankFailed))  # exceptions that are their own line
    line = str(error) if said else f"{type(error).__name__}: {error}"
    return Failure(name, " ".join(line.split()), 2 if isinstance(error, UsageError) else 1, error if isinstance(error, BaseException) else None)


def clock_time(seconds: float) -> str:
    """`0:41`, `12:05`, `1:02:03`."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Tally:
    """How the jobs of this command's sweep ended, across the launcher's calls: what the summary counts."""

    total: int = 0
    done: int = 0
    resumed: int = 0
    skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    sweep_dir: Path | None = None

    def add(self, job: JobReturn, name: str) -> Failure | None:
        failed = failure(job, name)
        if failed is not None:
            self.failures.append(failed)
        elif getattr(job.return_value, "skipped", False):
            self.skipped += 1
        elif getattr(job.return_value, "resumed", False):
            self.resumed += 1
        else:
            self.done += 1
        return failed

    def summary(self, report: Path | None) -> str:
        """`sweep of 4 jobs: 3 done, 0 resumed, 0 skipped, 1 failed; report: <path>`; jobs not ended were not run."""
        counts = f"{self.done} done, {self.resumed} resumed, {self.skipped} skipped, {len(self.failures)} failed"
        ended = self.done + self.resumed + self.skipped + len(self.failures)
        if ended < self.total:
            counts += f", {self.total - ended} not run"
        return f"sweep of {self.total} {'job' if self.total == 1 else 'jobs'}: {counts}; report: {report or 'none written'}"


# This command's sweep, once a launcher has started it.
tally: Tally | None = None


@dataclass
class Progress:
    """The lines of one launcher call: jobs numbered from `first` (Hydra's initial job index) out of `first + count`."""

    count: int
    first: int = 0
    sweep_dir: Path | None = None
    clock: Callable[[], float] = time.monotonic
    say: Callable[[str], None] = print_line
    began: float = field(init=False)
    running: dict[int, float] = field(default_factory=dict, init=False)  # job number -> when it started
    lengths: list[float] = field(default_factory=list, init=False)  # how long each ended job ran
    widest: int = field(default=0, init=False)  # the most jobs seen running at once

    def __post_init__(self) -> None:
        global tally
        self.began = self.clock()
        if tally is None:
            tally = Tally(sweep_dir=self.sweep_dir)
        tally.total = max(tally.total, self.first + self.count)

    @property
    def total(self) -> int:
        return self.first + self.count

    def started(self, number: int, name: str) -> None:
        self.running[number] = self.clock()
        self.widest = max(self.widest, len(self.running))
        self.say(f"job {number + 1}/{self.total} started: {name} ({self.times()})")

    def ended(self, number: int, name: str, job: JobReturn) -> None:
        """The job's end: its result line, or its error."""
        now = self.clock()
        self.lengths.append(now - self.running.pop(number, now))
        assert tally is not None
        failed = tally.add(job, name)
        if failed is not None:
            said = f"failed: {name}: {failed.line}"
        else:
            line = getattr(job.return_value, "line", "")
            said = f"{'skipped' if getattr(job.return_value, 'skipped', False) else 'done'}: {name}" + (f": {line}" if line else "")
        self.say(f"job {number + 1}/{self.total} {said} ({self.times()})")

    def stopped(self, number: int, name: str, line: str) -> None:
        """A job ended by the sweep's stop signal: its stop line. It counts as not run."""
        self.running.pop(number, None)
        self.say(f"job {number + 1}/{self.total} stopped: {name}: {line} ({self.times()})")

    def left(self) -> float | None:
        """Seconds until the last job ends, from the jobs ended so far; None before any has ended."""
        if not self.lengths:
            return None
        mean = sum(self.lengths) / len(self.lengths)
        now = self.clock()
        running = sum(max(mean - (now - start), 0.0) for start in self.running.values())
        waiting = self.count - len(self.lengths) - len(self.running)
        return (running + waiting * mean) / max(self.widest, 1)

    def times(self) -> str:
        left = self.left()
        return f"elapsed {clock_time(self.clock() - self.began)}, " + (
            "time left not known yet" if left is None else f"about {clock_time(left)} left")

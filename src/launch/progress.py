"""Where a sweep is: one line as each job starts and as it ends, and one summary when the sweep ends.

    job 2/4 started: lenet_auto_1dev_32-true_seed=2 (elapsed 0:41, about 1:20 left)
    job 2/4 done: lenet_auto_1dev_32-true_seed=2: test/acc=0.7012 ... -> outputs/multirun/... (elapsed 1:22, about 0:41 left)
    sweep of 4 jobs: 3 done, 0 resumed, 0 skipped, 1 failed; report: outputs/multirun/.../report.md

Every launcher (basic, parallel, SLURM) feeds the same `Progress` from the process that waits for
the jobs: the lines cost the jobs nothing, and they start at the left edge even while a progress
bar shows (`console.print_line`). The time left is the mean length of the jobs ended so far, spread
over the most jobs seen running at once; until a job has ended it is not known.
"""

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus

from src.launch.cli import JobDone, JobFailed, failed_jobs
from src.launch.console import print_line


def outcome(job: JobReturn) -> JobDone | JobFailed:
    """How a job ended, as a launcher reports it: its `JobDone` or `JobFailed`; an exception the task did
    not expect is a failure whose traceback is printed (Hydra's sweeper would raise it after the last job)."""
    value = job._return_value
    if job.status == JobStatus.FAILED:
        traceback.print_exception(value)
        return JobFailed(f"{type(value).__name__}: {value}", 1)
    if isinstance(value, (JobDone, JobFailed)):
        return value
    return JobDone(None, "")  # a task of Hydra's own, not cli.run_job: it ended


def settled(job: JobReturn, name: str, where: str = "") -> JobReturn:
    """The job's return with a failure as its value, which Hydra's sweeper takes as it is, and the failure
    remembered under the job's folder `name`, so that the sweep exits non-zero naming it; `where` is added
    to its line (` (SLURM job 35_0)`)."""
    ended = outcome(job)
    if isinstance(ended, JobFailed):
        ended = JobFailed(ended.line + where, ended.status)
        job.status, job.return_value = JobStatus.COMPLETED, ended
        failed_jobs[name] = ended
    return job


def clock_time(seconds: float) -> str:
    """`0:41`, `12:05`, `1:02:03`."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Tally:
    """How the jobs of a sweep ended, across the launcher's calls: what the summary line counts."""

    total: int = 0
    done: int = 0
    resumed: int = 0
    skipped: int = 0
    failed: int = 0
    sweep_dir: Path | None = None

    def add(self, ended: JobDone | JobFailed) -> None:
        if isinstance(ended, JobFailed):
            self.failed += 1
        elif ended.skipped:
            self.skipped += 1
        elif ended.resumed:
            self.resumed += 1
        else:
            self.done += 1

    def summary(self) -> str:
        """`sweep of 4 jobs: 3 done, 0 resumed, 0 skipped, 1 failed; report: <path>`: done, resumed and skipped
        ended well (ran from the start, went on from a checkpoint, or had ended before); jobs not ended are not run."""
        counts = f"{self.done} done, {self.resumed} resumed, {self.skipped} skipped, {self.failed} failed"
        ended = self.done + self.resumed + self.skipped + self.failed
        if ended < self.total:
            counts += f", {self.total - ended} not run"
        report = self.sweep_dir / "report.md" if self.sweep_dir is not None else None
        where = str(report) if report is not None and report.is_file() else "none written"
        return f"sweep of {self.total} {'job' if self.total == 1 else 'jobs'}: {counts}; report: {where}"


# The sweep of this command, once a launcher has started it: `cli.run_entry` prints its summary at the end.
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

    def ended(self, number: int, name: str, ended: JobDone | JobFailed) -> None:
        """The job's end: its result line, or its error; a job that ended without one started now."""
        now = self.clock()
        self.lengths.append(now - self.running.pop(number, now))
        assert tally is not None
        tally.add(ended)
        if isinstance(ended, JobFailed):
            said = f"failed: {name}: {ended.line}"
        else:
            said = f"{'skipped' if ended.skipped else 'done'}: {name}" + (f": {ended.line}" if ended.line else "")
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

"""How busy the machine is (Linux): the tasks ready to run beside a run, told at its start and sampled in its epochs
(`src.callbacks.disturbance`). Without torch: the parallel launcher asks before any job imports it."""

import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from src.launch.console import counted
from src.launch.ranks import usable_cores

PROC_STAT = Path("/proc/stat")

log = logging.getLogger(__name__)


def runnable_tasks(stat: Path = PROC_STAT) -> int | None:
    """Tasks running or ready to run on the whole machine now (`procs_running`); None where the kernel does not say."""
    try:
        for line in stat.read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def others_runnable_now(read: Callable[[], int | None] = runnable_tasks, wait: Callable[[float], object] = time.sleep,
                        samples: int = 5, gap_s: float = 0.02) -> int | None:
    """Tasks of other work ready to run now: the median of a few readings (one catches a passing burst), less the
    process that reads them."""
    readings = []
    for index in range(samples):
        if index:
            wait(gap_s)
        runnable = read()
        if runnable is None:
            return None
        readings.append(max(0, runnable - 1))
    return int(statistics.median_low(readings))


def busy_line(others: int | None, own: int, cores: int, whose: str = "run") -> str | None:
    """What a run (or a sweep) whose processes compute with `own` threads in all should know when it starts beside
    `others` ready tasks and together they want more than the `cores`: its threads will wait for cores, so its times
    measure the load, and fewer threads lose less to it."""
    if not others or others + own <= cores:
        return None
    ready = f"{counted(others, 'task')} of other work {'is' if others == 1 else 'are'} ready to run"
    return (f"the machine is busy: {ready} beside this {whose}'s {counted(own, 'thread')} on {counted(cores, 'core')}, "
            "so its times will be slow and uneven; time settings against each other on a quiet machine, or give a run "
            "that must share fewer threads (OMP_NUM_THREADS=1)")


def say_if_busy(own: int, whose: str = "run") -> None:
    """`busy_line`, logged by the process that starts a run or a side-by-side sweep, before it starts anything. Only
    where it may use every core: a parallel sweep's job, or a `taskset`, shares the machine by design, and what runs
    on the other cores does not slow it."""
    cores = os.cpu_count() or 1
    if len(usable_cores()) != cores:
        return
    line = busy_line(others_runnable_now(runnable_tasks), own, cores, whose)
    if line is not None:
        log.warning(line)

"""What each training epoch competed with, so that a speed figure taken on a busy machine says so: the share of the
run's cores that processes outside the run used (`usage/others_share`, Linux), measured from /proc at the epoch's
start and end; the process's CPU seconds against its wall seconds times its threads (`usage/cpu_share`); and on a GPU
its utilization (`usage/gpu_util`, through NVML). The run's own processes and threads never count as other work: a
run with more threads than cores waits for itself, which is its setting, not a disturbance."""

import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning import LightningModule, Trainer

from src.callbacks import RunFigures, log_scalars
from src.launch.ranks import external_rank, usable_cores
from src.sysinfo import NvmlUtilization

Proc = Mapping[str, str]  # /proc files read at one moment, by path: what `read_proc` returns and the tests replay
STAT = "/proc/stat"

SAMPLE_EVERY_S = 0.5  # GPU utilization, at a batch end at most this often
# Other processes used at least this share of the run's cores' time, and the run's threads spent at least this share
# of their time on or waiting for a CPU waiting: on the 2-core AMD EPYC of tests/fixtures/disturbance, quiet runs
# measured 0.000-0.017 of their cores taken, runs beside one busy loop 0.28-0.50 (docs/results.md).
OTHERS_DISTURB = 0.1
WAITED_DISTURB = 0.1


def core_ticks(stat: str, cores: Collection[int]) -> tuple[int, int]:
    """Busy and all clock ticks since boot of `cores` (/proc/stat's `cpuN` lines). Busy is all but idle and iowait:
    steal, the hypervisor's, is time the core ran other work too."""
    busy = total = 0
    for line in stat.splitlines():
        name, _, fields = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(field) for field in fields.split()[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def process_ticks(stat: str) -> tuple[int, int, int]:
    """A process's pid, parent pid and CPU ticks (/proc/<pid>/stat): its own and those of the children it waited for,
    so that a DataLoader worker that ended during the epoch still counts as the run's."""
    fields = stat.rpartition(")")[2].split()  # after the command's name, which may hold spaces and parentheses
    return int(stat.split(maxsplit=1)[0]), int(fields[1]), sum(int(ticks) for ticks in fields[11:15])


def thread_times(schedstat: str) -> tuple[int, int]:
    """A thread's nanoseconds on a CPU and waiting for one (/proc/<pid>/task/<tid>/schedstat)."""
    ran, waited, _ = schedstat.split()
    return int(ran), int(waited)


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """`root` and every process below it, from each process's parent."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def run_root() -> int:
    """The process whose tree is the run on this node: for a rank that torch's elastic agent, torchrun or SLURM
    started, the launcher its sibling ranks share; else this process (with its DataLoader workers)."""
    return os.getppid() if external_rank() is not None else os.getpid()


def read_proc(root: int) -> dict[str, str] | None:
    """/proc/stat, the stat of `root`'s processes and the schedstat of their threads, now; None without /proc. Every
    process's stat is read to find the tree, at an epoch's start and end: 2 ms for the 72 processes of the 2-core
    EPYC, about 20 us a process."""
    try:
        texts = {STAT: Path(STAT).read_text()}
    except OSError:
        return None
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError):  # ended meanwhile
                stats[int(entry.name)] = (entry / "stat").read_text()
    parents = {pid: process_ticks(text)[1] for pid, text in stats.items()}
    for pid in sorted(descendants(parents, root) & stats.keys()):
        texts[f"/proc/{pid}/stat"] = stats[pid]
        with suppress(OSError):
            for task in sorted((Path("/proc") / str(pid) / "task").iterdir()):
                with suppress(OSError):
                    texts[f"/proc/{pid}/task/{task.name}/schedstat"] = (task / "schedstat").read_text()
    return texts


@dataclass(frozen=True)
class Competition:
    others: float  # share of the run's cores' time that processes outside the run used
    waited: float | None  # share of the run's threads' time on or waiting for a CPU that they waited; None: unknown

    def disturbed(self) -> bool:
        """Other work took a tenth of the run's cores while the run's threads waited for one: its time measured the
        machine's load as well as the setting. Work on cores the run left idle does not slow it, and a run that waits
        for its own threads (more of them than cores) measures its setting."""
        return self.others >= OTHERS_DISTURB and (self.waited is None or self.waited >= WAITED_DISTURB)


def own_ticks(proc: Proc) -> int:
    """The CPU ticks of the run's processes in a reading of `read_proc`."""
    return sum(process_ticks(text)[2] for path, text in proc.items() if path != STAT and path.endswith("/stat"))


def competition(start: Proc, end: Proc, cores: Collection[int]) -> Competition:
    """What processes outside the run took of its `cores` between two readings of `read_proc`: the cores' busy ticks
    less the run's processes' CPU ticks (summed, so that a process that ended is counted by the parent that waited for
    it), and how long the run's threads waited for a CPU."""
    (busy_end, total_end), (busy_start, total_start) = core_ticks(end[STAT], cores), core_ticks(start[STAT], cores)
    own = own_ticks(end) - own_ticks(start)
    total = total_end - total_start
    others = max(0, busy_end - busy_start - own) / total if total > 0 else 0.0
    before = {path: thread_times(text) for path, text in start.items() if path.endswith("/schedstat")}
    ran = waited = 0
    for path, text in end.items():
        if path.endswith("/schedstat"):  # a thread that ended is left out: its times are gone with it
            (ran_end, waited_end), (ran_start, waited_start) = thread_times(text), before.get(path, (0, 0))
            ran, waited = ran + ran_end - ran_start, waited + waited_end - waited_start
    return Competition(others, waited / (ran + waited) if ran + waited > 0 else None)


class EpochLoad:
    """One epoch's figures from /proc at its start and end, and GPU samples between. Apart from Lightning, so that tests
    feed it recorded readings."""

    def __init__(self, threads: int, cores: Collection[int], start: Proc | None,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.threads, self.cores, self.start, self.clock, self.cpu_clock = threads, cores, start, clock, cpu_clock
        self.gpu: list[float] = []
        self.started, self.cpu_started = clock(), cpu_clock()
        self.sampled_at = self.started

    def due(self) -> bool:
        return self.clock() - self.sampled_at >= SAMPLE_EVERY_S

    def sample(self, gpu_util: float | None) -> None:
        self.sampled_at = self.clock()
        if gpu_util is not None:
            self.gpu.append(gpu_util)

    def figures(self, end: Proc | None) -> dict[str, float]:
        wall, cpu = self.clock() - self.started, self.cpu_clock() - self.cpu_started
        figures = {"usage/cpu_share": cpu / (wall * self.threads) if wall > 0 else 1.0, "usage/disturbed": 0.0}
        if self.start is not None and end is not None:
            measured = competition(self.start, end, self.cores)
            figures |= {"usage/others_share": measured.others, "usage/disturbed": float(measured.disturbed())}
            if measured.waited is not None:
                figures["usage/cpu_wait"] = measured.waited
        if self.gpu:
            figures["usage/gpu_util"] = statistics.mean(self.gpu)
        return figures


class Disturbance(RunFigures):
    """Logs each epoch's figures, and keeps which epochs were disturbed for the result line (`verdict`) and a resumed
    run. The run is the process tree of `run_root` on this node, on this process's cores."""

    def __init__(self) -> None:
        self.disturbed: list[bool] = []
        self._epoch: EpochLoad | None = None
        self._gpu: NvmlUtilization | None = None
        self._root = os.getpid()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._root = run_root()
        if pl_module.device.type == "cuda":
            self._gpu = NvmlUtilization(pl_module.device.index or 0)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch = EpochLoad(torch.get_num_threads(), usable_cores(), read_proc(self._root))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A run resumed mid-epoch gets no `on_train_epoch_start`."""
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._gpu is not None and self._epoch is not None and self._epoch.due():
            self._epoch.sample(self._gpu.read())

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._epoch is None:
            return
        self._epoch.sample(self._gpu.read() if self._gpu else None)
        figures = self._epoch.figures(read_proc(self._root))
        self.disturbed.append(bool(figures["usage/disturbed"]))
        log_scalars(trainer, figures)
        self._epoch = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def verdict(self) -> str:
        """The result line's part, where some epoch was disturbed."""
        count = sum(self.disturbed)
        if not count:
            return ""
        return (f"{count} of {len(self.disturbed)} epoch times disturbed: other work ran beside the run "
                "(usage/others_share in TensorBoard); time settings against each other on a quiet machine")

    def state_dict(self) -> dict[str, list[bool]]:
        return {"disturbed": list(self.disturbed)}

    def load_state_dict(self, state: dict[str, list[bool]]) -> None:
        if not self.not_taken_up:
            self.disturbed = [bool(flag) for flag in state["disturbed"]]

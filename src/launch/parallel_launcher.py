"""`hydra/launcher=parallel`: up to K sweep jobs at once on this machine, each on devices no other running job has.

    python -m src.train -m hydra/launcher=parallel seed=1,2,3,4 hydra.launcher.jobs_per_gpu=4  # 4 jobs share a GPU

Each job runs Hydra's `run_job` in a new interpreter, in a process group of its own (out of the terminal's reach), on a
slot of cores and its GPUs; its output goes to `<sweep>/.parallel/<job>.out`. A stop signal goes on to every running job
once, and no job starts after it; a second kills what still runs. No launcher at hand does this: submitit's local
executor starts every job on the same GPUs and kills a job 1 s after Ctrl-C; Hydra's joblib launcher gives no job its
devices.
"""

import logging
import multiprocessing
import os
import pickle
import signal
import sys
from collections import deque
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from omegaconf import DictConfig

from src.errors import UsageError
from src.launch.console import counted
from src.launch.progress import Progress, last_error_line, value
from src.launch.ranks import usable_cores
from src.launch.sequential_launcher import Job, ProjectLauncher
from src.launch.stops import STOP_SIGNALS, RankFailed, RunStopped, die_with_launcher, handle_stop_signals, signal_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """What one running job holds: a slot of cores, and the GPUs it sees (None on a machine without)."""

    slot: int
    cores: tuple[int, ...]
    gpus: tuple[str, ...] | None

    def take(self) -> None:
        if self.gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)
        if "OMP_NUM_THREADS" not in os.environ:  # a user's setting wins, as under torchrun
            os.environ["OMP_NUM_THREADS"] = str(len(self.cores))
            if "torch" in sys.modules:  # imported with the entry module: it read the variable already
                sys.modules["torch"].set_num_threads(len(self.cores))


class Places:
    """The machine's cores cut into `slots` slots, and its GPUs with `jobs_per_gpu` places each."""

    def __init__(self, cores: Sequence[int], slots: int, gpus: Sequence[str] | None, jobs_per_gpu: int) -> None:
        cores = sorted(cores)
        self.cores = [tuple(cores[k * len(cores) // slots:(k + 1) * len(cores) // slots]) for k in range(slots)]
        self.free = list(range(slots))
        self.gpus = gpus
        self.load = {gpu: 0 for gpu in gpus or ()}
        self.jobs_per_gpu = jobs_per_gpu

    def take(self, gpus: int) -> Placement | None:
        """A slot and `gpus` GPUs, the least shared first; None until free. A job asking for more GPUs than there are
        gets all, once none is in use (its own checks refuse it)."""
        if not self.free:
            return None
        if gpus > len(self.load):
            if any(self.load.values()):
                return None
            gpus = len(self.load)
        open_ = sorted((load, index) for index, load in enumerate(self.load.values()) if load < self.jobs_per_gpu)
        if len(open_) < gpus:
            return None
        names = list(self.load)
        chosen = tuple(names[index] for _, index in sorted(open_[:gpus], key=lambda place: place[1]))
        for gpu in chosen:
            self.load[gpu] += 1
        slot = self.free.pop(0)
        return Placement(slot, self.cores[slot], None if self.gpus is None else chosen)

    def give_back(self, placement: Placement) -> None:
        self.free = sorted([*self.free, placement.slot])
        for gpu in placement.gpus or ():
            self.load[gpu] -= 1


def machine_gpus() -> list[str] | None:
    """The GPUs this process sees, by their CUDA_VISIBLE_DEVICES names; None without any."""
    import torch  # only for a sweep whose jobs ask for GPUs

    count = torch.cuda.device_count()  # read through NVML where it can, without starting CUDA here
    if count == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:count] if visible else [str(index) for index in range(count)]


def wants_gpu(config: DictConfig) -> bool:
    """Its `accelerator` (gpu, cuda; auto where CUDA is); no GPU for an app without one."""
    accelerator = str(config.get("accelerator", "cpu"))
    if accelerator == "auto":
        import torch

        return torch.cuda.is_available()
    return accelerator in ("gpu", "cuda")


def slots_that_fit(jobs: int | None, cores: int, gpus: int, jobs_per_gpu: int, needs: list["Job"]) -> int:
    """K: `jobs`, else the GPUs' places over the fewest devices a GPU job asks for, else the cores over the most devices
    a job asks for (a core per DDP process); at least a core per job, no more slots than jobs."""
    if jobs is None:
        on_gpu = [job.devices for job in needs if job.gpu]
        jobs = max(1, gpus * jobs_per_gpu // min(on_gpu)) if gpus and on_gpu else max(1, cores // max(job.devices for job in needs))
    return min(jobs, cores, len(needs))


def checked_setting(name: str, value: Any, allow_null: bool, most: int | None = None) -> int | None:
    """A whole number from 1 to `most` (or null where allowed), else one line naming the key and what it allows."""
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
        allowed = ("a whole number of at least 1" if most is None else
                   f"a whole number from 1 to {most} (this machine's cores: each running job has cores of its own)")
        raise UsageError(f"hydra.launcher.{name}={value} is not allowed: it must be {allowed}"
                         + (", or null for as many as fit" if allow_null else ""))
    return value


@dataclass
class Running:
    job: Job
    placement: Placement
    process: multiprocessing.process.BaseProcess
    results: Connection | None  # the pipe its JobReturn comes back on, never a file: run folders are data
    out: Path  # what the job prints
    out_start: int  # where this attempt's output begins in `out` (a resumed sweep appends)
    returned: JobReturn | None = None


class ParallelLauncher(ProjectLauncher):
    def __init__(self, jobs: Any = None, jobs_per_gpu: Any = 1) -> None:
        self.jobs = checked_setting("jobs", jobs, allow_null=True, most=len(usable_cores()))
        self.jobs_per_gpu = checked_setting("jobs_per_gpu", jobs_per_gpu, allow_null=False)

    def run(self, jobs: list[Job], progress: Progress, sweep_dir: Path) -> dict[int, JobReturn]:
        cores = usable_cores()
        gpus = machine_gpus() if any(job.gpu for job in jobs) else None
        slots = slots_that_fit(self.jobs, len(cores), len(gpus or ()), self.jobs_per_gpu, jobs)
        (sweep_dir / ".parallel").mkdir(exist_ok=True)
        log.info(f"{counted(len(jobs), 'job')}, {slots} at a time, in {sweep_dir}; each job's output in {sweep_dir / '.parallel'}")
        places = Places(cores, slots, gpus, self.jobs_per_gpu)
        waiting, running, returns = deque(jobs), {}, {}
        with Stops() as stops:
            try:
                while (waiting or running) and not stops.signals:
                    while waiting and (placement := places.take(waiting[0].devices if waiting[0].gpu else 0)) is not None:
                        job = waiting.popleft()
                        running[job.number] = self.start(job, placement, sweep_dir)
                        progress.started(job.number, job.name)
                    for ended in ended_jobs(running, stops.woken):
                        places.give_back(ended.placement)
                        returns[ended.job.number] = returned(ended)
                        progress.ended(ended.job.number, ended.job.name, returns[ended.job.number])
                if stops.signals:
                    stopped = len(running)
                    stop_all(running, stops, progress)
                    raise RunStopped(stops.signals[0], f"; {counted(stopped, 'running job')} stopped, {len(waiting)} not started")
            finally:
                for still in running.values():  # only after an error of this launcher's own
                    kill(still.process.pid)
        return returns

    def job(self, number: int, overrides: list[str]) -> Job:
        job = super().job(number, overrides)
        devices = job.config.get("devices", 1)
        return replace(job, devices=devices if isinstance(devices, int) else 1, gpu=wants_gpu(job.config))

    def start(self, job: Job, placement: Placement, sweep_dir: Path) -> Running:
        assert self.hydra_context is not None and self.task_function is not None
        payload = cloudpickle.dumps((self.hydra_context, self.task_function, job.config, Singleton.get_state()))
        out = sweep_dir / ".parallel" / f"{job.name}.out"
        start = out.stat().st_size if out.is_file() else 0
        context = multiprocessing.get_context("spawn")
        results, sending = context.Pipe(duplex=False)
        process = context.Process(target=run_in_own_process, name=f"sweep job {job.number}",
                                  args=(payload, placement, str(out), sending))
        process.start()
        sending.close()  # the job holds the sending end now: its end reads as the end of the pipe
        return Running(job, placement, process, results, out, start)


class Stops:
    """Stop signals while the jobs run: noted and waking the wait, not raised wherever the launcher is (between starting
    a job's process and holding on to it, say)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.woken, self._wake = os.pipe()
        os.set_blocking(self._wake, False)

    def __enter__(self) -> "Stops":
        self._saved = {signum: signal.signal(signum, self._note) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        os.close(self.woken)
        os.close(self._wake)

    def _note(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        with suppress(BlockingIOError):  # a full pipe wakes the wait all the same
            os.write(self._wake, b"!")


def ended_jobs(running: dict[int, Running], woken: int) -> list[Running]:
    """The jobs that ended, taken out of `running`, once one has or a stop signal wakes the wait. A return is read as it
    comes: a job sending a large one waits until it is read."""
    assert running, "a job can always start while none runs"
    while True:
        pipes = [job.results for job in running.values() if job.results is not None]
        ready = wait([*(job.process.sentinel for job in running.values()), *pipes, woken])
        if woken in ready:
            os.read(woken, 1024)
        ended = [job for job in running.values() if job.process.sentinel in ready]
        for job in running.values():
            # an ended job's return, if it sent one, is in the pipe, whose end it closed
            if job.results is not None and (job.results in ready or job.process.sentinel in ready):
                with job.results:
                    with suppress(EOFError):  # else killed, or stopped by a signal
                        job.returned = pickle.loads(job.results.recv_bytes())
                job.results = None
        for job in ended:
            job.process.join()
            del running[job.job.number]
        if ended or woken in ready:
            return ended


def returned(job: Running) -> JobReturn:
    """The job's own JobReturn, or a failure saying how it ended without one."""
    if job.returned is not None:
        return job.returned
    failed = JobReturn(overrides=job.job.overrides, status=JobStatus.FAILED)
    failed.return_value = RankFailed(f"{last_words(job)} (see {job.out})")
    return failed


def last_words(job: Running) -> str:
    """How a job that sent no result ended: its last `error:` line (a stop line, say), else its exit."""
    code = job.process.exitcode or 0
    try:
        said = last_error_line(job.out.read_bytes()[job.out_start:].decode(errors="replace"))
    except OSError:
        said = None
    return said or (f"killed by {signal_name(-code)}" if code < 0 else f"ended with exit status {code} and no result")


def stop_all(running: dict[int, Running], stops: Stops, progress: Progress) -> None:
    """The first stop signal to each running job, once, and a line as each ends; a second signal kills the rest."""
    for job in running.values():
        with suppress(ProcessLookupError, PermissionError):
            os.kill(job.process.pid, stops.signals[0])
    killed = False
    while running:
        for ended in ended_jobs(running, stops.woken):
            progress.stopped(ended.job.number, ended.job.name, last_words(ended) if ended.returned is None else
                             getattr(value(ended.returned), "line", "") or "ended")
        if len(stops.signals) > 1 and not killed:
            killed = True
            for job in running.values():
                kill(job.process.pid)


def kill(pid: int) -> None:
    """SIGKILL to a job's process group (its DDP workers too), or to the job alone while it has none of its own yet."""
    for send in (os.killpg, os.kill):
        with suppress(ProcessLookupError, PermissionError):
            send(pid, signal.SIGKILL)


def run_in_own_process(payload: bytes, placement: Placement, out: str, results: Connection) -> None:
    """In the job's process: Hydra's `run_job` in its process group, on its devices, into its output file; the
    JobReturn goes back on `results`."""
    os.setpgid(0, 0)  # signals come from the sweep, once, not also from the terminal
    handle_stop_signals()
    die_with_launcher()
    placement.take()
    with open(out, "ab", buffering=0) as file:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    hydra_context, task_function, config, singleton_state = pickle.loads(payload)
    Singleton.set_state(singleton_state)
    setup_globals()
    job = run_job(hydra_context=hydra_context, task_function=task_function, config=config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    results.send_bytes(cloudpickle.dumps(job))  # its Hydra config names classes that plain pickle may not find
    results.close()

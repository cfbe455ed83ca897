"""`hydra/launcher=parallel`: up to K sweep jobs at once on this machine, each on devices no other running job has.

Each job runs Hydra's `run_job` in a new interpreter and process group, on a slot of cores and its GPUs, its output in
`<sweep>/.parallel/<job>.out`. A stop signal goes on to every running job once; a second kills what still runs. Why not
submitit's local executor or Hydra's joblib launcher: docs/sweeps.md.
"""

import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from contextlib import suppress
from copy import copy
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals

from src.errors import UsageError
from src.folders import open_file, open_folder
from src.launch.console import counted
from src.launch.load import say_if_busy
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


class Places:
    """The machine's cores cut into `slots` slots, and its GPUs with `jobs_per_gpu` places each; `why_one`: why one
    slot, where the sweep's jobs are held to one at a time (`one_at_a_time`)."""

    def __init__(self, cores: Sequence[int], slots: int, gpus: Sequence[str] | None, jobs_per_gpu: int,
                 why_one: str | None = None) -> None:
        cores = sorted(cores)
        self.cores = [tuple(cores[k * len(cores) // slots:(k + 1) * len(cores) // slots]) for k in range(slots)]
        self.free = list(range(slots))
        self.load = {gpu: 0 for gpu in gpus or ()}
        self.jobs_per_gpu, self.why_one = jobs_per_gpu, why_one

    def take(self, gpus: int) -> Placement | None:
        """A slot and `gpus` GPUs, the least shared first; None until free. A job asking for more than there are gets
        all, once none is in use (its own checks refuse it)."""
        if not self.free:
            return None
        if gpus > len(self.load):
            if any(self.load.values()):
                return None
            gpus = len(self.load)
        open_ = sorted((gpu for gpu, load in self.load.items() if load < self.jobs_per_gpu), key=self.load.get)
        if len(open_) < gpus:
            return None
        chosen = tuple(gpu for gpu in self.load if gpu in open_[:gpus])  # in the machine's order
        for gpu in chosen:
            self.load[gpu] += 1
        slot = self.free.pop(0)
        return Placement(slot, self.cores[slot], chosen if self.load else None)  # None: CUDA_VISIBLE_DEVICES left alone

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


def with_needs(job: Job) -> Job:
    """`job` with the processes it starts (`devices`) and whether they use GPUs (`accelerator` gpu or cuda, or auto
    where CUDA is); one process on CPU for an app without these keys."""
    devices, accelerator = job.config.get("devices", 1), str(job.config.get("accelerator", "cpu"))
    if accelerator == "auto":
        import torch

        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    return replace(job, devices=devices if isinstance(devices, int) else 1, gpu=accelerator in ("gpu", "cuda"))


def slots_that_fit(jobs: int | None, cores: int, gpus: int, jobs_per_gpu: int, needs: list["Job"]) -> int:
    """K: `jobs`, else the GPUs' places over the fewest devices a GPU job asks for, else the cores over the most devices
    a job asks for (a core per DDP process); at least a core per job, no more slots than jobs."""
    if jobs is None:
        on_gpu = [job.devices for job in needs if job.gpu]
        jobs = max(1, gpus * jobs_per_gpu // min(on_gpu)) if gpus and on_gpu else max(1, cores // max(job.devices for job in needs))
    return min(jobs, cores, len(needs))


def one_at_a_time(jobs: int | None, cores: int, gpus: int, jobs_per_gpu: int, needs: list["Job"]) -> str | None:
    """Why `slots_that_fit` runs these jobs one at a time, where more than one waits; None where it does not."""
    if len(needs) < 2 or slots_that_fit(jobs, cores, gpus, jobs_per_gpu, needs) > 1:
        return None
    if jobs is not None:
        return f"hydra.launcher.jobs={jobs}"
    if cores == 1:
        return "this machine lets the sweep use 1 core, and each running job has cores of its own"
    on_gpu = [job.devices for job in needs if job.gpu]
    if gpus and on_gpu:
        return (f"a job of devices={min(on_gpu)} takes {min(on_gpu)} of the {gpus} GPUs, each shared by at most "
                f"hydra.launcher.jobs_per_gpu={jobs_per_gpu} jobs")
    most = max(job.devices for job in needs)
    return f"a job of devices={most} takes {most} of the {cores} cores, one for each of its DDP processes"


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

    def places(self, jobs: list[Job]) -> Places:
        """This machine's cores and (where a job asks for them) GPUs, in as many slots as fit `jobs`."""
        cores = usable_cores()
        gpus = machine_gpus() if any(job.gpu for job in jobs) else None
        slots = slots_that_fit(self.jobs, len(cores), len(gpus or ()), self.jobs_per_gpu, jobs)
        why_one = one_at_a_time(self.jobs, len(cores), len(gpus or ()), self.jobs_per_gpu, jobs)
        return Places(cores, slots, gpus, self.jobs_per_gpu, why_one)

    def run(self, jobs: Iterable[Job], progress: Progress, sweep_dir: Path, alike: list[Job]) -> dict[int, JobReturn]:
        places = self.places([with_needs(job) for job in alike])
        say_if_busy(len(places.cores), "sweep")  # its jobs, each on a slot of cores, do not ask: the others are theirs
        os.close(open_folder(sweep_dir, sweep_dir / ".parallel", create=True))
        log.info(f"{counted(progress.count, 'job')}, {len(places.cores)} at a time"
                 + (f" ({places.why_one})" if places.why_one else "")
                 + f", in {sweep_dir}; each job's output in {sweep_dir / '.parallel'}")
        waiting, running, returns, started, stopped = iter(jobs), {}, {}, 0, 0
        head: Job | None = None  # taken from `waiting`, and waiting for GPUs
        with Stops() as stops:
            try:
                while True:
                    while not stops.signals and places.free and (head := head or next(waiting, None)) is not None:
                        placement = places.take(head.devices if head.gpu else 0)
                        if placement is None:
                            break
                        running[head.number] = self.start(head, placement, sweep_dir)
                        progress.started(head.number, head.name, head.resumes)
                        head, started = None, started + 1
                    if not running:
                        break
                    for ended in ended_jobs(running, stops.woken):
                        places.give_back(ended.placement)
                        if stopped:
                            said = getattr(value(ended.returned), "line", "") if ended.returned else last_words(ended)
                            progress.stopped(ended.job.number, ended.job.name, said or "ended")
                        else:
                            returns[ended.job.number] = returned(ended)
                            progress.ended(ended.job.number, ended.job.name, returns[ended.job.number])
                    if stops.signals and not stopped:  # the first goes on to each running job, once
                        stopped = len(running)
                        send(running, stops.signals[0])
                    elif len(stops.signals) > 1:  # a second kills them
                        send(running, signal.SIGKILL)
                if stops.signals:
                    raise RunStopped(stops.signals[0], f"; {counted(stopped, 'running job')} stopped, "
                                                       f"{progress.count - started} not started")
            finally:
                send(running, signal.SIGKILL)  # only after an error of this launcher's own
        return returns

    def job(self, number: int, overrides: list[str]) -> Job:
        return with_needs(super().job(number, overrides))

    def start(self, job: Job, placement: Placement, sweep_dir: Path) -> Running:
        assert self.hydra_context is not None and self.task_function is not None
        payload = cloudpickle.dumps((self.hydra_context, self.task_function, job.config, Singleton.get_state()))
        out = sweep_dir / ".parallel" / f"{job.name}.out"
        fd = open_file(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, root=sweep_dir)  # a file of the sweep's own
        start = os.fstat(fd).st_size
        os.close(fd)
        context = multiprocessing.get_context("spawn")
        results, sending = context.Pipe(duplex=False)
        receiving, payload_out = context.Pipe(duplex=False)
        process = context.Process(target=run_in_own_process, name=f"sweep job {job.number}",
                                  args=(receiving, placement, str(out), sending))
        # The payload goes after the start, from a thread: as an argument that does not fit the pipe to the new
        # process (about 64 kB), `start()` waits until the job has imported the entry module, one job after another.
        process.start()
        sending.close()  # the job holds the sending end now: its end reads as the end of the pipe
        receiving.close()
        threading.Thread(target=send_payload, args=(payload_out, payload), name=f"payload of job {job.number}",
                         daemon=True).start()
        return Running(job, placement, process, results, out, start)


class Stops:
    """Stop signals while the jobs run: noted, and waking the wait through `signal.set_wakeup_fd`, not raised wherever
    the launcher is (between starting a job's process and holding on to it, say)."""

    def __enter__(self) -> "Stops":
        self.signals: list[int] = []
        self.woken, wake = os.pipe()
        os.set_blocking(wake, False)
        self.saved = {signum: signal.signal(signum, lambda signum, frame: self.signals.append(signum))
                      for signum in STOP_SIGNALS}
        self.saved_fd = signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(signal.set_wakeup_fd(self.saved_fd))
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        os.close(self.woken)


def ended_jobs(running: dict[int, Running], woken: int) -> list[Running]:
    """The jobs that ended, taken out of `running`, once one has or a stop signal wakes the wait. A return is read as it
    comes: a job sending a large one waits until it is read."""
    while True:
        pipes = [job.results for job in running.values() if job.results is not None]
        ready = wait([*(job.process.sentinel for job in running.values()), *pipes, woken])
        if woken in ready:
            os.read(woken, 1024)
        ended = []
        for job in list(running.values()):
            # an ended job's return, if it sent one, is in the pipe, whose end it closed
            if job.results is not None and (job.results in ready or job.process.sentinel in ready):
                with job.results:
                    with suppress(EOFError):  # else killed, or stopped by a signal
                        job.returned = unpacked(job.results.recv_bytes(), job.job.name, job.out)
                job.results = None
            if job.process.sentinel in ready:
                job.process.join()
                ended.append(running.pop(job.job.number))
        if ended or woken in ready:
            return ended


@dataclass(frozen=True)
class LeftBehind:
    """In place of a job's return value that could not travel back from its process: why not."""

    why: str


def packed(job: JobReturn) -> bytes:
    """The JobReturn for the pipe (by cloudpickle: its Hydra config names classes that plain pickle may not find), its
    value packed apart: a value that cannot travel leaves the rest of the job's record to go back."""
    returned = value(job)  # a failed job's exception
    try:
        carried: bytes | LeftBehind = cloudpickle.dumps(returned)
    except Exception as error:
        carried = LeftBehind(f"its {type(returned).__name__} could not be pickled: {why(error)}")
    return cloudpickle.dumps((holding(job, None), carried))


def unpacked(data: bytes, name: str, out: Path) -> JobReturn:
    """The job's JobReturn from `packed`. A value that did not travel is a one-line warning, not a failure: the run
    ended as its status says, its folder complete; a failed job's exception that did not becomes a line naming `out`."""
    job, carried = pickle.loads(data)
    if isinstance(carried, bytes):
        try:
            return holding(job, pickle.loads(carried))
        except Exception as error:  # a class this process cannot find or build
            carried = LeftBehind(f"it could not be unpickled here: {why(error)}")
    if job.status == JobStatus.FAILED:
        return holding(job, RankFailed(f"its exception stayed in its process ({carried.why}); see {out}"))
    log.warning(f"job {name}: its return value stayed in its process ({carried.why}); the run ended and its folder "
                "is complete")
    return job


def holding(job: JobReturn, returned: object) -> JobReturn:
    """A copy of the job's record holding `returned`, set as Hydra's `run_job` sets it (a failed job's exception)."""
    job = copy(job)
    job.return_value = returned
    return job


def why(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


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
        with os.fdopen(open_file(job.out, os.O_RDONLY), "rb") as file:  # its last MiB: the line is near the end
            file.seek(max(job.out_start, os.fstat(file.fileno()).st_size - 2**20))
            said = last_error_line(file.read(2**20).decode(errors="replace"))
    except (OSError, UsageError):
        said = None
    return said or (f"killed by {signal_name(-code)}" if code < 0 else f"ended with exit status {code} and no result")


def send(running: dict[int, Running], signum: int) -> None:
    """`signum` to each running job; SIGKILL to its process group too (its DDP workers), or to the job alone while it
    has none of its own yet."""
    for job in running.values():
        for kill in (os.killpg, os.kill) if signum == signal.SIGKILL else (os.kill,):
            with suppress(ProcessLookupError, PermissionError):
                kill(job.process.pid, signum)


def send_payload(connection: Connection, payload: bytes) -> None:
    """A job that ended before it read its payload (killed) leaves the pipe broken: nothing to send then."""
    with suppress(OSError), connection:
        connection.send_bytes(payload)


def take_slot(placement: Placement) -> None:
    """The job's cores and GPUs. Its threads follow from its cores, not from OMP_NUM_THREADS: a DDP job's ranks read
    that variable as a user's own setting and would not divide the slot's cores among themselves."""
    if placement.gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(placement.gpus)
    if hasattr(os, "sched_setaffinity"):
        # torch, imported later by the task alone (an app without it imports none), takes as many threads as the
        # process may use cores (GNU OpenMP counts them)
        os.sched_setaffinity(0, placement.cores)
    elif "OMP_NUM_THREADS" not in os.environ:  # a user's setting wins, as under torchrun
        import torch  # where the cores cannot be set, their number can

        torch.set_num_threads(len(placement.cores))


def run_in_own_process(payload_in: Connection, placement: Placement, out: str, results: Connection) -> None:
    """In the job's process: Hydra's `run_job` on its devices, into its output file; the JobReturn back on `results`."""
    os.setpgid(0, 0)  # signals come from the sweep, once, not also from the terminal
    handle_stop_signals()
    die_with_launcher()
    take_slot(placement)
    with payload_in:
        payload = payload_in.recv_bytes()
    with os.fdopen(os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "ab", buffering=0) as file:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    hydra_context, task_function, config, singleton_state = pickle.loads(payload)
    Singleton.set_state(singleton_state)
    setup_globals()
    job = run_job(hydra_context=hydra_context, task_function=task_function, config=config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    results.send_bytes(packed(job))
    results.close()

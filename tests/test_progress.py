"""A sweep's progress lines and summary, on a clock the test moves; the same lines from the SLURM launcher's
wait; and how the parallel launcher places jobs on cores and GPUs. Sweeps on the real command line:
tests/test_multirun.py."""

import io
import logging
import sys
import threading
from pathlib import Path

import pytest
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from tqdm import tqdm

from src.errors import UsageError
from src.launch import progress
from src.launch.console import open_progress_bars, print_line, register
from src.launch.parallel_launcher import Job, Places, checked_setting, packed, slots_that_fit, unpacked
from src.launch.progress import Progress, Tally, clock_time
from src.launch.stops import RankFailed
from src.records import Result
from tests.helpers import QUICK, train_here


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def fresh_sweep():
    """No bar left on screen after a test (nor a sweep tallied: tests/conftest.py)."""
    yield
    for bar in open_progress_bars():
        bar.close()


def lines_of(count: int, first: int = 0, sweep_dir: Path | None = None) -> tuple[Progress, Clock, list[str]]:
    clock, said = Clock(), []
    return Progress(count, first, sweep_dir, clock=clock, say=said.append), clock, said


def ended(value: object) -> JobReturn:
    """A job's JobReturn as Hydra's `run_job` makes it: its task's value, or the exception it raised."""
    failed = isinstance(value, BaseException)
    return JobReturn(overrides=[], status=JobStatus.FAILED if failed else JobStatus.COMPLETED, _return_value=value)


DONE = Result({"test/acc": 0.71}, "test/acc=0.7100 val/acc_best=0.7000 median epoch 3.00 s (precision 32, 1 process) -> out/a")


def test_one_job_after_another_says_each_start_and_end_with_the_time_left():
    lines, clock, said = lines_of(3)
    lines.started(0, "lenet_seed=1")
    clock.now += 30
    lines.ended(0, "lenet_seed=1", ended(DONE))
    lines.started(1, "lenet_seed=2")
    clock.now += 10
    lines.ended(1, "lenet_seed=2", ended(UsageError("optim.lr=-1 is not allowed")))
    assert said == [
        "job 1/3 started: lenet_seed=1 (elapsed 0:00, time left not known yet)",
        f"job 1/3 done: lenet_seed=1: {DONE.line} (elapsed 0:30, about 1:00 left)",  # two more jobs of 30 s
        "job 2/3 started: lenet_seed=2 (elapsed 0:30, about 1:00 left)",
        # mean of 30 and 10 s: one job of 20 s left
        "job 2/3 failed: lenet_seed=2: optim.lr=-1 is not allowed (elapsed 0:40, about 0:20 left)",
    ]


def test_jobs_side_by_side_share_the_time_left_between_them():
    lines, clock, said = lines_of(4)
    for number in range(2):
        lines.started(number, f"job{number}")
    clock.now += 60
    lines.ended(0, "job0", ended(DONE))
    # job1 has run as long as the mean: nothing left of it; two jobs of 60 s wait, two at a time
    assert said[-1].endswith("(elapsed 1:00, about 1:00 left)")
    lines.started(2, "job2")
    clock.now += 15
    lines.ended(1, "job1", ended(DONE))
    # mean 67.5 s: job2 ran 15 s of it, job3 waits; spread over the 2 jobs seen running at once
    assert said[-1].endswith(f"(elapsed 1:15, about {clock_time((67.5 - 15 + 67.5) / 2)} left)")


def test_a_second_launch_of_the_same_sweep_numbers_its_jobs_on():
    lines, _, said = lines_of(2, first=4)
    lines.started(4, "job4")
    assert said == ["job 5/6 started: job4 (elapsed 0:00, time left not known yet)"]
    assert progress.tally is not None and progress.tally.total == 6


def test_the_summary_counts_each_ending_once_and_names_the_report(tmp_path):
    (tmp_path / "report.md").write_text("# report\n")
    lines, _, said = lines_of(6, sweep_dir=tmp_path)
    endings = [DONE, Result({}, "resumed", resumed=True), Result({}, "", skipped=True), ValueError("x"), 7]
    for number, value in enumerate(endings):
        lines.started(number, f"job{number}")
        lines.ended(number, f"job{number}", ended(value))
    assert progress.tally.summary(tmp_path / "report.md") == (
        f"sweep of 6 jobs: 2 done, 1 resumed, 1 skipped, 1 failed, 1 not run; report: {tmp_path / 'report.md'}")
    assert [(f.name, f.line, f.status) for f in progress.tally.failures] == [("job3", "ValueError: x", 1)]
    assert Tally(total=1, done=1).summary(None) == "sweep of 1 job: 1 done, 0 resumed, 0 skipped, 0 failed; report: none written"


def test_a_command_tallies_its_own_sweep_only(tmp_path, data_root):
    """A sweep that ended before in this process (a program that calls the entry twice) is not the next command's: a
    single run ends on its result line, with no sweep summary after it."""
    progress.tally = Tally(total=6, done=6)
    one_batch = ("trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1")
    result = train_here(*QUICK, *one_batch, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc=" in result.stdout.splitlines()[-1] and "sweep of" not in result.stdout, result.stdout[-3000:]


def test_a_skipped_job_says_so():
    lines, _, said = lines_of(1)
    lines.started(0, "job0")
    lines.ended(0, "job0", ended(Result({}, "test/acc=0.7000 ...", skipped=True)))
    assert said[-1].startswith("job 1/1 skipped: job0: test/acc=0.7000 ...")


def test_a_job_that_resumes_says_so_as_it_starts_and_ends(tmp_path):
    """A resumed sweep's job goes on from its folder's checkpoints (`ckpt_path=auto`): neither line claims a fresh run."""
    from src.launch.sequential_launcher import resumes
    from tests.helpers import composed

    folder = tmp_path / "job"
    assert not resumes(composed("ckpt_path=auto"), folder)  # nothing to go on from: a fresh start
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert resumes(composed("ckpt_path=auto"), folder) and not resumes(composed(), folder)
    lines, _, said = lines_of(1)
    lines.started(0, "job0", resumes=True)
    lines.ended(0, "job0", ended(Result({}, "test/acc=0.7000 ...", resumed=True)))
    assert [line.split(" (elapsed")[0] for line in said] == [
        "job 1/1 resumed: job0", "job 1/1 done after resuming: job0: test/acc=0.7000 ..."]


def test_a_job_of_any_hydra_app_ends_with_what_its_task_returned():
    lines, _, said = lines_of(2)
    lines.ended(0, "job0", ended(0.93))  # an optimizing sweeper's objective, say
    lines.ended(1, "job1", ended(UsageError("seed=x is not allowed")))
    assert [line.split(" (elapsed")[0] for line in said] == ["job 1/2 done: job0", "job 2/2 failed: job1: seed=x is not allowed"]
    assert progress.tally.failures[0].status == 2


class Unreadable:
    """Pickled fine, and refused where it is read back (a class the sweep's process cannot build)."""

    def __reduce__(self):
        return refuse, ()


def refuse():
    raise ValueError("not built here")


@pytest.mark.parametrize("value, why", [
    (threading.Lock(), "its lock could not be pickled: TypeError: cannot pickle '_thread.lock' object"),
    (Unreadable(), "it could not be unpickled here: ValueError: not built here"),
])
def test_a_parallel_job_whose_value_cannot_travel_back_is_done_with_one_warning(value, why, tmp_path, caplog):
    """The run ended and its folder is complete: only the value stays in the job's process, which one line says."""
    job = JobReturn(overrides=["seed=1"], status=JobStatus.COMPLETED, _return_value=value)
    with caplog.at_level(logging.WARNING, logger="src.launch.parallel_launcher"):
        back = unpacked(packed(job), "lenet_seed=1", tmp_path / "lenet_seed=1.out")
    assert caplog.messages == [f"job lenet_seed=1: its return value stayed in its process ({why}); the run ended "
                               "and its folder is complete"]
    lines, _, said = lines_of(1)
    lines.ended(0, "lenet_seed=1", back)
    assert back.overrides == ["seed=1"] and said[0].startswith("job 1/1 done: lenet_seed=1 (elapsed")
    assert progress.tally.done == 1 and not progress.tally.failures


def test_a_parallel_job_returns_its_value_and_a_failed_one_its_error_or_a_line_naming_its_output(tmp_path):
    out = tmp_path / "job.out"
    assert unpacked(packed(ended(DONE)), "a", out).return_value == DONE
    assert progress.failure(unpacked(packed(ended(UsageError("seed=x is not allowed"))), "b", out), "b").status == 2
    held = progress.failure(unpacked(packed(ended(RuntimeError(threading.Lock()))), "c", out), "c")
    assert held.line == (f"its exception stayed in its process (its RuntimeError could not be pickled: TypeError: "
                         f"cannot pickle '_thread.lock' object); see {out}")


def test_clock_time_reads_as_a_clock():
    assert [clock_time(s) for s in (0, 41.4, 725, 3723)] == ["0:00", "0:41", "12:05", "1:02:03"]


# ---------------------------------------------------------------- beside a progress bar


def screen(text: str) -> list[str]:
    """The lines a terminal shows: a carriage return goes back to the line's start."""
    return [raw.rsplit("\r", 1)[-1].rstrip() for raw in text.split("\n")]


def a_bar(terminal: io.StringIO) -> tqdm:
    """A bar registered with the console, as the project's EpochBar registers each bar Lightning opens."""
    bar = register(tqdm(total=10, desc="Epoch 0", file=terminal, ncols=60, mininterval=0, leave=True))
    bar.update(3)
    return bar


def test_a_progress_line_goes_above_a_progress_bar_not_on_its_end(monkeypatch):
    terminal = io.StringIO()  # stdout and stderr on one terminal, where the bar is drawn
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = a_bar(terminal)
    print_line("job 1/2 started: lenet_seed=1")
    lines = screen(terminal.getvalue())
    assert "job 1/2 started: lenet_seed=1" in lines, lines
    assert lines[-1].startswith("Epoch 0:  30%"), "the bar is drawn again below the line"
    bar.close()


def test_a_progress_line_from_another_thread_starts_with_a_newline(monkeypatch):
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    bar = a_bar(terminal)
    thread = threading.Thread(target=print_line, args=("job 2/2 done: x",))
    thread.start()
    thread.join()
    assert terminal.getvalue().endswith("\njob 2/2 done: x\n")
    bar.close()


# ---------------------------------------------------------------- the SLURM launcher's wait


class FakeSlurmJob:
    """What the SLURM launcher reads of a submitit job: its id, whether it is done, and its result."""

    def __init__(self, job_id: str, folder: Path, returned: JobReturn) -> None:
        self.job_id = job_id
        self.ended = False
        self.returned = returned
        self.paths = type("Paths", (), {"result_pickle": folder / f"{job_id}_result.pkl"})()

    def done(self) -> bool:
        return self.ended

    def results(self) -> list[JobReturn]:
        return [self.returned]


def test_the_slurm_launcher_says_each_start_and_end_as_it_polls(tmp_path, monkeypatch, capsys):
    slurm_launcher = pytest.importorskip("src.launch.slurm_launcher")
    done = JobReturn(overrides=["seed=1"], status=JobStatus.COMPLETED, _return_value=DONE)
    failed = JobReturn(overrides=["seed=2"], status=JobStatus.FAILED, _return_value=RankFailed("rank 1 died"))
    jobs = [FakeSlurmJob("7_0", tmp_path, done), FakeSlurmJob("7_1", tmp_path, failed)]
    for job in jobs:
        job.paths.result_pickle.write_bytes(b"")
    # the sweep's command line, which names a job that has written no folder (none here) by its swept values
    OmegaConf.save({"hydra": {"overrides": {"task": ["seed=1,2"]}}}, tmp_path / "multirun.yaml")
    # What squeue lists at each poll, and what has ended by then: job 0 runs, then job 1 while job 0 ends, then job 1 ends.
    polls = iter([([("7_0", "RUNNING", "None"), ("7_1", "PENDING", "Priority")], []),
                  ([("7_1", "RUNNING", "None")], [0]),
                  ([], [1])])

    def queue(array_id: str):
        listed, ending = next(polls)
        for index in ending:
            jobs[index].ended = True
        return listed

    monkeypatch.setattr(slurm_launcher, "queue", queue)
    monkeypatch.setattr(slurm_launcher, "POLL_S", 0.0)
    lines = Progress(2, 0, tmp_path)
    returns = slurm_launcher.wait(jobs, [["seed=1"], ["seed=2"]], [0, 1], tmp_path, lines, [False, True])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (elapsed")[0] for line in out] == [
        "job 1/2 started: seed=1",
        f"job 1/2 done: seed=1: {DONE.line}",
        "job 2/2 resumed: seed=2",  # it goes on from its folder's checkpoints
        "job 2/2 failed: seed=2: rank 1 died",
    ]
    assert returns[0].return_value == DONE and returns[1].status == JobStatus.FAILED
    jobs[1].paths.result_pickle.unlink()  # a job that SLURM ended without a result: its last words instead
    jobs[1].stderr = lambda: "error: run stopped by SIGTERM\n"
    assert str(slurm_launcher.result(jobs[1], ["seed=2"])._return_value) == "run stopped by SIGTERM (SLURM job 7_1)"


def test_a_slurm_job_heeds_a_stop_signal_from_its_first_step_where_submitits_handler_only_logs_it(tmp_path, monkeypatch):
    """`scancel` of a job still starting: submitit's SIGTERM handler only logs it, so the job trained on until SLURM's
    SIGKILL. The job's first step puts the run's stop handler in place, before the task runs."""
    import signal
    from types import SimpleNamespace

    from src.launch import stops

    slurm_launcher = pytest.importorskip("src.launch.slurm_launcher")
    heard = {}

    def run_job(hydra_context, task_function, config, job_dir_key, job_subdir_key):
        heard["handler"] = signal.getsignal(signal.SIGTERM)
        return JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=DONE)

    monkeypatch.setattr(slurm_launcher, "run_job", run_job)
    monkeypatch.setattr(slurm_launcher.submitit, "JobEnvironment", lambda: SimpleNamespace(job_id="7_0", global_rank=0))
    launcher = slurm_launcher.SlurmLauncher.__new__(slurm_launcher.SlurmLauncher)
    launcher.config, launcher.task_function = OmegaConf.create({}), lambda cfg: None
    job_config = {"hydra": {"job": {"id": None, "num": None, "name": "train"}}, "ckpt_path": None}
    launcher.hydra_context = SimpleNamespace(config_loader=SimpleNamespace(
        load_sweep_config=lambda config, overrides: OmegaConf.create(job_config)))
    saved = {signum: signal.getsignal(signum) for signum in stops.STOP_SIGNALS}
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as submitit's `bypass`
    try:
        returned = launcher(["seed=1"], "hydra.sweep.dir", 0, "job_id_for_0", Singleton.get_state())
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert returned.return_value == DONE
    assert heard["handler"] is stops._raise_stop


# ---------------------------------------------------------------- where the parallel launcher puts jobs


def job(devices: int = 1, gpu: bool = False) -> Job:
    return Job(0, [], None, "job", devices, gpu)


def test_on_cpu_as_many_jobs_run_as_the_cores_hold_each_with_cores_of_its_own():
    assert slots_that_fit(None, cores=2, gpus=0, jobs_per_gpu=1, needs=[job()] * 4) == 2
    assert slots_that_fit(None, cores=16, gpus=0, jobs_per_gpu=1, needs=[job(1), job(4)]) == 2  # a core per DDP process
    assert slots_that_fit(None, cores=2, gpus=0, jobs_per_gpu=1, needs=[job(4)]) == 1
    assert slots_that_fit(1, cores=2, gpus=0, jobs_per_gpu=1, needs=[job()] * 4) == 1
    places = Places(range(2), 2, None, 1)
    held = [places.take(0), places.take(0)]
    assert [p.cores for p in held] == [(0,), (1,)] and places.take(0) is None
    assert all(p.gpus is None for p in held), "without GPUs, CUDA_VISIBLE_DEVICES is left alone"
    places.give_back(held[0])
    assert places.take(0).cores == (0,)
    assert Places(range(2), 1, None, 1).take(0).cores == (0, 1), "one job at a time gets every core"


def test_on_gpus_a_job_gets_its_devices_and_packed_jobs_never_overfill_a_gpu():
    assert slots_that_fit(None, cores=16, gpus=4, jobs_per_gpu=1, needs=[job(1, gpu=True)] * 12) == 4
    assert slots_that_fit(None, cores=16, gpus=1, jobs_per_gpu=4, needs=[job(1, gpu=True)] * 8) == 4
    assert slots_that_fit(None, cores=16, gpus=2, jobs_per_gpu=1, needs=[job(2, gpu=True)] * 3) == 1
    places = Places(range(16), 4, ["0", "1"], jobs_per_gpu=2)
    held = [places.take(1) for _ in range(4)]
    assert [p.gpus for p in held] == [("0",), ("1",), ("0",), ("1",)], "the least shared GPU first"
    assert [p.cores for p in held] == [tuple(range(k * 4, k * 4 + 4)) for k in range(4)]
    assert places.take(1) is None, "no slot free"
    places.give_back(held[0])
    places.give_back(held[1])
    assert places.take(2).gpus == ("0", "1"), "a 2-device job: one place on each of two GPUs"
    assert places.take(1) is None, "every GPU holds 2 jobs"


def test_a_job_asking_for_more_gpus_than_there_are_gets_all_of_them_once_idle():
    places = Places(range(8), 2, ["3", "5"], jobs_per_gpu=1)
    first = places.take(1)
    assert places.take(4) is None
    places.give_back(first)
    assert places.take(4).gpus == ("3", "5"), "its own check then refuses devices=4 in one line"
    cpu_job = Places(range(8), 2, ["3", "5"], jobs_per_gpu=1).take(0)
    assert cpu_job.gpus == (), "a CPU job on a GPU machine sees no GPU"


@pytest.mark.parametrize("value", [0, -1, 1.5, "two", True])
def test_a_launcher_setting_out_of_range_is_refused_in_one_line(value):
    with pytest.raises(UsageError, match=rf"hydra.launcher.jobs_per_gpu={value} is not allowed: it must be a whole number"):
        checked_setting("jobs_per_gpu", value, allow_null=False)
    with pytest.raises(UsageError, match="from 1 to 2 .*, or null for as many as fit"):
        checked_setting("jobs", 3, allow_null=True, most=2)
    assert checked_setting("jobs", None, allow_null=True, most=2) is None


def test_a_parallel_launch_takes_the_next_job_only_when_a_place_frees_and_tells_each_end_first(tmp_path, monkeypatch):
    """`launch_each`'s side in the parallel launcher: job 2 is asked for once job 0 (the short one) has ended and been
    told, while job 1 runs on; nothing is asked for while both places are taken."""
    from types import SimpleNamespace

    from src.launch import parallel_launcher
    from src.launch.parallel_launcher import ParallelLauncher, Running

    events, ends = [], iter([0, 1, 2])

    def jobs():
        for number in range(3):
            events.append(f"asked {number}")
            yield Job(number, [], None, f"j{number}")

    def start(job, placement, sweep_dir):
        events.append(f"started {job.number}")
        return Running(job, placement, SimpleNamespace(exitcode=0), None, tmp_path / "out", 0, ended(DONE))

    def ended_jobs(running, woken):
        return [running.pop(next(ends))]

    launcher = ParallelLauncher(jobs=2)
    monkeypatch.setattr(launcher, "places", lambda alike: Places(range(2), 2, None, 1))
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(parallel_launcher, "ended_jobs", ended_jobs)
    monkeypatch.setattr(parallel_launcher, "say_if_busy",  # once, for the whole sweep, which takes both cores
                        lambda own, whose: events.append(f"busy? {whose} of {own} threads"))
    told = lambda number, job: events.append(f"told {number}")  # noqa: E731
    returns = launcher.run(jobs(), Progress(3, 0, tmp_path, clock=Clock(), say=lambda line: None, on_end=told),
                           tmp_path, [])
    assert events == ["busy? sweep of 2 threads", "asked 0", "started 0", "asked 1", "started 1", "told 0", "asked 2", "started 2", "told 1",
                      "told 2"]
    assert sorted(returns) == [0, 1, 2] and all(job.return_value == DONE for job in returns.values())


def test_a_job_a_resumed_sweep_runs_again_is_named_by_its_folder_though_its_command_adds_overrides(tmp_path):
    """The SLURM launcher names a job by the folder that recorded its swept values; a resume's job adds `ckpt_path=auto`
    (and the record's settings), and may have another number (`shuffle()`, values typed in another order), so its
    folder is found by those values alone. Its lines said `started: seed=1` where it resumed in `lenet_..._seed=1`."""
    from src.launch.naming import job_folder_name

    OmegaConf.save({"hydra": {"overrides": {"task": ["seed=1,2"]}}}, tmp_path / "multirun.yaml")
    for number, name in enumerate(["lenet_auto_1dev_32-true_seed=1", "lenet_auto_1dev_32-true_seed=2"]):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create([f"seed={number + 1}"]), tmp_path / name / ".hydra" / "overrides.yaml")
        OmegaConf.save({"hydra": {"job": {"num": number}}}, tmp_path / name / ".hydra" / "hydra.yaml")
    assert job_folder_name(tmp_path, ["seed=2"], 1) == "lenet_auto_1dev_32-true_seed=2"
    assert job_folder_name(tmp_path, ["seed=2", "ckpt_path=auto"], 1) == "lenet_auto_1dev_32-true_seed=2"
    assert job_folder_name(tmp_path, ["seed=3", "ckpt_path=auto"], 2) == "seed=3", "a job with no folder yet"
    assert job_folder_name(tmp_path, ["seed=3_"], 2) == "seed=3_", "its value as it is, never trimmed"
    assert job_folder_name(tmp_path, ["seed=1", "ckpt_path=auto", "max_epochs=3"], 1) == "lenet_auto_1dev_32-true_seed=1"


def test_a_parallel_sweep_held_to_one_job_at_a_time_says_why_in_one_line(monkeypatch):
    """`-m hydra/launcher=parallel strategy=ddp devices=1,2` on 2 cores: the 2-process job takes both, so the jobs run
    one after another, and the launcher's line says so (a sweep that fits two at once says nothing more)."""
    from src.launch import parallel_launcher

    monkeypatch.setattr(parallel_launcher, "usable_cores", lambda: [0, 1])
    places = parallel_launcher.ParallelLauncher().places([job(1), job(2)])
    assert len(places.cores) == 1
    assert places.why_one == "a job of devices=2 takes 2 of the 2 cores, one for each of its DDP processes"
    assert parallel_launcher.ParallelLauncher().places([job(1), job(1)]).why_one is None
    assert parallel_launcher.ParallelLauncher().places([job(2)]).why_one is None, "one job alone needs no reason"
    assert parallel_launcher.ParallelLauncher(jobs=1).places([job(1), job(1)]).why_one == "hydra.launcher.jobs=1"
    assert parallel_launcher.one_at_a_time(None, 16, 2, 1, [job(2, gpu=True)] * 3) == (
        "a job of devices=2 takes 2 of the 2 GPUs, each shared by at most hydra.launcher.jobs_per_gpu=1 jobs")

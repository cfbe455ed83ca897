"""Hydra multirun sweeps through the command's own entry: one job after another (the default launcher) and side by side
(`hydra/launcher=parallel`), with their progress lines, failures and stops; stop signals through the real command line.

A sweep over strategies and devices that runs each job in its own folder: tests/test_readme.py,
which runs the README's sweep (`-m strategy=ddp,ddp_fp16 devices=1,2,4`) and checks every job's folder.
Every wait here is for an event (a line, a checkpoint, a process gone), with minutes to spare.
"""

import os
import pickle
import re
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import (INTERPRETER, QUICK, REPO, assert_finished_run, command_here, cpu_precision, scalars,
                           start_cli, train_here, user_env)
from tests.test_stopping import checkpointed_epoch, proc_stat, wait_for

PRECISION = cpu_precision()  # what precision=auto uses here
PARALLEL = "hydra/launcher=parallel"
SHOW_PLACEMENT = "+callbacks.probe._target_=tests.probes.ShowPlacement"
SEEDS = [f"lenet_auto_1dev_{PRECISION}_seed={seed}" for seed in (1, 2)]
TIMES = r"\(elapsed \d+:\d\d, (about \d+:\d\d left|time left not known yet)\)"


def sweep(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """A sweep as a user types it, in this process: what is checked is what the sweep prints and writes; its jobs run
    one after another here, or as processes of their own (side by side, or a DDP job's ranks). What only the sweep's
    own process shows, its stop signals, is tested below with the command line."""
    return train_here("-m", *args, *QUICK, f"hydra.sweep.dir={folder}")


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory, data_root) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The same sweep of two one-process LeNet jobs (seeds 1 and 2), one job after another and side by side."""
    sweeps = {}
    for launcher in ("sequential", "parallel"):
        folder = tmp_path_factory.mktemp(launcher) / "sweep"
        # Without the disturbance marks: whether an epoch competed with the suite's other test process differs
        # between the two sweeps, and the result lines would say so.
        sweeps[launcher] = sweep(folder, f"hydra/launcher={launcher}", "seed=1,2", SHOW_PLACEMENT,
                                 "~callbacks.disturbance"), folder
    return sweeps


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["sequential", "parallel"])
def test_a_sweep_says_each_job_start_and_end_and_sums_up(two_sweeps, launcher):
    result, folder = two_sweeps[launcher]
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("job ", "sweep of"))]
    for number, name in enumerate(SEEDS, 1):
        assert any(re.fullmatch(rf"job {number}/2 started: {re.escape(name)} {TIMES}", line) for line in lines), lines
        done = (rf"job {number}/2 done: {re.escape(name)}: test/acc=\d\.\d{{4}} .* -> {re.escape(str(folder / name))}"
                rf"(; warning: .*)? {TIMES}")  # the warnings the job logged, on a busy machine
        assert any(re.fullmatch(done, line) for line in lines), lines
    assert lines[-1] == f"sweep of 2 jobs: 2 done, 0 resumed, 0 skipped, 0 failed; report: {folder / 'report.md'}"
    assert result.stdout.splitlines()[-1] == lines[-1], "the summary is the sweep's last line"
    if launcher == "parallel":  # both had started before either ended
        assert [line.split(":")[0] for line in lines[:2]] == ["job 1/2 started", "job 2/2 started"], lines
    else:
        assert [line.split(":")[0] for line in lines[:4]] == ["job 1/2 started", "job 1/2 done", "job 2/2 started", "job 2/2 done"]


def relative_files(run: Path) -> set[str]:
    """A run folder's files, event files by their kind (their names hold the time, host and pid)."""
    return {re.sub(r"tfevents\..*", "tfevents", p.relative_to(run).as_posix()) for p in run.rglob("*") if p.is_file()}


def log_lines(run: Path, sweep_dir: Path) -> list[str]:
    """train.log without what differs from run to run: times, figures, paths, the entry module's logger name (a job
    of its own process runs the entry module as multiprocessing names it), and the line that says how busy the machine
    was at the start (which only a job that may use every core says)."""
    text = (run / "train.log").read_text().replace(str(sweep_dir), "<sweep>").replace("__mp_main__", "__main__")
    return [re.sub(r"\d+(\.\d+)?", "N", line) for line in text.splitlines() if "the machine is busy: " not in line]


def threads_of(config: str) -> int:
    return int(re.search(r"^threads: (\d+)$", config, re.M).group(1))


def without_threads(config: str) -> str:
    return re.sub(r"^threads: \d+$", "threads: N", config, flags=re.M)


@pytest.mark.slow
def test_jobs_side_by_side_write_what_one_after_another_writes(two_sweeps):
    (one_by_one, sequential), (side_by_side, parallel) = two_sweeps["sequential"], two_sweeps["parallel"]
    assert one_by_one.returncode == 0, one_by_one.stderr[-3000:]
    assert side_by_side.returncode == 0, side_by_side.stderr[-3000:]
    jobs = {p.name for p in parallel.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "report"}
    assert jobs == {p.name for p in sequential.iterdir() if p.is_dir() and p.name != "report"} == set(SEEDS)
    for name in SEEDS:
        alone, beside = sequential / name, parallel / name
        series = assert_finished_run(side_by_side, beside)
        assert relative_files(beside) == relative_files(alone)
        assert OmegaConf.load(beside / ".hydra" / "overrides.yaml") == OmegaConf.load(alone / ".hydra" / "overrides.yaml")
        config, alone_config = (beside / "config.yaml").read_text(), (alone / "config.yaml").read_text()
        # A job beside others gets its share of the cores, and records the threads it used.
        assert threads_of(config) <= threads_of(alone_config)
        assert without_threads(config).replace(str(parallel), "<sweep>") == \
            without_threads(alone_config).replace(str(sequential), "<sweep>")
        assert log_lines(beside, parallel) == log_lines(alone, sequential)
        assert set(series) == set(scalars(alone))
    for report in (sequential, parallel):
        assert (report / "report.md").is_file() and all(name in (report / "report.md").read_text() for name in SEEDS)


@pytest.mark.slow
def test_each_job_side_by_side_runs_on_a_core_of_its_own(two_sweeps):
    _, parallel = two_sweeps["parallel"]
    placements = [re.search(r"placement rank 0: cores=(\S+) threads=(\d+)", (parallel / ".parallel" / f"{name}.out").read_text())
                  for name in SEEDS]
    assert all(placements), [p for p in (parallel / ".parallel").iterdir()]
    cores = [set(p.group(1).split(",")) for p in placements]
    assert cores[0].isdisjoint(cores[1]) and all(len(c) == len(os.sched_getaffinity(0)) // 2 for c in cores), cores
    assert all(int(p.group(2)) == len(c) for p, c in zip(placements, cores)), "as many threads as cores"


@pytest.mark.slow
def test_ddp_jobs_side_by_side_keep_their_workers_inside_their_cores_and_a_job_killed_fails_alone(tmp_path, data_root):
    """Two 2-process DDP jobs at once on 2 cores (`jobs=2`): each job's two workers share the one core it holds. Then
    the first job's own process, its workers' launcher, is SIGKILLed after its second step, as a crash or the kernel's
    OOM killer would: it fails alone, its workers go with it, and the other job, which never reaches step 1000,
    finishes."""
    folder = tmp_path / "sweep"
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.launcher=true",
             "+callbacks.fault.step=2,1000"]
    result = sweep(folder, PARALLEL, "hydra.launcher.jobs=2", "strategy=ddp", "devices=2", *fault, SHOW_PLACEMENT)
    killed, finished = (f"lenet_ddp_2dev_{PRECISION}_callbacks.fault.step={step}" for step in (2, 1000))
    cores, workers = [], {}
    for job in (killed, finished):
        out = (folder / ".parallel" / f"{job}.out").read_text()
        ranks = {rank: (where, int(pid)) for rank, where, pid in
                 re.findall(r"placement rank (\d): cores=(\S+) threads=1 .* pid=(\d+)$", out, flags=re.M)}
        assert set(ranks) == {"0", "1"} and ranks["0"][0] == ranks["1"][0], out[-3000:]
        cores.append(set(ranks["0"][0].split(",")))
        workers[job] = [pid for _, pid in ranks.values()]
    assert cores[0].isdisjoint(cores[1]) and all(len(c) == len(os.sched_getaffinity(0)) // 2 for c in cores), cores
    wait_for(lambda: not any(alive(pid) for pid in workers[killed]), "the killed job's workers gone")
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(rf"^job 1/2 failed: {re.escape(killed)}: killed by SIGKILL \(see .*{re.escape(killed)}\.out\) ",
                     result.stdout, flags=re.M), result.stdout
    assert re.search(rf"^job 2/2 done: {re.escape(finished)}: test/acc=", result.stdout, flags=re.M), result.stdout
    assert "sweep of 2 jobs: 1 done, 0 resumed, 0 skipped, 1 failed" in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: 1 sweep job failed: {killed}: killed by SIGKILL")
    assert_finished_run(subprocess.CompletedProcess(result.args, 0, result.stdout, ""), folder / finished)  # its job's part
    assert killed in (folder / "report.md").read_text()


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_a_job_side_by_side_ends_with_the_weights_it_ends_with_alone(two_sweeps, tmp_path):
    """Alone on as many threads as it had beside the other job: torch sums in another order on another
    number of threads, so only then can the weights be the same to the bit."""
    _, parallel = two_sweeps["parallel"]
    threads = int(re.search(r"threads=(\d+)", (parallel / ".parallel" / f"{SEEDS[0]}.out").read_text()).group(1))
    alone, saved = tmp_path / "alone", torch.get_num_threads()
    torch.set_num_threads(threads)  # the run's threads, as OMP_NUM_THREADS gives them to a new process
    try:
        result = train_here("seed=1", *QUICK, f"hydra.run.dir={alone}")
    finally:
        torch.set_num_threads(saved)
    assert result.returncode == 0, result.stderr[-3000:]
    assert OmegaConf.load(alone / "config.yaml").threads == threads
    beside, by_itself = weights(parallel / SEEDS[0]), weights(alone)
    assert beside.keys() == by_itself.keys()
    assert all(torch.equal(beside[name], by_itself[name]) for name in beside)


def test_a_bad_job_fails_alone_and_the_sweep_exits_non_zero(tmp_path, data_root):
    """The second job is refused as it starts (its settings are checked job by job); the first has finished."""
    folder = tmp_path / "sweep"
    result = sweep(folder, "strategy=auto", "devices=1,2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: 1 sweep job failed: lenet_auto_2dev_") and "strategy=auto runs on one device" in result.stderr
    assert {p.name for p in folder.iterdir() if p.is_dir() and p.name != "report"} == {f"lenet_auto_1dev_{PRECISION}"}
    assert re.search(r"^job 1/2 done: lenet_auto_1dev_\S+: test/acc=", result.stdout, flags=re.M)
    assert re.search(r"^job 2/2 failed: lenet_auto_2dev_\S+: strategy=auto runs on one device", result.stdout, flags=re.M)
    assert result.stdout.splitlines()[-1] == f"sweep of 2 jobs: 1 done, 0 resumed, 0 skipped, 1 failed; report: {folder / 'report.md'}"


def test_a_parallel_launcher_setting_out_of_range_stops_the_sweep_in_one_line(tmp_path, data_root):
    folder = tmp_path / "sweep"
    cores = len(os.sched_getaffinity(0))
    result = sweep(folder, PARALLEL, f"hydra.launcher.jobs={cores + 1}", "seed=1,2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: hydra.launcher.jobs={cores + 1} is not allowed: it must be a whole number from 1 to {cores} (this "
        f"machine's cores: each running job has cores of its own), or null for as many as fit"]
    assert not folder.exists()


def descendants(pid: int) -> set[int]:
    """Every process started below `pid` (a job in a process group of its own too), by their parents."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = proc_stat(int(stat.parent.name))
        if fields:
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return bool(fields) and fields[0] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("signum, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_stops_every_running_job_with_a_line_each_and_starts_none(tmp_path, data_root, signum, to_group):
    """Ctrl-C reaches a terminal's whole process group; `kill` reaches the sweep's process alone. Either way each
    running job gets the signal once, ends with its stop line, and the third job never starts."""
    folder = tmp_path / "sweep"
    long = ["max_epochs=50", "data.batch_size=64", "trainer.limit_train_batches=10"]
    sweep_process = start_cli("src.train", "-m", PARALLEL, "seed=1,2,3", *QUICK, *long, f"hydra.sweep.dir={folder}",
                           cwd=REPO, env=user_env(), new_session=True)
    started: set[int] = set()
    try:
        def both_training() -> bool:
            if sweep_process.poll() is not None:
                pytest.fail(f"the sweep ended before it was signalled:\n{sweep_process.stderr.read()[-3000:]}")
            started.update(descendants(sweep_process.pid))
            return all(checkpointed_epoch(folder / name / "checkpoints" / "last.ckpt") >= 1 for name in SEEDS)

        wait_for(both_training, "both jobs' second epoch checkpointed")
        if to_group:
            os.killpg(sweep_process.pid, signum)
        else:
            sweep_process.send_signal(signum)
        stdout, stderr = sweep_process.communicate(timeout=600)
        wait_for(lambda: not any(alive(pid) for pid in started), "every process of the sweep gone")
    finally:
        for pid in {sweep_process.pid} | started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    assert sweep_process.returncode == 128 + signum, stderr[-3000:]
    assert stderr.strip().splitlines() == [f"error: run stopped by {name}; 2 running jobs stopped, 1 not started"], stderr
    for number, job in enumerate(SEEDS, 1):
        stop = (rf"^job {number}/3 stopped: {re.escape(job)}: run stopped by {name} during epoch \d+ \(step \d+\); "
                rf"{re.escape(str(folder / job / 'checkpoints' / 'last.ckpt'))} holds the last finished epoch; "
                rf"resume with: {re.escape(INTERPRETER)} -m src\.train -m hydra\.sweep\.dir={re.escape(str(folder))} ckpt_path=auto ")
        assert len(re.findall(stop, stdout, flags=re.M)) == 1, stdout
        assert "Traceback" not in (folder / ".parallel" / f"{job}.out").read_text()
    assert "job 3/3" not in stdout and not (folder / f"lenet_auto_1dev_{PRECISION}_seed=3").exists()


class StartedOnly:
    """A spawned process as `multiprocessing` starts it: its arguments pickled through the pipe to the new interpreter,
    which `start()` waits on where they do not fit the pipe. Here: pickled, and not run."""

    started: list["StartedOnly"] = []

    def __init__(self, target, name, args) -> None:
        self.args, self.name = args, name

    def start(self) -> None:
        from multiprocessing.connection import Connection
        from multiprocessing.reduction import ForkingPickler

        self.pickled = len(ForkingPickler.dumps(self.args))
        self.payload_in = Connection(os.dup(self.args[0].fileno()))  # the new process's copy of the pipe's end
        StartedOnly.started.append(self)


def test_a_jobs_process_starts_with_small_arguments_and_gets_its_payload_after(tmp_path, monkeypatch):
    """Jobs started one import apart (4 s on a quiet machine, 19 s on a busy one): spawn's `start()` waits for the
    new interpreter to import the entry module when the arguments do not fit the pipe (about 64 kB)."""
    import multiprocessing

    from omegaconf import OmegaConf

    from src.launch import parallel_launcher
    from src.launch.parallel_launcher import ParallelLauncher, Placement
    from src.launch.sequential_launcher import Job

    spawn = multiprocessing.get_context("spawn")
    monkeypatch.setattr(parallel_launcher.multiprocessing, "get_context",
                        lambda method: SimpleNamespace(Pipe=spawn.Pipe, Process=StartedOnly))
    launcher = ParallelLauncher(jobs=1)
    launcher.hydra_context, launcher.task_function = {"a context": "x" * 200_000}, len  # a payload over 64 kB
    (tmp_path / ".parallel").mkdir()
    job = Job(1, ["seed=1"], OmegaConf.create({"seed": 1}), "job")
    running = launcher.start(job, Placement(0, (0,), None), tmp_path)
    [started] = StartedOnly.started
    payload = started.payload_in.recv_bytes()
    assert started.pickled < 4096 < 200_000 < len(payload)
    hydra_context, task_function, config, _ = pickle.loads(payload)
    assert hydra_context == launcher.hydra_context and task_function is len and config == job.config
    assert running.process is started


def test_a_job_is_pinned_to_its_slot_and_leaves_its_ranks_to_divide_its_cores(monkeypatch):
    """A DDP job's ranks read OMP_NUM_THREADS as a user's setting: the job sets none, and imports no torch to set its
    threads, which follow from the cores it is pinned to (the real jobs' threads: the side-by-side sweep's test)."""
    from src.launch.parallel_launcher import Placement, take_slot

    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append((pid, tuple(cores))))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    take_slot(Placement(0, (1,), None))
    assert pinned == [(0, (1,))] and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() == threads


def test_a_new_sweep_holds_its_folder_from_its_first_job(tmp_path, data_root):
    """A second command on the folder of a new sweep (its name made by the first, not typed) was not refused: both
    split the jobs. The sweep's launcher holds the folder's lock while its jobs run."""
    mark = tmp_path / "lock"
    result = command_here("src.train", "-m", *QUICK, "seed=1", "+callbacks.probe._target_=tests.faults.SweepLockProbe",
                          f"+callbacks.probe.mark={mark}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert mark.read_text() == "held"
    [sweep] = (tmp_path / "outputs" / "multirun").iterdir()
    assert not (sweep / ".lock").exists()  # and let go of once the sweep ended

"""A sweep's terminal: a line as each job starts and ends and the summary, whatever the jobs log, under the sequential
launcher and the Optuna sweeper on top of it; each job's own lines in its train.log alone, its warnings and a failed
job's reason in its end line, and none of Hydra's own text about a failed job."""

import io
import logging
import re
from contextlib import redirect_stderr
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from src.errors import RunFailed, UsageError
from src.launch import console
from src.launch.console import lines_to_files
from src.launch.progress import Progress, quiet
from src.records import Result
from tests.helpers import QUICK, train_here, train_with_ranks

ONE_BATCH = ("trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1")
JOB_LINE = re.compile(r"^(job|trial) \d+/\d+ (started|done|failed): ")


def sweep(folder: Path, *args: str):
    return train_here("-m", *args, *QUICK, *ONE_BATCH, f"hydra.sweep.dir={folder}")


def job_folders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and (p / ".hydra").is_dir())


def test_a_sequential_sweep_says_each_job_in_two_lines_and_its_log_goes_to_its_train_log(tmp_path, data_root):
    folder = tmp_path / "sweep"
    result = sweep(folder, "seed=1,2,3")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 7 and all(JOB_LINE.match(line) for line in lines[:-1]), lines
    assert lines[-1].startswith("sweep of 3 jobs: 3 done")
    assert "Error executing job" not in result.stderr and "[src." not in result.stderr + result.stdout
    for job in job_folders(folder):
        # the result line once on the terminal, in the job's end line, which names the folder of its train.log
        assert sum(f"-> {job}" in line for line in lines) == 1, lines
        assert "[src.train][INFO] - test/acc=" in (job / "train.log").read_text()


def test_an_optuna_search_says_each_trial_in_two_lines_with_its_result_line_once(tmp_path, data_root):
    folder = tmp_path / "search"
    result = sweep(folder, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "optim.lr=interval(0.01, 0.1)")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # two lines a trial, the search's best trial and the summary
    assert len(lines) == 6 and all(JOB_LINE.match(line) for line in lines[:4]), lines
    assert lines[-2].startswith("best of 2 trials: ") and lines[-1].startswith("sweep of 2 trials: ")
    assert sum("test/acc=" in line for line in lines[:4]) == 2 and "[src.train]" not in result.stdout
    for job in job_folders(folder):
        assert "[src.train][INFO] - test/acc=" in (job / "train.log").read_text()


def test_a_failed_jobs_line_carries_its_reason_and_hydra_says_nothing_of_it(tmp_path, data_root):
    folder = tmp_path / "sweep"
    result = sweep(folder, "strategy=auto", "devices=1,2")
    assert result.returncode == 2
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and re.match(r"job 2/2 failed: lenet_auto_2dev_\S+: strategy=auto runs on one device, not "
                                        r"devices=2; use strategy=ddp", lines[3]), lines
    assert "Error executing job" not in result.stderr
    assert result.stderr.splitlines() == [f"error: 1 sweep job failed: {lines[3].split(': ', 1)[1].split(' (elapsed')[0]}"]


def test_a_single_run_still_prints_its_log(tmp_path, data_root):
    result = train_here(*QUICK, *ONE_BATCH, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[src.train][INFO] - test/acc=" in result.stdout and "Restoring states from the checkpoint" in result.stdout


def test_inside_a_job_lines_go_to_the_files_alone_and_warnings_are_kept(tmp_path):
    root, log = logging.getLogger(), tmp_path / "train.log"
    file, screen = logging.FileHandler(log), logging.StreamHandler(io.StringIO())
    saved, level = root.handlers[:], root.level
    root.handlers[:] = [file, screen]
    root.setLevel(logging.INFO)
    try:
        with lines_to_files() as kept:
            assert console.in_files is kept
            logging.getLogger("src.train").info("epoch 1/1")
            logging.getLogger("src.launch.load").warning("the machine is\n busy")
        logging.getLogger("src.train").info("after the job")
    finally:
        root.handlers[:], root.level = saved, level
        file.close()
    assert console.in_files is None and kept.lines == ["warning: the machine is busy"]
    assert log.read_text().splitlines() == ["epoch 1/1", "the machine is\n busy".splitlines()[0], " busy", "after the job"]
    assert screen.stream.getvalue() == "after the job\n"


def test_an_end_line_says_the_jobs_warnings_and_a_failed_jobs_log(tmp_path):
    said = []
    lines = Progress(2, say=said.append)
    lines.ended(0, "a", JobReturn(status=JobStatus.COMPLETED, _return_value=Result({}, "test/acc=0.5 -> out/a")),
                ["warning: busy", "warning: busy", "error: disk"])
    assert said[0].startswith("job 1/2 done: a: test/acc=0.5 -> out/a; warning: busy; error: disk (elapsed")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train.log").write_text("error: loss diverged\n")
    hydra = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "b")}, "job": {"name": "train"}}})
    lines.ended(1, "b", JobReturn(status=JobStatus.FAILED, hydra_cfg=hydra, _return_value=RunFailed("loss diverged")))
    assert said[1].startswith(f"job 2/2 failed: b: loss diverged; its log: {tmp_path / 'b' / 'train.log'} (elapsed")


def test_a_launchers_failed_return_is_read_without_hydras_line():
    failed = quiet(JobReturn(overrides=["seed=x"], status=JobStatus.FAILED, _return_value=UsageError("seed=x")))
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        try:
            _ = failed.return_value
        except UsageError as error:
            assert str(error) == "seed=x"
        else:
            raise AssertionError("a failed job's value raises its error")
    assert stderr.getvalue() == "" and failed.overrides == ["seed=x"]
    assert quiet(JobReturn(status=JobStatus.COMPLETED, _return_value=3)).return_value == 3


@pytest.mark.slow
def test_a_ddp_jobs_workers_keep_their_lines_in_its_logs(tmp_path, data_root, capfd):
    """The job's ranks are processes of their own, on the sweep's terminal: they print their warnings alone."""
    folder = tmp_path / "sweep"
    result = train_with_ranks(capfd, "-m", "strategy=ddp", "devices=2", *QUICK, *ONE_BATCH, f"hydra.sweep.dir={folder}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 3 and lines[-1].startswith("sweep of 1 job: 1 done"), lines
    [job] = job_folders(folder)
    assert "[src.train][INFO] - test/acc=" in (job / "train.log").read_text()

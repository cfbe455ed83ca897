"""Speed figures that say when the machine disturbed them: each epoch's competition is measured, a disturbed epoch
time is marked on the result line and in the report, and a speed-up from mostly disturbed runs is left out."""

import csv
import logging
import os

import pytest
import torch

from src.callbacks.disturbance import Disturbance, EpochLoad, is_disturbed
from src.launch import cli, load
from src.launch.load import busy_line, others_runnable_now, runnable_tasks
from src.records import Result
from src.report import main as report_main
from src.report import spread_cells
from tests.helpers import QUICK, call_main, job_config
from tests.test_report import config, write_run
from tests.test_timing import Clock




def test_the_runnable_tasks_are_read_from_the_kernel(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nctxt 99\nprocs_running 7\nprocs_blocked 0\n")
    assert runnable_tasks(stat) == 7
    stat.write_text("cpu  1 2 3\n")
    assert runnable_tasks(stat) is None and runnable_tasks(tmp_path / "none") is None


def test_the_work_ready_beside_a_start_is_the_median_of_a_few_readings_less_the_reader():
    readings, waits = iter([3, 9, 4, 3, 5]), []
    assert others_runnable_now(lambda: next(readings), waits.append) == 3  # 2, 8, 3, 2, 4 beside the reader
    assert waits == [0.02] * 4
    assert others_runnable_now(lambda: None, waits.append) is None


def test_a_machine_is_busy_when_the_run_and_other_work_want_more_than_its_cores_and_the_line_says_what_to_do():
    assert busy_line(None, 2, 2) is None and busy_line(0, 2, 2) is None  # unknown, or nothing beside the run
    assert busy_line(3, 4, 16) is None and busy_line(1, 1, 2) is None  # there is room beside the run
    line = busy_line(1, 2, 2)  # a 2-thread run beside one busy loop on 2 cores
    assert line.startswith("the machine is busy: 1 task of other work is ready to run beside this run's 2 threads "
                           "on 2 cores, so its times will be slow and uneven")
    assert "on a quiet machine" in line and "OMP_NUM_THREADS=1" in line and "\n" not in line
    assert "beside this sweep's 1 thread on 1 core," in busy_line(4, 1, 1, "sweep")


@pytest.fixture
def machine(monkeypatch):
    """This process as one that may use every core of a machine whose ready tasks the test sets (the reader too)."""
    cores = os.cpu_count() or 1
    monkeypatch.setattr(load, "usable_cores", lambda: list(range(cores)))
    ready = {"tasks": 1}
    monkeypatch.setattr(load, "runnable_tasks", lambda: ready["tasks"])
    return cores, ready


def test_a_run_started_on_a_busy_machine_says_so_in_one_line_before_it_trains(tmp_path, machine, caplog, capsys):
    cores, ready = machine
    trained = []
    threads = torch.get_num_threads()  # what a run of one process computes with, here
    for name, others in (("quiet", 0), ("busy", cores)):  # beside the run's threads, as many ready tasks as cores
        ready["tasks"] = others + 1
        caplog.clear()
        cfg = job_config(*QUICK, run_dir=tmp_path / name)
        with caplog.at_level(logging.INFO):
            cli.run_job(cfg, lambda cfg: trained.append(caplog.text) or Result({}, "done"))
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == ([] if name == "quiet" else [busy_line(cores, threads, cores)])
    assert "the machine is busy" in trained[-1], "said before the run started"


def test_a_process_on_some_cores_and_a_rank_torchrun_started_say_nothing(tmp_path, machine, caplog, monkeypatch):
    cores, ready = machine
    ready["tasks"] = cores + 5
    monkeypatch.setattr(load, "usable_cores", lambda: [0])  # a job of a side-by-side sweep, or a `taskset`
    with caplog.at_level(logging.INFO):
        load.say_if_busy(1)
    assert not caplog.records
    monkeypatch.setattr(load, "usable_cores", lambda: list(range(cores)))
    for name, value in (("RANK", "0"), ("GROUP_RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                        ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    cli.run_job(job_config(*QUICK, run_dir=tmp_path / "rank"), lambda cfg: Result({}, "done"))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_an_epoch_beside_other_work_is_disturbed_and_its_cpu_share_falls():
    wall, cpu = Clock(), Clock()
    epoch = EpochLoad(own=2, threads=2, cores=2, clock=wall, cpu_clock=cpu)
    for runnable in (4, 3, 5, 2):  # the run's 2 threads and 2, 1, 3, 0 others
        wall.now += 1.0
        cpu.now += 1.0  # half of what two threads could have used
        epoch.sample(runnable)
    figures = epoch.figures()
    assert figures["usage/others_runnable"] == pytest.approx(1.5)
    assert figures["usage/cpu_share"] == pytest.approx(0.5)
    assert figures["usage/disturbed"] == 1.0


def test_other_work_that_fits_beside_the_run_does_not_disturb_it():
    assert not is_disturbed(others=3.0, own=4, cores=16, cpu_share=0.5)  # a 16-core machine with room to spare
    assert not is_disturbed(others=0.2, own=2, cores=2, cpu_share=0.5)  # a passing blip
    assert not is_disturbed(others=None, own=2, cores=2, cpu_share=0.5)  # not measured (no /proc)
    # A quiet 2-rank DDP run on 2 cores: its communication is runnable beside its compute threads, and it got its CPU.
    assert not is_disturbed(others=1.0, own=2, cores=2, cpu_share=0.93)
    assert is_disturbed(others=2.1, own=2, cores=2, cpu_share=0.34)  # the same run beside one busy loop


def test_samples_are_taken_every_half_second_at_most():
    wall = Clock()
    epoch = EpochLoad(own=1, threads=1, cores=2, clock=wall, cpu_clock=Clock())
    assert not epoch.due()
    wall.now = 0.6
    assert epoch.due()
    epoch.sample(1)
    assert not epoch.due() and epoch.others == [0]


def test_the_verdict_counts_the_disturbed_epochs_and_survives_a_resume():
    callback = Disturbance()
    assert callback.verdict() == ""
    callback.disturbed = [False, True, True]
    resumed = Disturbance()
    resumed.load_state_dict(callback.state_dict())
    assert resumed.verdict().startswith("2 of 3 epoch times disturbed: other work ran beside the run")


def test_a_few_seeds_give_no_interval_that_reaches_past_what_can_be():
    mean, sd, interval = spread_cells([0.0, 105.851], 3, 0.0, float("inf"))  # the printed [0.000, 105.851]
    assert interval == "n=2 too small" and float(mean) == pytest.approx(52.93, abs=0.01)
    assert spread_cells([0.80, 0.84, 0.85], 4, 0.0, 1.0)[2].startswith("[0.7")


def test_the_report_marks_disturbed_times_and_leaves_out_speed_ups_they_spoil(tmp_path):
    root = tmp_path / "outputs"
    write_run(root / "one", config("ddp", 1), {"time/epoch_s": [4.0, 4.0], "usage/disturbed": [0.0, 0.0]})
    write_run(root / "two", config("ddp", 2), {"time/epoch_s": [2.0, 2.0, 2.0], "usage/disturbed": [1.0, 0.0, 0.0]})
    write_run(root / "four", config("ddp", 4), {"time/epoch_s": [1.0, 9.0], "usage/disturbed": [1.0, 1.0]})
    result = call_main(report_main, str(root))
    assert result.returncode == 0, result.stderr
    with (root / "report.csv").open(newline="") as file:
        rows = {row["run"]: row for row in csv.DictReader(file)}
    assert (rows["one"]["disturbed"], rows["two"]["disturbed"], rows["four"]["disturbed"]) == ("0/2", "1/3", "2/2")
    assert float(rows["two"]["speedup"]) == pytest.approx(2.0)  # kept, and marked in report.md
    assert rows["four"]["speedup"] == ""
    markdown = (root / "report.md").read_text()
    [two] = [line for line in markdown.splitlines() if line.startswith("| two |")]
    [four] = [line for line in markdown.splitlines() if line.startswith("| four |")]
    assert "| 2.000* |" in two and "| 2.00* |" in two and "| 1/3 |" in two
    assert "| left out* |" in four
    assert "Speed-ups left out: four (four: half the epochs or more disturbed)." in markdown

"""Speed figures that say when the machine disturbed them: each epoch's competition is measured, a disturbed epoch
time is marked on the result line and in the report, and a speed-up from mostly disturbed runs is left out."""

import csv

import pytest

from src.callbacks.disturbance import Disturbance, EpochLoad, is_disturbed, runnable_tasks
from src.report import main as report_main
from src.report import spread_cells
from tests.helpers import call_main
from tests.test_report import config, write_run
from tests.test_timing import Clock




def test_the_runnable_tasks_are_read_from_the_kernel(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nctxt 99\nprocs_running 7\nprocs_blocked 0\n")
    assert runnable_tasks(stat) == 7
    stat.write_text("cpu  1 2 3\n")
    assert runnable_tasks(stat) is None and runnable_tasks(tmp_path / "none") is None


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

"""Speed figures that say when the machine disturbed them: each epoch's competition is measured, a disturbed epoch
time is marked on the result line and in the report, and a speed-up from mostly disturbed runs is left out."""

import csv
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from src.callbacks.disturbance import (Competition, Disturbance, EpochLoad, competition, core_ticks, descendants,
                                      process_ticks, read_proc, run_root, thread_times)
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


FIXTURES = Path(__file__).parent / "fixtures" / "disturbance"  # recorded by tests/fixtures/disturbance/record.py


def recorded(name: str, cores: list[int] | None = None) -> Competition:
    """A recorded interval's figures, on the cores it was recorded with unless told others."""
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    return competition(fixture["start"], fixture["end"], fixture["cores"] if cores is None else cores)


@pytest.mark.parametrize("name", ["oversubscribed_quiet", "ddp4_quiet"])
def test_a_run_with_more_threads_than_cores_waits_for_itself_and_is_not_disturbed(name):
    measured = recorded(name)  # 4 busy processes, or the README's `strategy=ddp devices=4`, on 2 cores
    assert measured.waited > 0.3  # its own processes queue for the cores
    assert measured.others < 0.05 and not measured.disturbed()


@pytest.mark.parametrize("name", ["oversubscribed_busy", "ddp4_busy"])
def test_the_same_run_beside_a_busy_loop_is_disturbed(name):
    measured = recorded(name)
    assert measured.others > 0.15 and measured.disturbed()


def test_a_taskset_run_is_judged_on_its_own_cores():
    quiet, busy = recorded("taskset_quiet"), recorded("taskset_busy")  # one process on core 0 of 2
    assert quiet.others < 0.05 and not quiet.disturbed()  # the busy loop ran on core 1
    assert recorded("taskset_quiet", cores=[0, 1]).others > 0.4  # on the machine's cores it would have counted
    assert busy.others > 0.4 and busy.disturbed()  # the busy loop ran on core 0 too


def test_other_work_on_cores_the_run_leaves_idle_does_not_disturb_it():
    measured = recorded("fits_beside")  # one busy process and one busy loop on 2 cores
    assert measured.others > 0.4 and measured.waited < 0.05 and not measured.disturbed()


def test_the_rule_needs_both_other_work_on_the_run_s_cores_and_the_run_waiting():
    assert Competition(others=0.1, waited=0.1).disturbed()
    assert not Competition(others=0.09, waited=0.9).disturbed() and not Competition(others=0.9, waited=0.09).disturbed()
    assert Competition(others=0.5, waited=None).disturbed()  # no thread times (a kernel without schedstat)


STAT = """cpu  30 0 10 100 5 0 0 2 0 0
cpu0 10 0 5 60 5 0 0 0 0 0
cpu1 20 0 5 40 0 0 0 2 0 0
ctxt 99
"""


def test_busy_ticks_are_all_but_idle_and_iowait_of_the_cores_asked_for():
    assert core_ticks(STAT, [1]) == (27, 67)
    assert core_ticks(STAT, [0, 1]) == (42, 147) and core_ticks(STAT, [5]) == (0, 0)


def test_a_process_s_ticks_are_its_own_and_its_waited_for_children_s_whatever_its_name():
    line = "4321 (pt (main) 1) S 77 4321 1 0 -1 4194560 10 0 0 0 120 30 7 3 20 0 9 0 500 1000 100"
    assert process_ticks(line) == (4321, 77, 160)
    assert thread_times("1049670697 333557 26\n") == (1049670697, 333557)


def test_the_run_is_the_tree_below_its_root():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1}  # 10 launches ranks 11 and 12; 13 is a rank's worker
    assert descendants(parents, 10) == {10, 11, 12, 13} and descendants(parents, 13) == {13}


def test_a_process_that_ended_still_counts_as_the_run_s_through_its_parent():
    line = "{pid} (python) S {ppid} 0 0 0 -1 0 0 0 0 0 {utime} 0 {cutime} 0 20 0 1 0 1 1 1"
    start = {"/proc/stat": "cpu0 100 0 0 100 0 0 0 0\n",
             "/proc/10/stat": line.format(pid=10, ppid=1, utime=20, cutime=0),
             "/proc/11/stat": line.format(pid=11, ppid=10, utime=50, cutime=0)}
    # The root used 20 ticks more; its worker 30 more, then ended, and its 80 are the root's now. Others used 40.
    end = {"/proc/stat": "cpu0 190 0 0 110 0 0 0 0\n", "/proc/10/stat": line.format(pid=10, ppid=1, utime=40, cutime=80)}
    assert competition(start, end, [0]).others == pytest.approx(40 / 100)


def test_this_process_reads_its_own_tree_and_threads_from_proc():
    pid = os.getpid()
    first, second = read_proc(pid), read_proc(pid)
    assert f"/proc/{pid}/stat" in first and f"/proc/{pid}/task/{pid}/schedstat" in first and "/proc/stat" in first
    measured = competition(first, second, sorted(os.sched_getaffinity(0)))
    assert 0 <= measured.others <= 1 and (measured.waited is None or 0 <= measured.waited <= 1)


def test_a_rank_s_run_is_its_launcher_s_tree(monkeypatch):
    for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert run_root() == os.getpid()
    for name, value in (("RANK", "1"), ("GROUP_RANK", "0"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    assert run_root() == os.getppid()


def test_an_epoch_logs_what_other_work_took_its_cpu_share_and_the_mark():
    fixture = json.loads((FIXTURES / "oversubscribed_busy.json").read_text())
    wall, cpu = Clock(), Clock()
    epoch = EpochLoad(threads=2, cores=fixture["cores"], start=fixture["start"], clock=wall, cpu_clock=cpu)
    wall.now, cpu.now = 4.0, 4.0  # half of what two threads could have used
    figures = epoch.figures(fixture["end"])
    assert figures["usage/others_share"] == pytest.approx(recorded("oversubscribed_busy").others)
    assert figures["usage/cpu_share"] == pytest.approx(0.5) and figures["usage/disturbed"] == 1.0
    unmeasured = EpochLoad(threads=1, cores=[0], start=None, clock=Clock(), cpu_clock=Clock()).figures(None)
    assert unmeasured == {"usage/cpu_share": 1.0, "usage/disturbed": 0.0}  # no /proc: not measured, not marked


def test_gpu_utilization_is_sampled_every_half_second_at_most():
    wall = Clock()
    epoch = EpochLoad(threads=1, cores=[0], start=None, clock=wall, cpu_clock=Clock())
    assert not epoch.due()
    wall.now = 0.6
    assert epoch.due()
    epoch.sample(40.0)
    assert not epoch.due()
    wall.now = 1.2
    epoch.sample(60.0)
    assert epoch.figures(None)["usage/gpu_util"] == pytest.approx(50.0)


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


def test_the_report_marks_disturbed_times_and_shows_the_speed_ups_they_spoil_marked(tmp_path):
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
    markdown = (root / "report.md").read_text()
    [two] = [line for line in markdown.splitlines() if line.startswith("| two |")]
    [four] = [line for line in markdown.splitlines() if line.startswith("| four |")]
    assert "| 2.000* |" in two and "| 2.00* |" in two and "| 1/3 |" in two
    assert float(rows["four"]["speedup"]) == pytest.approx(0.8) and "| 5.000* |" in four and "| 0.80* |" in four
    assert "each such figure is marked `*` here" in markdown  # shown, marked, never left out

"""`benchmarks/gpu_check.sh` and its record, on CPU: the command line, and the summary of logs of each kind it
reads (pytest's JUnit reports, speed.py's table, run folders of a sweep over seeds), written here with known figures
and read in this process."""

import subprocess
import sys

import pytest

from tests.helpers import REPO, user_env

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


@pytest.mark.parametrize(("part", "data", "error"), [
    ("speed", None, "error: part=speed: choose one of quick tests ddp2 speed-lenet speed-resnet18 accuracy or all"),
    ("tests", "missing", "error: data root=missing: no FashionMNIST/raw in it"),
])
def test_a_wrong_part_or_data_root_is_one_line_and_exit_2(tmp_path, data_root, part, data, error):
    result = subprocess.run(["bash", str(SCRIPT), part, str(data or data_root), str(tmp_path / "logs")], cwd=tmp_path,
                            env=user_env(), capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr.strip()) == (2, error)
    assert not (tmp_path / "logs").exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu" name="test_16_mixed_on_one_gpu[auto-lenet]" time="0.5"><skipped message="needs a CUDA GPU"/></testcase>
<testcase classname="tests.test_sample" name="test_prints_a_figure" time="1.25"><system-out>----- Captured stdout -----
two ranks end 1.2e-03 of a step from one process</system-out></testcase>
<testcase classname="tests.test_sample" name="test_fails" time="0.1"><failure message="assert 1 == 2"/></testcase>
</testsuite></testsuites>
"""
SPEED_LOG = "loading...\nlenet, batch 256, 8 steps; torch 2.14.1, 2 timed rounds\n| variant | ms a step |\n| plain fp32 | 1.5 |\n"


def gpu_summary_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "benchmarks" / "gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_of_fixture_logs_holds_each_result_the_speed_table_and_the_seed_statistics(tmp_path):
    """What each part leaves, written here with known figures: the record reads them, and says what is missing."""
    from tests.test_report import write_run

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "environment.log").write_text("NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB\ntorch 2.11.0\n")
    (logs / "tests.status").write_text("0 61\n")
    (logs / "ddp2.status").write_text("1 30\n")
    (logs / "ddp2.xml").write_text(JUNIT)
    (logs / "speed-lenet.log").write_text(SPEED_LOG)
    for seed, accuracy in ((1, 0.84), (2, 0.86)):
        write_run(logs / "accuracy" / "d2l_lenet" / f"seed={seed}", {"model_name": "lenet", "strategy_name": "auto",
                                                                   "devices": 1, "num_nodes": 1, "seed": seed},
                  {"test/acc": [accuracy], "time/epoch_s": [2.0, 3.0], "usage/tflops_per_s": [0.5]},
                  {"precision_used": "bf16-mixed"})
    text, passed = gpu_summary_module().summary(logs)
    assert not passed and "NVIDIA H100 80GB HBM3" in text  # tests' report is missing, and one of ddp2's failed
    assert "| tests | passed | 61 |" in text and "| ddp2 | failed (exit status 1) | 30 |" in text
    assert "`tests`: missing" in text and "`ddp2`: 1 passed, 1 failed, 1 skipped\n" in text
    assert "| test_gpu::test_16_mixed_on_one_gpu[auto-lenet] | skipped | 0.5 |" in text
    assert "| test_sample::test_prints_a_figure | passed | 1.2 | two ranks end 1.2e-03 of a step from one process |" in text
    assert "| test_sample::test_fails | failure | 0.1 |" in text
    assert "| plain fp32 | 1.5 |" in text.split("### lenet", 1)[1].split("### resnet18", 1)[0]
    assert "### resnet18\n\nmissing" in text
    assert "| d2l_lenet | 1: 0.8400, 2: 0.8600 | 0.8500 ± 0.0141 | 2.500 | bf16-mixed | 0.5 |  |" in text  # no MFU on a CPU run
    assert "| d2l_resnet18 | missing |" in text


def test_the_quick_record_of_fixture_logs_holds_each_parts_end_and_the_recipes_against_the_books_bars(tmp_path):
    """Logs as `gpu_check.sh quick` leaves them (one part out of time, one recipe missing, one below its bar): the
    record says each, and that a recipe missed its bar."""
    from tests.test_report import write_run

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "environment.log").write_text("NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB\n")
    (logs / "recipes.status").write_text("0 95\n")
    (logs / "graphs.status").write_text("124 180\n")
    (logs / "graphs.xml").write_text(JUNIT)
    (logs / "speed-resnet18.log").write_text(SPEED_LOG.replace("plain fp32", "framework ddp without comm callback"))
    write_run(logs / "recipes" / "lenet", {"model_name": "lenet", "strategy_name": "auto", "devices": 1, "num_nodes": 1,
                                           "seed": 1}, {"test/acc": [0.61], "val/acc": [0.6], "time/epoch_s": [1.5]},
              {"precision_used": "bf16-mixed"})
    text, passed = gpu_summary_module().summary(logs, quick=True)
    assert not passed and text.startswith("# GPU check (quick)")
    assert "| recipes | passed | 95 |" in text and "| graphs | out of time | 180 |" in text
    assert "| d2l_lenet | 0.6100 | 0.83 | 0.600 | 1.50 | bf16-mixed | NO |" in text  # one epoch: nothing to rise above
    assert "| d2l_resnet18 | missing | 0.9 |" in text
    assert "`graphs`: 1 passed, 1 failed, 1 skipped: NOT A PASS, 1 skipped, and quick skips nothing" in text
    assert "`nccl`: missing" in text
    assert "framework ddp without comm callback" in text.split("### resnet18", 1)[1]


SKIPPED = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.test_gpu" name="test_graphs[lenet]" time="0.5"><skipped message="needs a CUDA GPU"/></testcase>
<testcase classname="tests.test_gpu" name="test_graphs[resnet18]" time="0.5"><skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>
"""
PASSED = SKIPPED.replace('<skipped message="needs a CUDA GPU"/>', "")
EMPTY = '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="0"></testsuite></testsuites>'


@pytest.mark.parametrize(("report", "verdict"), [
    (SKIPPED, "`graphs`: 0 passed, 0 failed, 2 skipped: NOT A PASS, no test ran"),
    (SKIPPED.replace('<skipped message="needs a CUDA GPU"/>', "", 1),
     "`graphs`: 1 passed, 0 failed, 1 skipped: NOT A PASS, 1 skipped, and quick skips nothing"),
    (EMPTY, "`graphs`: 0 passed, 0 failed, 0 skipped: NOT A PASS, no test ran"),
    (PASSED, "`graphs`: 2 passed, 0 failed, 0 skipped\n"),
])
def test_quick_is_no_pass_where_pytest_exited_0_but_a_test_was_skipped_or_none_ran(tmp_path, report, verdict):
    """Without a GPU every gpu test is skipped and pytest exits 0: the record must not call that a pass."""
    from tests.test_report import write_run

    logs = tmp_path / "logs"
    for part in ("syncbn", "syncbn-resnet18", "graphs", "nccl"):
        (logs / f"{part}.status").parent.mkdir(exist_ok=True)
        (logs / f"{part}.status").write_text("0 10\n")
        (logs / f"{part}.xml").write_text(PASSED)
    (logs / "graphs.xml").write_text(report)
    for model, experiment, accuracy in (("lenet", "d2l_lenet", 0.85), ("resnet18", "d2l_resnet18", 0.91)):
        write_run(logs / "recipes" / model, {"model_name": model, "strategy_name": "auto", "devices": 1, "num_nodes": 1,
                                             "seed": 1}, {"test/acc": [accuracy], "val/acc": [0.7, 0.8]},
                  {"precision_used": "bf16-mixed"})
    text, passed = gpu_summary_module().summary(logs, quick=True)
    assert verdict in text
    assert passed is (report is PASSED)


@pytest.mark.slow
def test_the_check_without_a_gpu_fails_in_one_line_and_leaves_no_record(tmp_path, data_root):
    """On this machine (no CUDA) every check would be skipped: the script says so and fails, before any part runs."""
    result = subprocess.run(["bash", str(SCRIPT), "quick", str(data_root), str(tmp_path / "logs")], cwd=tmp_path,
                            env={**user_env(), "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: no CUDA GPU here ({sys.executable}: torch.cuda.is_available() is false "
                                     "or torch is missing); these checks need one")
    assert not (tmp_path / "logs").exists()

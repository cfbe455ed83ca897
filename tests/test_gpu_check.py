"""`benchmarks/gpu_check.sh` and its record, on CPU: the command line, and a summary built from real outputs
of each kind it reads (pytest's JUnit reports, speed.py's table, a sweep over seeds)."""

import subprocess
import sys

import pytest

from tests.helpers import QUICK, REPO, run_cli, train, user_env

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


SAMPLE_TESTS = """
def test_prints_a_figure():
    print("two ranks end 1.2e-03 of a step from one process")

def test_fails():
    assert 1 == 2
"""


def write_part_logs(tmp_path, logs, report: str, speed_log: str, rows: str, data_root) -> None:
    """What a tests part and a speed part leave: a JUnit report of SAMPLE_TESTS, and speed.py's table of `rows`."""
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_logging=system-out",
                    f"--junitxml={logs / report}", str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True)
    speed = run_cli("benchmarks.speed", "--data-root", str(data_root), "--model", "tiny", "--steps", "8", "--rounds", "2",
                    "--only", rows, timeout=300)
    assert speed.returncode == 0, speed.stderr[-3000:]
    (logs / speed_log).write_text(speed.stdout)


@pytest.mark.slow
def test_the_summary_holds_each_tests_result_the_speed_table_and_the_seed_statistics(tmp_path, data_root):
    logs = tmp_path / "logs"
    # The `tests` part for real: on this CPU every gpu test is collected and skipped.
    checked = subprocess.run(["bash", str(SCRIPT), "tests", str(data_root), str(logs)], cwd=REPO,
                             env={**user_env(), "PYTHON": sys.executable},
                             capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "torch " in (logs / "environment.log").read_text()

    write_part_logs(tmp_path, logs, "ddp2.xml", "speed-lenet.log", "plain fp32", data_root)
    sweep = train("-m", *QUICK, "seed=1,2", f"hydra.sweep.dir={logs / 'accuracy' / 'd2l_lenet'}")
    assert sweep.returncode == 0, sweep.stderr[-3000:]

    result = run_cli("benchmarks.gpu_summary", str(logs), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (logs / "summary.md").read_text()
    assert text == result.stdout
    tests_line = next(line for line in text.splitlines() if line.startswith("`tests`:"))
    assert tests_line.startswith("`tests`: 0 passed, 0 failed") and "| test_gpu::test_16_mixed_on_one_gpu[auto-lenet] | skipped |" in text
    assert "`ddp2`: 1 passed, 1 failed" in text
    assert "| test_sample::test_prints_a_figure | passed |" in text and "two ranks end 1.2e-03 of a step" in text
    assert "| test_sample::test_fails | failure |" in text
    assert "plain fp32" in text.split("### lenet", 1)[1].split("### resnet18", 1)[0]
    assert "### resnet18\n\nmissing" in text
    lenet_row = next(line for line in text.splitlines() if line.startswith("| d2l_lenet |"))
    cells = [cell.strip() for cell in lenet_row.strip("|").split("|")]
    assert cells[1].startswith("1: 0.") and ", 2: 0." in cells[1] and " ± " in cells[2] and float(cells[3]) > 0
    assert float(cells[5]) > 0 and cells[6] == ""  # TFLOP/s a device; MFU only on a GPU that Lightning's table lists
    assert "| d2l_resnet18 | missing |" in text


@pytest.mark.slow
def test_the_quick_record_holds_each_parts_end_and_the_recipes_against_the_books_bars(tmp_path, data_root):
    """Logs as `gpu_check.sh quick` leaves them (one part out of time, one recipe missing, one below its bar): the
    record says each, and its exit status says a recipe missed its bar."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "environment.log").write_text("NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB\n")
    (logs / "recipes.status").write_text("0 95\n")
    (logs / "graphs.status").write_text("124 180\n")
    write_part_logs(tmp_path, logs, "graphs.xml", "speed-resnet18.log", "framework ddp,framework ddp without comm callback",
                    data_root)
    sweep = train("-m", *QUICK, "seed=1", f"hydra.sweep.dir={logs / 'recipes'}")  # LeNet, one short epoch: below the bar
    assert sweep.returncode == 0, sweep.stderr[-3000:]

    result = run_cli("benchmarks.gpu_summary", str(logs), "--quick", timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    text = (logs / "summary.md").read_text()
    assert text == result.stdout and text.startswith("# GPU check (quick)")
    assert "| recipes | passed | 95 |" in text and "| graphs | out of time | 180 |" in text
    lenet_row = next(line for line in text.splitlines() if line.startswith("| d2l_lenet |"))
    cells = [cell.strip() for cell in lenet_row.strip("|").split("|")]
    assert 0 <= float(cells[1]) < 0.83 and cells[2] == "0.83" and cells[6] == "NO"
    assert len(cells[3].split(", ")) == 1  # one epoch's val/acc: nothing to rise above
    assert "| d2l_resnet18 | missing | 0.9 |" in text
    assert "`graphs`: 1 passed, 1 failed" in text and "`nccl`: missing" in text
    assert "framework ddp without comm callback" in text.split("### resnet18", 1)[1]


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
    assert passed and "NVIDIA H100 80GB HBM3" in text
    assert "| tests | passed | 61 |" in text and "| ddp2 | failed (exit status 1) | 30 |" in text
    assert "`tests`: missing" in text and "`ddp2`: 1 passed, 1 failed" in text
    assert "| test_gpu::test_16_mixed_on_one_gpu[auto-lenet] | skipped | 0.5 |" in text
    assert "| test_sample::test_prints_a_figure | passed | 1.2 | two ranks end 1.2e-03 of a step from one process |" in text
    assert "| test_sample::test_fails | failure | 0.1 |" in text
    assert "| plain fp32 | 1.5 |" in text.split("### lenet", 1)[1].split("### resnet18", 1)[0]
    assert "### resnet18\n\nmissing" in text
    assert "| d2l_lenet | 1: 0.8400, 2: 0.8600 | 0.8500 ± 0.0141 | 2.500 | bf16-mixed | 0.5 |  |" in text  # no MFU on a CPU run
    assert "| d2l_resnet18 | missing |" in text

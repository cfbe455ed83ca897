"""One record of `benchmarks/gpu_check.sh`: the machine, each test's result, and every figure, from its log folder.

    python benchmarks/gpu_summary.py <log folder>     # writes <log folder>/summary.md and prints it

Reads what the parts left there: `environment.log` (device, driver, versions), `<part>.xml` (pytest's
JUnit report, with what each test printed), `speed-<model>.log` (benchmarks/speed.py's table) and
`accuracy/<experiment>/` (a sweep over seeds: test accuracy per seed, mean and standard deviation,
and the median epoch time, model TFLOP/s a device and MFU). A part that did not run is said to be missing, not
left out silently.
docs/results.md § GPU is updated from this file.
"""

import argparse
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from src.errors import UsageError  # noqa: E402
from src.report import collect_runs  # noqa: E402

TEST_PARTS = ("tests", "ddp2")
SPEED_MODELS = ("lenet", "resnet18")
EXPERIMENTS = ("d2l_lenet", "d2l_resnet18")


def test_results(report: Path) -> tuple[list[str], int, int]:
    """Markdown rows of a JUnit report (test, result, seconds, what it printed); passed and failed counts."""
    rows, passed, failed = [], 0, 0
    for case in ElementTree.parse(report).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        passed += outcome == "passed"
        failed += outcome in ("failure", "error")
        lines = (line.strip() for line in (case.findtext("system-out") or "").splitlines())
        printed = " ".join(line for line in lines if line and not line.startswith("---"))  # not pytest's banner
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append(f"| {name} | {outcome} | {float(case.get('time', 0)):.1f} | {printed} |")
    return rows, passed, failed


def speed_table(log: Path) -> list[str]:
    """speed.py's printed lines from its header on, as a preformatted block."""
    lines = log.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if "; torch " in line and "timed rounds" in line), None)
    return ["(no table: the benchmark did not finish; see the log)"] if start is None else ["```", *lines[start:], "```"]


def accuracy_row(experiment: str, folder: Path) -> str:
    try:
        runs = [run for run in collect_runs(folder) if run.test_acc is not None]
    except UsageError as error:  # no run folder in it: the sweep failed before its first job wrote one
        return f"| {experiment} | none: {error} | | | | | |"
    accuracy = [run.test_acc for run in runs]
    epoch_s = [run.epoch_s for run in runs if run.epoch_s is not None]
    spread = f"{statistics.mean(accuracy):.4f} ± {statistics.stdev(accuracy):.4f}" if len(accuracy) > 1 else ""
    per_seed = ", ".join(f"{run.seed}: {run.test_acc:.4f}" for run in sorted(runs, key=lambda r: r.seed or 0))
    median_s = f"{statistics.median(epoch_s):.3f}" if epoch_s else ""
    precision = ", ".join(sorted({run.precision for run in runs}))
    tflops = [run.tflops_per_s for run in runs if run.tflops_per_s is not None]
    mfu = [run.mfu for run in runs if run.mfu is not None]
    tflops_cell = f"{statistics.median(tflops):.3g}" if tflops else ""
    mfu_cell = f"{statistics.median(mfu):.1%}" if mfu else ""
    return f"| {experiment} | {per_seed} | {spread} | {median_s} | {precision} | {tflops_cell} | {mfu_cell} |"


def summary(logs: Path) -> str:
    out = ["# GPU check", ""]
    environment = logs / "environment.log"
    out += ["## Machine", "", *(f"    {line}" for line in environment.read_text().splitlines()), ""] if environment.is_file() \
        else ["## Machine", "", "missing: environment.log", ""]

    out += ["## Tests", ""]
    for part in TEST_PARTS:
        report = logs / f"{part}.xml"
        if not report.is_file():
            out += [f"`{part}`: missing (not run, or it ended before its report)", ""]
            continue
        rows, passed, failed = test_results(report)
        out += [f"`{part}`: {passed} passed, {failed} failed", "", "| test | result | s | printed |", "|---|---|---:|---|",
                *rows, ""]

    out += ["## Speed (benchmarks/speed.py --ablation)", ""]
    for model in SPEED_MODELS:
        log = logs / f"speed-{model}.log"
        out += [f"### {model}", "", *(speed_table(log) if log.is_file() else ["missing"]), ""]

    out += ["## Accuracy at the GPU defaults, seeds 1-3", "",
            "| experiment | test acc per seed | mean ± sd | median s/epoch | precision | median TFLOP/s a device | MFU |",
            "|---|---|---|---:|---|---:|---:|"]
    for experiment in EXPERIMENTS:
        folder = logs / "accuracy" / experiment
        out.append(accuracy_row(experiment, folder) if folder.is_dir() else f"| {experiment} | missing | | | | | |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", type=Path, help="the log folder of benchmarks/gpu_check.sh")
    args = parser.parse_args()
    if not args.logs.is_dir():
        parser.error(f"{args.logs}: no such folder")
    text = summary(args.logs)
    (args.logs / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

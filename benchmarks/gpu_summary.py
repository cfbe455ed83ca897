"""One record of `benchmarks/gpu_check.sh`: the machine, each test's result, and every figure, from its log folder.

    python benchmarks/gpu_summary.py <log folder>            # writes <log folder>/summary.md and prints it
    python benchmarks/gpu_summary.py <log folder> --quick    # the record of `gpu_check.sh quick`

Exit status 1 when the record is no pass: a recipe missed its bar, a test part is missing, ran no test or had one
fail, or (quick) skipped one.

Reads what the parts left there: `environment.log` (device, driver, versions), `<part>.status` (exit status and
seconds), `<part>.xml` (pytest's JUnit report, with what each test printed), `speed-<model>.log`
(benchmarks/speed.py's table), `accuracy/<experiment>/` (a sweep over seeds: test accuracy per seed, mean and
standard deviation, and the median epoch time, model TFLOP/s a device and MFU) and quick's `recipes/` (the book's
two recipes, seed 1, against the accuracy the book reports). A part that did not run is said to be missing, not left
out silently.
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
QUICK_TEST_PARTS = ("syncbn", "syncbn-resnet18", "graphs", "nccl")
# Test accuracy the book's recipes reach in 10 epochs (Dive into Deep Learning: LeNet 0.83-0.84, ResNet-18 above 0.90).
RECIPE_BARS = {"lenet": ("d2l_lenet", 0.83), "resnet18": ("d2l_resnet18", 0.90)}


def test_results(report: Path) -> tuple[list[str], dict[str, int]]:
    """Markdown rows of a JUnit report (test, result, seconds, what it printed); how many passed, failed, skipped."""
    rows, counts = [], {"passed": 0, "failed": 0, "skipped": 0}
    for case in ElementTree.parse(report).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts["failed" if outcome == "error" else outcome.replace("failure", "failed")] += 1
        lines = (line.strip() for line in (case.findtext("system-out") or "").splitlines())
        printed = " ".join(line for line in lines if line and not line.startswith("---"))  # not pytest's banner
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append(f"| {name} | {outcome} | {float(case.get('time', 0)):.1f} | {printed} |")
    return rows, counts


def tests_verdict(counts: dict[str, int], quick: bool) -> str | None:
    """Why a test part is no pass although pytest exited 0: no test ran, or a test of quick was skipped (without a GPU
    every one is, and pytest counts that a success)."""
    if counts["passed"] + counts["failed"] == 0:
        return "no test ran"
    if quick and counts["skipped"]:
        return f"{counts['skipped']} skipped, and quick skips nothing"
    return None


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


def part_rows(logs: Path) -> list[str]:
    """Each part's exit status and seconds, from the `<part>.status` files gpu_check.sh writes."""
    rows = []
    for status in sorted(logs.glob("*.status")):
        code, seconds = status.read_text().split()
        said = "passed" if code == "0" else "out of time" if code == "124" else f"failed (exit status {code})"
        rows.append(f"| {status.stem} | {said} | {seconds} |")
    return ["| part | result | s |", "|---|---|---:|", *rows] if rows else ["no part has finished"]


def recipe_rows(folder: Path) -> tuple[list[str], bool]:
    """The book's recipes of quick, seed 1: test accuracy against the book's, val/acc by epoch; whether both passed.
    A recipe passes when its test accuracy reaches its bar and its last epoch's val/acc is above its first's."""
    try:
        runs, missing = {run.model: run for run in collect_runs(folder)}, "missing"
    except UsageError as error:  # no run folder in it: the sweep failed before its first job wrote one
        runs, missing = {}, f"missing: {error}"
    rows, passed = [], True
    for model, (experiment, bar) in RECIPE_BARS.items():
        run = runs.get(model)
        if run is None:
            rows.append(f"| {experiment} | {missing} | {bar} | | | | NO |")
            passed = False
            continue
        val_acc = [value for _, value in run.val_acc]
        met = run.test_acc is not None and run.test_acc >= bar and len(val_acc) > 1 and val_acc[-1] > val_acc[0]
        passed &= met
        test_acc = "" if run.test_acc is None else f"{run.test_acc:.4f}"
        epoch_s = "" if run.epoch_s is None else f"{run.epoch_s:.2f}"
        rows.append(f"| {experiment} | {test_acc} | {bar} | {', '.join(f'{v:.3f}' for v in val_acc)} | {epoch_s} | "
                    f"{run.precision} | {'yes' if met else 'NO'} |")
    return ["| recipe | test acc | bar | val/acc by epoch | median s/epoch | precision | passed |",
            "|---|---:|---:|---|---:|---|---|", *rows], passed


def summary(logs: Path, quick: bool = False) -> tuple[str, bool]:
    """The record as markdown, and whether it is a pass: every test part ran tests and none failed (nor, in quick, was
    skipped), and quick's recipes met their bars."""
    out = ["# GPU check" + (" (quick)" if quick else ""), ""]
    environment = logs / "environment.log"
    out += ["## Machine", "", *(f"    {line}" for line in environment.read_text().splitlines()), ""] if environment.is_file() \
        else ["## Machine", "", "missing: environment.log", ""]
    out += ["## Parts", "", *part_rows(logs), ""]

    passed = True
    if quick:
        rows, passed = recipe_rows(logs / "recipes")
        out += ["## The book's recipes at the GPU defaults, seed 1 (hydra/launcher=parallel, on one GPU)", "", *rows, ""]

    out += ["## Tests", ""]
    for part in QUICK_TEST_PARTS if quick else TEST_PARTS:
        report = logs / f"{part}.xml"
        if not report.is_file():
            out += [f"`{part}`: missing (not run, or it ended before its report)", ""]
            passed = False
            continue
        rows, counts = test_results(report)
        verdict = tests_verdict(counts, quick)
        passed &= verdict is None and counts["failed"] == 0
        out += [f"`{part}`: {', '.join(f'{n} {outcome}' for outcome, n in counts.items())}"
                + (f": NOT A PASS, {verdict}" if verdict else ""), "",
                "| test | result | s | printed |", "|---|---|---:|---|", *rows, ""]

    out += ["## Speed (benchmarks/speed.py" + ("; framework ddp: one DDP process, with and without the xfer/ callback)"
                                             if quick else " --ablation)"), ""]
    for model in ("resnet18",) if quick else SPEED_MODELS:
        log = logs / f"speed-{model}.log"
        out += [f"### {model}", "", *(speed_table(log) if log.is_file() else ["missing"]), ""]
    if quick:
        return "\n".join(out) + "\n", passed

    out += ["## Accuracy at the GPU defaults, seeds 1-3", "",
            "| experiment | test acc per seed | mean ± sd | median s/epoch | precision | median TFLOP/s a device | MFU |",
            "|---|---|---|---:|---|---:|---:|"]
    for experiment in EXPERIMENTS:
        folder = logs / "accuracy" / experiment
        out.append(accuracy_row(experiment, folder) if folder.is_dir() else f"| {experiment} | missing | | | | | |")
    return "\n".join(out) + "\n", passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", type=Path, help="the log folder of benchmarks/gpu_check.sh")
    parser.add_argument("--quick", action="store_true", help="the record of `gpu_check.sh quick`")
    args = parser.parse_args()
    if not args.logs.is_dir():
        parser.error(f"{args.logs}: no such folder")
    text, passed = summary(args.logs, args.quick)
    (args.logs / "summary.md").write_text(text)
    print(text, end="")
    if not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()

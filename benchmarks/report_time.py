"""How long a sweep's report takes after its last job: what `SweepReport` does when a sweep ends, timed.

    python benchmarks/report_time.py outputs/multirun/<sweep>            # 3 repeats on a copy of the sweep
    python benchmarks/report_time.py outputs/multirun/<sweep> --repeats 5

The sweep folder is copied first (the report writes into the folder it reads), and each repeat
reads it afresh: the runs' event files, the report's tables and plots, its scaling section, the
TensorBoard text and HParams columns. Prints the seconds of each repeat, their median, and the
share the scaling section took, measured by timing `report.scaling_section` inside it.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf  # noqa: E402

from src import report  # noqa: E402


def timed_report(sweep: Path) -> tuple[float, float]:
    """Seconds of `SweepReport.on_multirun_end` on `sweep`, and of its scaling section alone."""
    section = report.scaling_section
    spent = [0.0]

    def timed_section(root: Path, out: Path) -> str:
        start = time.perf_counter()
        try:
            return section(root, out)
        finally:
            spent[0] += time.perf_counter() - start

    report.scaling_section = timed_section
    try:
        config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
        start = time.perf_counter()
        report.SweepReport().on_multirun_end(config)
        return time.perf_counter() - start, spent[0]
    finally:
        report.scaling_section = section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a finished sweep folder (outputs/multirun/<date>_<time>)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            copy = Path(scratch) / f"sweep{repeat}"
            shutil.copytree(args.sweep, copy, ignore=shutil.ignore_patterns("report*", "scaling*", "*.png", "seeds.csv"))
            total, scaling = timed_report(copy)
            times.append(total)
            print(f"repeat {repeat + 1}: report {total:.2f} s, of which the scaling section {scaling:.2f} s")
    print(f"median of {args.repeats}: {statistics.median(times):.2f} s after the last job")


if __name__ == "__main__":
    main()

"""Wall time of one LeNet sweep, one job after another against side by side (`hydra/launcher=parallel`).

    .venv/bin/python benchmarks/parallel_sweep.py --data-root ../shared/data                         # 4 jobs, CPU
    .venv/bin/python benchmarks/parallel_sweep.py --data-root ../shared/data --jobs 8 --jobs-per-gpu 1 2 4 8  # a GPU

Each round runs the same sweep of `--jobs` jobs (seeds 1..N, `--epochs` epochs of the full data) once
under the sequential launcher and once under the parallel launcher for each `--jobs-per-gpu` value,
in turn, so that all see the same machine load; the figures are the median wall times over the
rounds, from the command's start to its exit (start-up, every job, the report), and the jobs'
median epoch times, which show what a job loses to the other beside it. Prints the machine
(CPU model, usable cores, GPU), the load average before and after each sweep, and the last sweep's
test accuracies under each launcher, to read side by side (another number of threads rounds
differently, so they may differ in the last digits). Exits 1 when a sweep fails.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from src.sysinfo import cpu_model  # noqa: E402



def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def job_figures(sweep_dir: Path) -> tuple[list[str], list[float]]:
    """Each job's test accuracy and median epoch time, from the sweep's report.csv, in job order."""
    import csv

    with open(sweep_dir / "report.csv") as file:
        rows = sorted(csv.DictReader(file), key=lambda row: int(row["seed"] or 0))
    return [row["test_acc"] for row in rows], [float(row["epoch_s"]) for row in rows]


def run_sweep(launcher: list[str], args: argparse.Namespace, folder: Path) -> float:
    seeds = ",".join(str(seed) for seed in range(1, args.jobs + 1))
    command = [sys.executable, "-m", "src.train", "-m", *launcher, f"seed={seeds}", f"data.root={args.data_root}",
               f"max_epochs={args.epochs}", "trainer.enable_progress_bar=false", *args.overrides,
               f"hydra.sweep.dir={folder}"]
    began = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        print(result.stdout[-2000:], result.stderr[-3000:], sep="\n", file=sys.stderr)
        sys.exit(f"the sweep {' '.join(launcher)} failed (exit status {result.returncode})")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", required=True, help="a folder holding FashionMNIST/raw")
    parser.add_argument("--jobs", type=int, default=4, help="jobs in the sweep (seeds 1..N)")
    parser.add_argument("--epochs", type=int, default=2, help="max_epochs of each job")
    parser.add_argument("--rounds", type=int, default=2, help="sweeps under each launcher, interleaved")
    parser.add_argument("--jobs-per-gpu", type=int, nargs="+", default=[1], help="hydra.launcher.jobs_per_gpu values to time")
    parser.add_argument("overrides", nargs="*", help="more overrides for every job, e.g. precision=32")
    args = parser.parse_args()

    gpus = gpu_names()
    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, "
          f"{', '.join(gpus) if gpus else 'no GPU'}; python {platform.python_version()}")
    print(f"sweep: LeNet, {args.jobs} jobs (seeds 1-{args.jobs}), {args.epochs} epochs each {' '.join(args.overrides)}")
    contenders = {"sequential": ["hydra/launcher=sequential"]}
    for packed in args.jobs_per_gpu:
        name = "parallel" if not gpus else f"parallel, jobs_per_gpu={packed}"
        contenders[name] = ["hydra/launcher=parallel", f"hydra.launcher.jobs_per_gpu={packed}"]
        if not gpus:
            break  # jobs_per_gpu changes nothing without a GPU
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    accs: dict[str, list[str]] = {}
    epochs: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="parallel_sweep_") as scratch:
        for round_ in range(1, args.rounds + 1):
            for name, launcher in contenders.items():
                folder = Path(scratch) / f"{round_}_{len(walls[name])}_{name.split(',')[0]}{launcher[-1].split('=')[-1]}"
                before = load()
                walls[name].append(run_sweep(launcher, args, folder))
                accs[name], epoch_s = job_figures(folder)
                epochs[name] += epoch_s
                print(f"round {round_}: {name:<30} {walls[name][-1]:7.1f} s   load before {before}, after {load()}", flush=True)
    base = statistics.median(walls["sequential"])
    print("\nmedian wall time of the sweep, and the median of its jobs' median epoch times:")
    for name, times in walls.items():
        median = statistics.median(times)
        print(f"  {name:<30} {median:7.1f} s   {base / median:4.2f}x   epoch {statistics.median(epochs[name]):5.2f} s   "
              f"test acc {' '.join(accs[name])}")


if __name__ == "__main__":
    main()

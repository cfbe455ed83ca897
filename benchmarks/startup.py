"""Where the seconds go before training starts: answers, imports, and the start of a run and of its DDP workers.

    python benchmarks/startup.py --data-root ../shared/data               # 3 repeats of each
    python benchmarks/startup.py --data-root ../shared/data --repeats 5

Each command runs in a fresh interpreter, as a user starts it, one after another; the figures are the
median wall time over the repeats, and the median CPU time (user and system) of the command and of the
processes it waited for (not the DDP workers' forkserver, which ends on its own after the command).
The runs are LeNet for one step of training, one of validation and one of test, so that what is left
is their start and end: one process, then `strategy=ddp devices=2`. For those, train.log's timestamps split the time: from the command's start to the first
line that Lightning's Trainer writes (imports, the checks, Hydra's composition, the data read into
memory), then, under DDP, to the worker's own Trainer line (the forkserver that imports the training
code, the agent's rendezvous and the workers' start), then to the first epoch's line (the process
group, the model on the device, the FLOP count, the step), then to the command's exit (test, the
record of the run, the interpreter's exit).
"""

import argparse
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
ONE_STEP = ["max_epochs=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def cpu_of_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def wall(command: list[str], expect: tuple[int, ...] = (0,)) -> tuple[float, float, float]:
    """Seconds from the command's start to its exit, the start as a Unix time, and the CPU seconds it used."""
    start, clock, cpu = time.time(), time.perf_counter(), cpu_of_children()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - clock
    if result.returncode not in expect:
        sys.exit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return seconds, start, cpu_of_children() - cpu


def stamps(log: Path, start: float) -> dict[str, float]:
    """Seconds after `start` of train.log's Trainer lines (the first and the last one) and its first epoch line."""
    trainer, epoch = [], None
    for line in log.read_text().splitlines():
        found = STAMP.match(line)
        if not found:
            continue
        at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - start
        if "GPU available:" in line:
            trainer.append(at)
        elif "src.callbacks.timing" in line and epoch is None:
            epoch = at
    return {"first Trainer": trainer[0], "last Trainer": trainer[-1], "first epoch": epoch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, required=True, help="the folder holding FashionMNIST/raw")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    python = sys.executable
    answers = {
        "python -c 'import torch'": ([python, "-c", "import torch"], (0,)),
        "python -c 'import lightning'": ([python, "-c", "import lightning"], (0,)),
        "src.train --help": ([python, "-m", "src.train", "--help"], (0,)),
        "src.train max_epoch=3 (a typo)": ([python, "-m", "src.train", "max_epoch=3"], (2,)),
        "src.eval --help": ([python, "-m", "src.eval", "--help"], (0,)),
        "src.report --help": ([python, "-m", "src.report", "--help"], (0,)),
        "src.scaling --help": ([python, "-m", "src.scaling", "--help"], (0,)),
        "src.sysinfo --help": ([python, "-m", "src.sysinfo", "--help"], (0,)),
    }
    print(f"{'command':40} {'median s':>9} {'CPU s':>6}  repeats (s)")
    for name, (command, expect) in answers.items():
        runs = [wall(command, expect) for _ in range(args.repeats)]
        times = [seconds for seconds, _, _ in runs]
        cpu = statistics.median(used for _, _, used in runs)
        print(f"{name:40} {statistics.median(times):9.2f} {cpu:6.2f}  {', '.join(f'{t:.2f}' for t in times)}")

    print(f"\nLeNet, one step of each stage; seconds after the command's start (median of {args.repeats})")
    print(f"{'run':22} {'Trainer':>8} {'workers':>8} {'1st epoch':>9} {'exit':>6} {'CPU s':>6}")
    for name, extra in {"one process": [], "ddp, 2 processes": ["strategy=ddp", "devices=2"]}.items():
        rows = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                command = [python, "-m", "src.train", f"data.root={args.data_root.resolve()}", *ONE_STEP, *extra,
                           f"hydra.run.dir={tmp}/run"]
                seconds, start, cpu = wall(command)
                rows.append({**stamps(Path(tmp, "run", "train.log"), start), "exit": seconds, "cpu": cpu})
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        workers = f"{median['last Trainer']:8.2f}" if extra else f"{'':8}"
        print(f"{name:22} {median['first Trainer']:8.2f} {workers} {median['first epoch']:9.2f} {median['exit']:6.2f} "
              f"{median['cpu']:6.2f}")


if __name__ == "__main__":
    main()

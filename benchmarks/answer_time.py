"""Wall time of the answers that need no training: `--help`, `--cfg job` and a refused config of `src.train` and
`src.eval` (a key's value, a checkpoint file or data folder that is not there, a global batch the processes do not
divide), none of which imports torch or Lightning.

    .venv/bin/python benchmarks/answer_time.py              # 5 rounds
    .venv/bin/python benchmarks/answer_time.py --rounds 9

Each round runs every command once, in turn, so that all see the same machine load; the figure of a command is its
median wall time over the rounds, from its start to its exit, as a user waits for it. For scale, the same is timed for
an interpreter that only starts, and for one that imports torch and Lightning, what these answers once cost on top.
Prints the machine (CPU model, usable cores) and the load average before and after. Exits 1 when a command exits with
another status than the one it should (0 for an answer, 2 for a refusal).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from src.sysinfo import cpu_model  # noqa: E402

# (what it is, the arguments after the interpreter, the exit status it must end with)
COMMANDS = [
    ("interpreter start", ["-c", "pass"], 0),
    ("import torch, lightning", ["-c", "import torch, lightning"], 0),
    ("src.train --help", ["-m", "src.train", "--help"], 0),
    ("  the same, Hydra listing groups", ["-m", "src.train", "--help", "-cn", "train"], 0),
    ("src.train --cfg job", ["-m", "src.train", "--cfg", "job"], 0),
    ("src.train max_epoch=3", ["-m", "src.train", "max_epoch=3"], 2),
    ("src.train strategy=nope", ["-m", "src.train", "strategy=nope"], 2),
    ("src.train devices=0", ["-m", "src.train", "devices=0"], 2),
    ("src.train max_epochs=-1", ["-m", "src.train", "max_epochs=-1"], 2),
    ("src.eval --help", ["-m", "src.eval", "--help"], 0),
    ("src.eval --cfg job", ["-m", "src.eval", "--cfg", "job"], 0),
    ("src.eval ckpt_path=x devices=0", ["-m", "src.eval", "ckpt_path=x.ckpt", "devices=0"], 2),
    # What the file system and the processes decide: also before torch (these once took ~50 s on a busy machine)
    ("src.train ckpt_path=<missing file>", ["-m", "src.train", "ckpt_path=/nonexistent/missing.ckpt"], 2),
    ("src.train data.root=<missing folder>",
     ["-m", "src.train", "data.root=/nonexistent/data", "data.download=false"], 2),
    ("src.train batch 10 over 4 processes", ["-m", "src.train", "data.batch_size=10", "strategy=ddp", "devices=4"], 2),
]



def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def timed(args: list[str], status: int) -> float:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != status:
        print(result.stdout[-2000:], result.stderr[-3000:], sep="\n", file=sys.stderr)
        sys.exit(f"{' '.join(args)} exited with {result.returncode}, not {status}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="times each command runs, interleaved")
    args = parser.parse_args()

    print(f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores; load average before: {load()}")
    walls: dict[str, list[float]] = {name: [] for name, *_ in COMMANDS}
    for _ in range(args.rounds):
        for name, arguments, status in COMMANDS:
            walls[name].append(timed(arguments, status))
    print(f"load average after: {load()}; median wall seconds of {args.rounds} runs (min-max)")
    for name, times in walls.items():
        print(f"  {name:<38} {statistics.median(times):6.2f} s  ({min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    main()

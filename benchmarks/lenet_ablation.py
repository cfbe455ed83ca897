"""What each change of `experiment=lenet_plus` adds: the recipe, then one row per change left out.

    .venv/bin/python benchmarks/lenet_ablation.py --data-root ../shared/data --out outputs/ablation
    .venv/bin/python benchmarks/lenet_ablation.py --data-root ../shared/data --out outputs/ablation --seed 2

Each row is one run of the real CLI (1 process, the recipe's 5 epochs, the given seed), in
`<out>/<row>/`; a row whose folder already holds a finished run is read, not trained again. Prints
a Markdown table: test acc (of the best `val/acc` checkpoint, as every run tests), best `val/acc`
and the median epoch time, and the change against the full recipe. Exits 1 when a run fails.
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from src.runs import RunFolder, median  # noqa: E402

# Row name -> the overrides that undo one change of conf/experiment/lenet_plus.yaml.
ROWS: dict[str, list[str]] = {
    "recipe": [],
    "no batch norm": ["model.net.batch_norm=false"],
    "average pooling, N(0, 0.01) init (the book's)": ["model.net.pool=avg", "model.net.init=normal"],
    "no momentum, no weight decay": ["optim.momentum=0.0", "optim.weight_decay=0.0"],
    "constant lr (no cosine schedule)": ["optim.schedule=none"],
    "no label smoothing": ["model.loss.label_smoothing=0.0"],
    "no mirrored images": ["data.hflip=false"],
}


def folder_name(row: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in row).strip("_")


def train(run_dir: Path, overrides: list[str], args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "src.train", "experiment=lenet_plus", f"seed={args.seed}",
               f"data.root={args.data_root}", "trainer.enable_progress_bar=false", *overrides,
               f"hydra.run.dir={run_dir}"]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def read(run_dir: Path) -> tuple[float, float, int, float] | None:
    """(test acc, best val acc, its epoch from 1, median epoch s) of a finished run; None when unfinished."""
    if not (run_dir / "config.yaml").is_file():
        return None
    run = RunFolder(run_dir, run_dir.parent)
    test, val, epochs = run.values("test/acc"), run.values("val/acc"), run.values("time/epoch_s")
    if not test or not val:
        return None
    best = max(range(len(val)), key=val.__getitem__)
    return test[-1], val[best], best + 1, median(epochs) or float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="a folder holding FashionMNIST/raw")
    parser.add_argument("--out", type=Path, required=True, help="one run folder per row goes here")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = {}
    for row, overrides in ROWS.items():
        run_dir = (args.out / f"seed{args.seed}" / folder_name(row)).resolve()
        if read(run_dir) is None:
            try:
                train(run_dir, overrides, args)
            except subprocess.CalledProcessError as error:
                print(f"error: row {row!r} failed (exit {error.returncode}); its folder: {run_dir}", file=sys.stderr)
                return 1
        results[row] = read(run_dir)
    full = results["recipe"][0]
    print(f"\n| seed {args.seed}, 5 epochs | overrides | test acc | change | best val/acc (epoch) | median epoch s |")
    print("| --- | --- | ---: | ---: | --- | ---: |")
    for row, (test, val, epoch, seconds) in results.items():
        change = "" if row == "recipe" else f"{test - full:+.4f}"
        print(f"| {row} | {' '.join(f'`{o}`' for o in ROWS[row])} | {test:.4f} | {change} | {val:.4f} ({epoch}) | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

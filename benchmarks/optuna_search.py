"""A 12-trial LeNet learning-rate search with `hydra/sweeper=optuna`, with its median pruner and without.

    .venv/bin/python benchmarks/optuna_search.py --data-root ../shared/data
    .venv/bin/python benchmarks/optuna_search.py --data-root ../shared/data --trials 20 --epochs 4

Both searches ask the same seeded sampler, one trial after another, so that their first trials are the same
points; prints, for each, the wall time from the command's start to its exit, the best `val/acc_best` and that
trial's learning rate and `test/acc`, the trials by state, and the epochs trained in all (what pruning saves).
Exits 1 when a search fails before its study exists.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from src.sysinfo import cpu_model  # noqa: E402



def search(pruner: str, args: argparse.Namespace, folder: Path) -> None:
    command = [sys.executable, "-m", "src.train", "-m", "hydra/sweeper=optuna", "model=lenet",
               "optim.lr=tag(log, interval(0.001, 0.1))", f"hydra.sweeper.n_trials={args.trials}",
               f"hydra.sweeper.pruner={pruner}", f"max_epochs={args.epochs}", f"data.root={args.data_root}",
               f"trainer.limit_train_batches={args.batches}", "trainer.enable_progress_bar=false",
               f"hydra.sweep.dir={folder}"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if not (folder / "optuna.db").is_file():  # a trial that diverged fails alone (exit 1); the study is there
        sys.exit(f"the search with pruner={pruner} failed:\n{result.stderr[-3000:]}")
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{folder / 'optuna.db'}")
    states: dict[str, int] = {}
    for trial in study.trials:
        states[trial.state.name.lower()] = states.get(trial.state.name.lower(), 0) + 1
    epochs = sum(len(trial.intermediate_values) for trial in study.trials)
    best = study.best_trial
    print(f"pruner={pruner}: {wall:.0f} s wall, best val/acc_best={best.value:.4f} at optim.lr={best.params['optim.lr']:.4g}"
          f" (trial {best.number + 1}, test/acc={best.user_attrs.get('test/acc', float('nan')):.4f}); trials "
          + ", ".join(f"{n} {state}" for state, n in sorted(states.items())) + f"; {epochs} epochs trained", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=100, help="training batches of 256 a trial takes per epoch")
    args = parser.parse_args()
    args.data_root = str(Path(args.data_root).resolve())
    print(f"{cpu_model()}; {args.trials} trials of LeNet, {args.epochs} epochs of {args.batches} batches each, "
          "the full validation and test sets", flush=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        for pruner in ("median", "none"):
            search(pruner, args, Path(folder) / pruner)


if __name__ == "__main__":
    main()

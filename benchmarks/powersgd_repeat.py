"""Is PowerSGD under gloo reliable? Repeated 2-process CPU runs of ResNet-18 through the real CLI.

    .venv/bin/python benchmarks/powersgd_repeat.py --data-root ../shared/data            # 20 runs
    .venv/bin/python benchmarks/powersgd_repeat.py --data-root ../shared/data --without-fix --runs 5

A run passes when it exits 0 within its timeout and rank 0 logged PowerSGD-compressed steps
(xfer/compression_ratio > 1). Exits 1 when any run fails.

`--without-fix` swaps in `UnfixedPowerSGDStrategy`, which keeps DDP's default buckets (three for
ResNet-18). PowerSGD then issues all-reduces from gloo's threads for several buckets at once, in a
different order on each rank, and runs die with `gloo::EnforceNotMet ... op.preamble.length <=
op.nbytes` or hang until the timeout (see docs/communication.md).
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.comm_bytes import read_scalars  # noqa: E402
from src.strategies.ddp import CommHookDDPStrategy  # noqa: E402


class UnfixedPowerSGDStrategy(CommHookDDPStrategy):
    """The strategy without its gloo fix, kept to reproduce the failure: buckets as DDP makes them."""

    def ddp_bucket_cap_mb(self, model: nn.Module) -> float | None:
        return self.bucket_cap_mb


def compressed_steps(run_dir: Path) -> int:
    """Optimizer steps rank 0 logged with PowerSGD compression."""
    return sum(ratio > 1 for ratio in read_scalars(run_dir).get("xfer/compression_ratio", []))


def run_once(run_dir: Path, args: argparse.Namespace) -> tuple[bool, str]:
    command = [
        sys.executable, "-m", "src.train", f"data.root={args.data_root}", "model=resnet18", "strategy=ddp_powersgd",
        "devices=2", "max_epochs=1", f"data.batch_size={args.batch_size}", "strategy.start_powersgd_iter=2",
        f"strategy.timeout_s={args.timeout}", f"trainer.limit_train_batches={args.steps}",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.num_sanity_val_steps=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        f"hydra.run.dir={run_dir}",
    ]
    if args.without_fix:
        command.append("strategy._target_=benchmarks.powersgd_repeat.UnfixedPowerSGDStrategy")
    # A new session, so that a hung run is killed together with the rank it launched.
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return False, f"hung: killed after {args.timeout} s"
    if process.returncode != 0:
        lines = output.splitlines()
        cause = next((line for line in lines if "enforce fail" in line), None)
        cause = cause or next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
        return False, f"exit {process.returncode}: {cause.strip()[:240]}"
    steps = compressed_steps(run_dir)
    expected = args.steps - 2
    if steps != expected:
        return False, f"{steps} compressed steps logged, expected {expected}"
    return True, f"{steps} compressed steps"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; the first 2 are plain all-reduce")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per run before it counts as hung")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--without-fix", action="store_true", help="keep DDP's several buckets to show the failure")
    args = parser.parse_args()

    passed = failed = 0
    with tempfile.TemporaryDirectory(prefix="powersgd_repeat_") as tmp:
        for i in range(1, args.runs + 1):
            start = time.perf_counter()
            ok, detail = run_once(Path(tmp) / f"run{i}", args)
            passed, failed = passed + ok, failed + (not ok)
            print(f"run {i:2d}/{args.runs}: {'pass' if ok else 'FAIL'} in {time.perf_counter() - start:5.1f} s ({detail})", flush=True)
    fix = "without the fix" if args.without_fix else "with one bucket under gloo"
    print(f"PowerSGD, ResNet-18, 2 CPU processes, {fix}: {passed} passed, {failed} failed of {args.runs}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

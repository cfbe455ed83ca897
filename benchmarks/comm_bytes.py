"""Bytes each DDP hook sends per optimizer step for ResNet-18, measured on 2 CPU processes.

    .venv/bin/python benchmarks/comm_bytes.py --data-root ../shared/data

Runs the real CLI once per strategy for a few steps and reads back what rank 0 logged to
TensorBoard: `xfer/bytes_per_step`, `xfer/compression_ratio`, `xfer/hook_ms` and
`xfer/buckets_per_step`. PowerSGD starts after 2 plain all-reduce steps; the table shows the
steps after that warm-up (the median over them). Prints a markdown table.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("ddp", "ddp_fp16", "ddp_bf16", "ddp_powersgd", "ddp_powersgd_fp16")
WARMUP_STEPS = 2
MB = 10**6


def read_scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar in the run folder's TensorBoard files, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(run_dir.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: [value for _, value in sorted(points)] for tag, points in scalars.items()}


def resnet18_params() -> int:
    sys.path.insert(0, str(ROOT))
    from src.models.resnet import resnet18

    return sum(p.numel() for p in resnet18().parameters())


def measure(strategy: str, run_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [
        sys.executable, "-m", "src.train", f"data.root={args.data_root}", "model=resnet18", f"strategy={strategy}",
        "devices=2", "max_epochs=1", f"data.batch_size={args.batch_size}", f"strategy.start_powersgd_iter={WARMUP_STEPS}",
        f"trainer.limit_train_batches={WARMUP_STEPS + args.steps}", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        sys.exit(f"{strategy} failed (exit {result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    scalars = read_scalars(run_dir)
    return {name: statistics.median(scalars[f"xfer/{name}"][WARMUP_STEPS:])
            for name in ("bytes_per_step", "compression_ratio", "hook_ms", "buckets_per_step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    args = parser.parse_args()

    params = resnet18_params()
    print(f"ResNet-18: {params:,} parameters = {params * 4 / MB:.2f} MB of fp32 gradients; 2 CPU processes (gloo)\n")
    print("| strategy | xfer/bytes_per_step | MB per step | xfer/compression_ratio | xfer/hook_ms (median) | buckets per step |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="comm_bytes_") as tmp:
        for strategy in STRATEGIES:
            m = measure(strategy, Path(tmp) / strategy, args)
            print(f"| {strategy} | {m['bytes_per_step']:,.0f} | {m['bytes_per_step'] / MB:.3f} | {m['compression_ratio']:.1f} | "
                  f"{m['hook_ms']:.0f} | {m['buckets_per_step']:.0f} |", flush=True)


if __name__ == "__main__":
    main()

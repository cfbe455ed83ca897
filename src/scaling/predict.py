"""`python -m src.scaling <run or sweep folder>`: predicted epoch time and speed-up on 1 to 1024 processes.

    python -m src.scaling outputs/runs/<run>                # scaling.md, scaling.csv, scaling_<model>.png there
    python -m src.scaling outputs/multirun/<sweep> --probe  # also time gloo here: the "measured" interconnect
    python -m src.scaling --probe                           # only the probe: outputs/probe.json

From each model's run with the fewest processes (its step time, and under DDP what it timed of
its backward pass and communication), the model's gradient shapes, and the cost model of
`src.scaling.costmodel`, for every DDP hook and interconnect. A folder that also holds multi-process DDP
runs gets a table of predicted against measured `comm/hook_ms` and epoch time. See docs/scaling.md.
"""

import csv
import os
import statistics
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import instantiate
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from src.errors import UsageError
from src.launch.console import processes
from src.runs import ArgumentParser, RunFolder, median, output_folder, read_runs, require_folder, usage_errors_exit
from src.scaling import probe as gloo_probe
from src.scaling.costmodel import INTERCONNECTS, Interconnect, Step, collectives, encode_s, predict_step
from src.strategies.ddp import HOOKS

PROCESS_COUNTS = tuple(2**k for k in range(11))  # 1 ... 1024
COLUMNS = ("model", "batch_size", "interconnect", "hook", "processes", "bytes_per_step", "compute_ms", "comm_ms",
           "exposed_ms", "epoch_s", "speedup")


@dataclass
class RunFigures:
    """What a run measured; seconds per optimizer step unless named otherwise."""

    run: str
    model: str
    batch_size: int
    processes: int
    hook: str | None  # None: one process without DDP
    powersgd_rank: int
    shapes: list[tuple[int, ...]]
    steps_per_epoch: int
    epoch_s: float  # median over epochs
    step_s: float  # median over epochs of epoch_s / steps
    exposed_comm_s: float = 0.0  # DDP's all-reduce time not hidden behind the backward pass
    backward_s: float | None = None
    overlap_frac: float | None = None
    bytes_per_step: float | None = None  # the smallest: PowerSGD's warm-up steps send more
    hook_s: float | None = None  # median over the steps that sent the smallest bytes


def read_figures(run: RunFolder) -> RunFigures | None:
    """A run's figures; None for a run without a timed epoch or one that is neither one process nor DDP."""
    config, strategy = run.config, run.config.strategy
    is_ddp = "hook" in strategy
    if not is_ddp and OmegaConf.select(strategy, "_target_") != "builtins.str":  # dp: not modelled
        return None

    def series(tag: str) -> list[tuple[int, float]]:
        """(step, value) of a scalar, or of its per-epoch mean `<tag>_epoch` when only that was logged."""
        return run.scalars(tag, f"{tag}_epoch")

    def typical(tag: str) -> float | None:
        return median(v for _, v in series(tag))

    epochs = series("time/epoch_s")
    if not epochs:
        return None
    ends = [-1] + [step for step, _ in epochs]  # Lightning files an epoch's time at its last step, global_step - 1
    steps = [max(1, b - a) for a, b in zip(ends, ends[1:])]
    figures = RunFigures(
        run=run.name, model=str(run.value("model_name", "model")), batch_size=int(config.data.batch_size),
        processes=int(config.devices) * int(config.num_nodes) if is_ddp else 1, hook=str(strategy.hook) if is_ddp else None,
        powersgd_rank=int(OmegaConf.select(strategy, "powersgd_rank", default=1)),
        shapes=[tuple(p.shape) for p in instantiate(config.model.net).parameters() if p.requires_grad],
        steps_per_epoch=int(statistics.median(steps)), epoch_s=statistics.median(s for _, s in epochs),
        step_s=statistics.median(s / n for (_, s), n in zip(epochs, steps)),
    )
    if is_ddp:
        comm, overlap = typical("comm/backward_comm_ms"), typical("comm/overlap_ms")
        figures.exposed_comm_s = max(0.0, (comm or 0.0) - (overlap or 0.0)) / 1000
        backward = typical("comm/backward_compute_ms")
        figures.backward_s = None if backward is None else backward / 1000
        figures.overlap_frac = typical("comm/overlap_frac")
        sent = series("comm/bytes_per_step")
        if sent:
            smallest = min(v for _, v in sent)
            figures.bytes_per_step = smallest
            steady = {step for step, v in sent if v == smallest}
            hook_ms = median(v for s, v in series("comm/hook_ms") if s in steady)
            figures.hook_s = None if hook_ms is None else hook_ms / 1000
    return figures


def collect(root: Path) -> list[RunFigures]:
    """Every run below `root` that the model can use."""
    runs = read_runs(root, read_figures)
    if not runs:
        raise UsageError(f"{root}: no run below it has a timed training epoch (time/epoch_s) on one process or under DDP")
    return runs


@dataclass
class Baseline:
    """One process's figures for a model and global batch, derived from its run with the fewest processes."""

    run: RunFigures
    compute_1: float  # s per step on one process (device)
    backward_1: float | None
    overlap_frac: float
    sizes: dict[str, list[int]]  # bytes of each all-reduce per hook
    encode: dict[str, float]  # s per step of each hook's own arithmetic, on this CPU

    @classmethod
    def from_run(cls, run: RunFigures, cores: int, overlap: float) -> "Baseline":
        """Undo the run's own scaling: its processes shared `cores` cores and computed 1/N of the batch each."""
        share = min(run.processes, cores)
        compute_1 = (run.step_s - run.exposed_comm_s) * share
        backward_1 = None if run.backward_s is None else run.backward_s * share
        rank = run.powersgd_rank
        return cls(run, compute_1, backward_1, overlap if run.overlap_frac is None else run.overlap_frac,
                   {h: collectives(run.shapes, h, rank) for h in HOOKS}, {h: encode_s(run.shapes, h, rank) for h in HOOKS})

    def step(self, hook: str, processes: int, link: Interconnect) -> Step:
        return predict_step(self.compute_1, self.backward_1, self.overlap_frac, self.sizes[hook], self.encode[hook], processes, link)


def load_probe(path: Path | None) -> gloo_probe.Probe | None:
    """A saved probe; None where there is no file. A file that is not a probe is a UsageError."""
    if path is None or not path.exists():
        return None
    try:
        return gloo_probe.load(path)
    except ValueError as error:
        raise UsageError(f"--probe-file {error}") from error


def measured_links(probe: gloo_probe.Probe | None) -> dict[int, Interconnect]:
    """One interconnect per probed process count: gloo between processes sharing this machine's cores."""
    if probe is None:
        return {}
    return {n: Interconnect(f"gloo here, {n} proc. fit", bandwidth, latency, "python -m src.scaling --probe", probe.cores)
            for n, (latency, bandwidth) in probe.fits().items()}


def link_for(processes: int, measured: dict[int, Interconnect]) -> Interconnect:
    """The measured fit for this process count, else the nearest one below it (or the smallest)."""
    below = [n for n in measured if n <= processes]
    return measured[max(below) if below else min(measured)]


def predictions(base: Baseline, links: list[Interconnect]) -> list[dict]:
    """One row per interconnect, hook and process count that splits the global batch evenly."""
    run, rows = base.run, []
    for link in links:
        for hook in HOOKS:
            for n in PROCESS_COUNTS:
                if run.batch_size % n:
                    continue
                step = base.step(hook, n, link)
                epoch_s = run.steps_per_epoch * step.total
                rows.append({
                    "model": run.model, "batch_size": run.batch_size, "interconnect": link.name, "hook": hook, "processes": n,
                    "bytes_per_step": sum(base.sizes[hook]) if n > 1 else 0, "compute_ms": step.compute * 1e3,
                    "comm_ms": step.comm * 1e3, "exposed_ms": step.exposed * 1e3, "epoch_s": epoch_s,
                    "speedup": run.steps_per_epoch * base.compute_1 / epoch_s,
                })
    return rows


def _ranges(counts: list[int]) -> str:
    """Powers of two as runs: [2, 4, 8, 64] -> '2-8, 64'."""
    if not counts:
        return "never"
    parts, start = [], counts[0]
    for previous, current in zip(counts, counts[1:] + [0]):
        if current != previous * 2:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(parts)


def _pct_error(predicted: float | None, measured: float | None) -> str:
    return "" if predicted is None or not measured else f"{(predicted - measured) / measured * 100:+.0f} %"


def checks(base: Baseline, runs: list[RunFigures], measured: dict[int, Interconnect]) -> list[str]:
    """Markdown rows: predicted against measured for the multi-process DDP runs of the baseline's model and batch."""
    rows = []
    for run in runs:
        if run.processes < 2 or run.hook is None or (run.model, run.batch_size) != (base.run.model, base.run.batch_size):
            continue
        link = link_for(run.processes, measured)
        step = base.step(run.hook, run.processes, link)
        epoch_s = run.steps_per_epoch * step.total
        hook_ms = None if run.hook_s is None else run.hook_s * 1e3
        rows.append(" | ".join([
            "", run.run, run.hook, str(run.processes), link.name, f"{sum(base.sizes[run.hook]):,}",
            "" if run.bytes_per_step is None else f"{run.bytes_per_step:,.0f}", f"{step.comm * 1e3:.1f}",
            "" if hook_ms is None else f"{hook_ms:.1f}", _pct_error(step.comm * 1e3, hook_ms),
            f"{epoch_s:.2f}", f"{run.epoch_s:.2f}", _pct_error(epoch_s, run.epoch_s), "",
        ]).strip())
    return rows


def section(base: Baseline, rows: list[dict], measured: dict[int, Interconnect], runs: list[RunFigures], plot: str) -> str:
    """The Markdown of one model: what was measured, speed-ups, where compression pays off, the checks."""
    run, links = base.run, [*measured.values(), *INTERCONNECTS]
    counts = sorted({r["processes"] for r in rows})
    lines = [
        f"## {run.model}, global batch {run.batch_size}", "",
        f"From `{run.run}` ({processes(run.processes)}, {run.steps_per_epoch} steps per epoch, median "
        f"{run.step_s * 1e3:.1f} ms per step): one process computes a step in {base.compute_1 * 1e3:.1f} ms"
        + ("" if base.backward_1 is None else f", {base.backward_1 * 1e3:.1f} ms of it backward")
        + f"; overlap_frac {base.overlap_frac:.2f}. Bytes per step and process, and the hook's own arithmetic on this CPU:", "",
        "| hook | all-reduces (bytes) | bytes per step | arithmetic ms |", "|---|---|---:|---:|",
        *[f"| {h} | {', '.join(f'{b:,}' for b in base.sizes[h])} | {sum(base.sizes[h]):,} | {base.encode[h] * 1e3:.1f} |"
          for h in HOOKS], "",
        "Speed-up over one process, by interconnect, hook and processes:", "",
        "| interconnect | hook | " + " | ".join(str(n) for n in counts) + " |", "|---|---|" + "---:|" * len(counts),
    ]
    speedup = {(r["interconnect"], r["hook"], r["processes"]): r["speedup"] for r in rows}
    epoch = {(r["interconnect"], r["hook"], r["processes"]): r["epoch_s"] for r in rows}
    for link in links:
        for hook in HOOKS:
            lines.append(f"| {link.name} | {hook} | " + " | ".join(f"{speedup[link.name, hook, n]:.2f}" for n in counts) + " |")
    lines += ["", "Processes at which each hook's epoch is shorter than plain all-reduce's (`none`):", "",
              "| interconnect | " + " | ".join(HOOKS[1:]) + " |", "|---|" + "---|" * (len(HOOKS) - 1)]
    for link in links:
        wins = [_ranges([n for n in counts if n > 1 and epoch[link.name, h, n] < epoch[link.name, "none", n]]) for h in HOOKS[1:]]
        lines.append(f"| {link.name} | " + " | ".join(wins) + " |")
    lines += ["", f"![predicted speed-up]({plot})", ""]
    compared = checks(base, runs, measured) if measured else []
    if compared:
        lines += ["Predicted against measured, on the measured interconnect (this machine's cores shared):", "",
                  "| run | hook | processes | fit | bytes/step predicted | measured | hook_ms predicted | measured | error "
                  "| epoch s predicted | measured | error |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
                  *compared, ""]
    return "\n".join(lines)


def plot(base: Baseline, rows: list[dict], links: list[Interconnect], path: Path) -> None:
    """One panel per interconnect: speed-up against processes, a line per hook, and the ideal."""
    columns = min(4, len(links))
    figure = Figure(figsize=(4 * columns, 3.5 * -(-len(links) // columns)))
    for index, link in enumerate(links):
        axes = figure.add_subplot(-(-len(links) // columns), columns, index + 1)
        for hook in HOOKS:
            points = [(r["processes"], r["speedup"]) for r in rows if r["interconnect"] == link.name and r["hook"] == hook]
            axes.plot(*zip(*points), marker=".", label=hook)
        counts = sorted({r["processes"] for r in rows})
        axes.plot(counts, counts, color="grey", linestyle=":", label="ideal")
        axes.set(xscale="log", yscale="log", title=link.name, xlabel="processes", ylabel="speed-up")
        axes.set_xticks(counts, [str(n) for n in counts], fontsize="x-small")
        axes.grid(alpha=0.3)
    figure.axes[0].legend(fontsize="x-small")
    figure.suptitle(f"{base.run.model}, global batch {base.run.batch_size}: predicted speed-up")
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def assumptions(links: list[Interconnect], has_probe: bool) -> str:
    lines = [
        "Strong scaling: `data.batch_size` is the global batch, split over the processes, so the steps per epoch stay "
        "fixed and each process computes 1/N of a step (on the measured interconnect, 1/min(N, cores): processes beyond "
        "the cores share them). A process count that does not divide the batch is left out. Per step: comm = the hook's "
        "arithmetic + one ring all-reduce per collective, 2(N-1) x latency + 2(N-1)/N x bytes / bandwidth; hidden = "
        "overlap_frac x min(comm, backward compute); epoch = steps x (compute + comm - hidden). The compute and the "
        "hook's arithmetic are this machine's, for every interconnect. Speed-up = one process's epoch / N processes'.", "",
        "| interconnect | bandwidth GB/s | latency us | source |", "|---|---:|---:|---|",
        *[f"| {link.name} | {link.bandwidth / 1e9:.3g} | {link.latency * 1e6:.3g} | {link.source} |" for link in links],
    ]
    if not has_probe:
        lines += ["", "No probe: run `python -m src.scaling <folder> --probe` for the measured interconnect."]
    return "\n".join(lines)


def write_scaling(root: Path, out: Path | None = None, probe: gloo_probe.Probe | None = None, overlap: float = 0.0) -> str:
    """Write scaling.md, scaling.csv and one plot per model into `out` (default `root`); returns the Markdown sections."""
    out = output_folder(root if out is None else out)
    runs = collect(root)
    cores = probe.cores if probe is not None else len(os.sched_getaffinity(0))
    measured = measured_links(probe)
    links = [*measured.values(), *INTERCONNECTS]
    groups: dict[tuple[str, int], list[RunFigures]] = {}
    for run in sorted(runs, key=lambda r: (r.model, r.batch_size, r.processes, r.run)):
        groups.setdefault((run.model, run.batch_size), []).append(run)
    out.mkdir(parents=True, exist_ok=True)
    sections, all_rows = [], []
    for (model, batch), group in groups.items():
        base = Baseline.from_run(group[0], cores, overlap)
        rows = predictions(base, links)
        name = f"scaling_{model}_{batch}.png" if sum(m == model for m, _ in groups) > 1 else f"scaling_{model}.png"
        plot(base, rows, links, out / name)
        sections.append(section(base, rows, measured, group, name))
        all_rows += rows
    with (out / "scaling.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(all_rows)
    body = "\n".join([assumptions(links, probe is not None), "", *sections])
    (out / "scaling.md").write_text(f"# Scaling: {root}\n\n{body}")
    return body


def _parse(argv: list[str] | None) -> Namespace:
    parser = ArgumentParser(prog="python -m src.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", help="a run folder, a sweep folder or outputs/")
    parser.add_argument("--out", type=Path, help="where to write (default: the folder; outputs/ for --probe alone)")
    parser.add_argument("--probe", action="store_true", help="time gloo all-reduces here first and save probe.json")
    parser.add_argument("--probe-file", type=Path, help="a saved probe.json (default: probe.json in the folder, if any)")
    parser.add_argument("--overlap", type=float, default=0.0, help="overlap_frac where the run logged none (default 0)")
    args = parser.parse_args(argv)
    if args.folder is None and not args.probe:
        raise UsageError("give a run or sweep folder, or --probe")
    if not 0 <= args.overlap <= 1:
        raise UsageError(f"--overlap {args.overlap} is not allowed; it must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> None:
    with usage_errors_exit():
        args = _parse(argv)
        out = args.out or args.folder or Path("outputs")
        if args.folder is not None:
            require_folder(args.folder)
        probe = None
        if args.probe:
            probe = gloo_probe.run_probe()
            out.mkdir(parents=True, exist_ok=True)
            gloo_probe.save(probe, out / "probe.json")
            for n, (latency, bandwidth) in probe.fits().items():
                print(f"gloo, {n} processes: latency {latency * 1e6:.1f} us per ring step, bandwidth {bandwidth / 1e9:.3f} GB/s")
        elif args.probe_file is not None:
            if not args.probe_file.is_file():
                raise UsageError(f"--probe-file {args.probe_file}: no such file; give a probe.json that --probe wrote")
            probe = load_probe(args.probe_file)
        else:
            probe = load_probe(args.folder / "probe.json")
        if args.folder is not None:
            write_scaling(args.folder, out, probe, args.overlap)
            print(f"-> {out / 'scaling.md'}")

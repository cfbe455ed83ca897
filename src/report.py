"""`python -m src.report <folder> [--out DIR]`: one table and two plots comparing every run below a folder.

    python -m src.report outputs/multirun/2026-01-01_12-00-00     # writes report.* into the sweep folder
    python -m src.report outputs --out /tmp/report                 # every run ever made

A run folder is one holding `.hydra/config.yaml` and TensorBoard event files. Writes `report.md`,
`report.csv`, `val_acc.png` and `epoch_time.png`, and the predicted scaling of `src.scaling`
(`scaling.*`, also shown in report.md). `SweepReport` does the same when a sweep ends.
"""

import csv
import logging
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from omegaconf import DictConfig

from src.errors import UsageError
from src.launch.console import counted
from src.loggers import EPOCH_TAG
from src.runs import ArgumentParser, RunFolder, median, output_folder, read_runs, usage_errors_exit
from src.scaling.predict import load_probe, write_scaling

log = logging.getLogger(__name__)

# CSV header, in order; the Markdown table shows the same columns under the titles beside them.
COLUMNS = {
    "run": "run", "model": "model", "strategy": "strategy", "devices": "devices", "num_nodes": "nodes",
    "precision": "precision", "test_acc": "test acc", "epoch_s": "epoch s (median)",
    "samples_per_s": "samples/s (median)", "comm_bytes_per_step": "comm bytes/step (median)", "speedup": "speed-up",
}
FILES = ("report.md", "report.csv", "val_acc.png", "epoch_time.png")


@dataclass
class Run:
    """What the report shows of one run folder; None where the run did not log it."""

    run: str
    model: str
    strategy: str
    devices: int
    num_nodes: int
    precision: str
    test_acc: float | None
    epoch_s: float | None
    samples_per_s: float | None
    comm_bytes_per_step: float | None
    val_acc: list[tuple[int, float]] = field(default_factory=list)
    speedup: float | None = None

    @property
    def total_devices(self) -> int:
        return self.devices * self.num_nodes


def read_run(run: RunFolder) -> Run:
    """Everything the report needs from one run folder."""
    # Lightning logs its epoch counter at the step of every epoch-end metric, which turns val/acc
    # steps into epochs (`trainer/epoch`; `epoch` in runs written before it was renamed).
    epoch_at_step = {step: int(epoch) for step, epoch in run.scalars(EPOCH_TAG, "epoch")}
    val_acc = [(epoch_at_step.get(step, index) + 1, acc) for index, (step, acc) in enumerate(run.scalars("val/acc"))]
    test_acc = run.values("test/acc")
    return Run(
        run=run.name,
        model=str(run.value("model_name", "model")),
        strategy=str(run.value("strategy_name", "strategy")),
        devices=int(run.value("devices")),
        num_nodes=int(run.value("num_nodes")),
        precision=str(run.hparams().get("precision_used", run.value("precision"))),
        test_acc=test_acc[-1] if test_acc else None,
        epoch_s=median(run.values("time/epoch_s")),
        samples_per_s=median(run.values("time/samples_per_s")),
        comm_bytes_per_step=median(run.values("comm/bytes_per_step")),
        val_acc=val_acc,
    )


def add_speedups(runs: list[Run]) -> None:
    """speed-up = median epoch time of the one-device run of the same model/strategy/precision / this run's."""
    single: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for run in runs:
        if run.total_devices == 1 and run.epoch_s:
            single[run.model, run.strategy, run.precision].append(run.epoch_s)
    for run in runs:
        baseline = single.get((run.model, run.strategy, run.precision))
        run.speedup = statistics.median(baseline) / run.epoch_s if baseline and run.epoch_s else None


def collect_runs(root: Path) -> list[Run]:
    """All runs below `root`, sorted for reading, speed-ups filled in."""
    runs = read_runs(root, read_run)
    add_speedups(runs)
    return sorted(runs, key=lambda r: (r.model, r.strategy, r.precision, r.total_devices, r.run))


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_table(runs: list[Run]) -> str:
    digits = {"test_acc": 4, "epoch_s": 3, "samples_per_s": 1, "comm_bytes_per_step": 0, "speedup": 2}
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    for run in runs:
        lines.append("| " + " | ".join(_cell(getattr(run, key), digits.get(key, 0)) for key in COLUMNS) + " |")
    return "\n".join(lines)


def write_csv(runs: list[Run], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(COLUMNS)
        for run in runs:
            writer.writerow(["" if getattr(run, key) is None else getattr(run, key) for key in COLUMNS])


def _save(figure: Figure, path: Path) -> None:
    """Grid and legend on each plot's axes, then the PNG."""
    for axes in figure.axes:
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend(fontsize="small")
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _labels(runs: list[Run]) -> list[str]:
    """Short legend labels; runs that share one get their row number in the table."""
    labels = [f"{r.model} {r.strategy} {r.total_devices} dev {r.precision}" for r in runs]
    return [f"{label} (row {row})" if labels.count(label) > 1 else label for row, label in enumerate(labels, 1)]


def plot_val_acc(runs: list[Run], path: Path) -> None:
    figure = Figure(figsize=(8, 5))
    axes = figure.add_subplot()
    for run, label in zip(runs, _labels(runs)):
        if run.val_acc:
            epochs, accs = zip(*run.val_acc)
            axes.plot(epochs, accs, marker="o", label=label)
    axes.set(xlabel="epoch", ylabel="val/acc", title="Validation accuracy per epoch")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    _save(figure, path)


def plot_epoch_time(runs: list[Run], path: Path) -> None:
    """One line per strategy; model and precision join the label when the runs differ in them."""
    points: dict[tuple[str, str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.epoch_s is not None:
            points[run.strategy, run.model, run.precision][run.total_devices].append(run.epoch_s)
    detailed = len({(model, precision) for _, model, precision in points}) > 1
    figure = Figure(figsize=(8, 5))
    axes = figure.add_subplot()
    for (strategy, model, precision), by_devices in sorted(points.items()):
        devices = sorted(by_devices)
        axes.plot(devices, [statistics.median(by_devices[d]) for d in devices], marker="o",
                  label=f"{strategy} ({model}, {precision})" if detailed else strategy)
    axes.set(xlabel="devices (all nodes)", ylabel="median epoch time (s)", title="Epoch time against devices")
    axes.set_xticks(sorted({d for by_devices in points.values() for d in by_devices}))
    axes.set_ylim(bottom=0)
    _save(figure, path)


def failed_table(failed: dict[str, str]) -> str:
    """The sweep's failed jobs, by their folder's name, each with its error line."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [f"| {cell(job)} | {cell(line)} |" for job, line in failed.items()]
    return "\n".join(["| job | error |", "|---|---|", *rows])


def markdown_report(runs: list[Run], root: Path, scaling: str = "", failed: dict[str, str] | None = None) -> str:
    return "\n".join([
        f"# Report: {root}", "",
        f"{counted(len(runs), 'run')}. Epoch times exclude validation. Speed-up is the median epoch time of the run on one "
        "device (devices x num_nodes = 1) with the same model, strategy and precision, divided by this run's; "
        "empty where there is no such run.", "",
        markdown_table(runs), "",
        *([f"{counted(len(failed), 'job')} failed:", "", failed_table(failed), ""] if failed else []),
        "![validation accuracy per epoch](val_acc.png)", "",
        "![median epoch time against devices](epoch_time.png)", "",
        *(["# Predicted scaling (scaling.md, `python -m src.scaling`)", "", scaling, ""] if scaling else []),
    ])


def scaling_section(root: Path, out: Path) -> str:
    """The predicted scaling of the same runs (also written to scaling.*); empty when no run can be modelled."""
    try:
        return write_scaling(root, out, load_probe(root / "probe.json"))
    except UsageError as error:
        log.info(f"no scaling prediction: {error}")
        return ""


def write_report(root: Path, out: Path | None = None, failed: dict[str, str] | None = None) -> list[Run]:
    """Read every run below `root` and write the report files into `out` (default: `root`); `failed`:
    the sweep's failed jobs with their error lines, listed below the table."""
    out = output_folder(root if out is None else out)
    runs = collect_runs(root)
    out.mkdir(parents=True, exist_ok=True)
    scaling = scaling_section(root, out)
    (out / "report.md").write_text(markdown_report(runs, root, scaling, failed))
    write_csv(runs, out / "report.csv")
    plot_val_acc(runs, out / "val_acc.png")
    plot_epoch_time(runs, out / "epoch_time.png")
    return runs


def write_tensorboard_text(runs: list[Run], log_dir: Path) -> None:
    """The table as TensorBoard text, in its own folder so that it shows as its own run."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(log_dir)) as writer:
        writer.add_text("report", markdown_table(runs))


class SweepReport(Callback):
    """Hydra callback: when a sweep ends, the report goes into the sweep folder and `<sweep>/report` in TensorBoard."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from src.launch.cli import failed_jobs  # filled by the jobs (locally) or by the launcher that waited for them

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            runs = write_report(sweep_dir, failed={job: failed.line for job, failed in failed_jobs.items()})
        except UsageError as error:
            log.warning(f"no sweep report: {error}")
            return
        write_tensorboard_text(runs, sweep_dir / "report")
        log.info(f"sweep report of {counted(len(runs), 'run')}: {sweep_dir / 'report.md'}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m src.report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder, a run folder or outputs/")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: the folder)")
    with usage_errors_exit():
        args = parser.parse_args(argv)
        runs = write_report(args.folder, args.out)
    print(f"{counted(len(runs), 'run')} -> {(args.out or args.folder) / 'report.md'}")


if __name__ == "__main__":
    main()

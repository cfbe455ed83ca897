"""`python -m src.report <folder> [--out DIR]`: one table and two plots comparing every run below a folder.

    python -m src.report outputs/multirun/2026-01-01_12-00-00     # writes report.* into the sweep folder
    python -m src.report outputs --out /tmp/report                 # every run ever made

A run folder is one holding `.hydra/config.yaml` and TensorBoard event files. Writes `report.md`,
`report.csv`, `val_acc.png` and `epoch_time.png`, and the predicted scaling of `src.scaling`
(`scaling.*`, also shown in report.md). `SweepReport` does the same when a sweep ends.
"""

import argparse
import csv
import logging
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from src.errors import UsageError
from src.launch.console import counted
from src.loggers import EPOCH_TAG

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


def find_run_dirs(root: Path) -> list[Path]:
    """Folders below `root` (itself included) that hold both a Hydra config and event files."""
    configs = sorted(root.glob("**/.hydra/config.yaml"))
    return [c.parent.parent for c in configs if any(c.parent.parent.glob("events.out.tfevents.*"))]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _hparams(events: event_accumulator.EventAccumulator) -> dict[str, Any]:
    """The run's HParams summary (`precision_used`, `world_size`, ...), empty when it has none."""
    try:
        content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    except KeyError:
        return {}
    values = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {name: getattr(value, value.WhichOneof("kind")) for name, value in values.items() if value.WhichOneof("kind")}


def _config_value(config: DictConfig, choices: DictConfig | None, key: str, group: str | None = None) -> Any:
    """A config value; `${hydra:runtime.choices.<group>}` resolves only inside the run, so it is read from hydra.yaml."""
    if group and choices is not None and group in choices and OmegaConf.is_interpolation(config, key):
        return choices[group]
    return OmegaConf.select(config, key)


def read_run(run_dir: Path, root: Path) -> Run:
    """Everything the report needs from one run folder."""
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    choices = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.choices") if hydra_yaml.is_file() else None
    events = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def values(tag: str) -> list[float]:
        return [e.value for e in events.Scalars(tag)] if tag in tags else []

    # Lightning logs its epoch counter at the step of every epoch-end metric, which turns val/acc
    # steps into epochs (`trainer/epoch`; `epoch` in runs written before it was renamed).
    epoch_tag = next((tag for tag in (EPOCH_TAG, "epoch") if tag in tags), None)
    epoch_at_step = {int(e.step): int(e.value) for e in events.Scalars(epoch_tag)} if epoch_tag else {}
    val_acc = [
        (epoch_at_step.get(e.step, index) + 1, e.value)
        for index, e in enumerate(events.Scalars("val/acc") if "val/acc" in tags else [])
    ]
    test_acc = values("test/acc")
    relative = run_dir.relative_to(root).as_posix()
    return Run(
        run=relative if relative != "." else run_dir.name,
        model=str(_config_value(config, choices, "model_name", "model")),
        strategy=str(_config_value(config, choices, "strategy_name", "strategy")),
        devices=int(_config_value(config, choices, "devices")),
        num_nodes=int(_config_value(config, choices, "num_nodes")),
        precision=str(_hparams(events).get("precision_used", _config_value(config, choices, "precision"))),
        test_acc=test_acc[-1] if test_acc else None,
        epoch_s=_median(values("time/epoch_s")),
        samples_per_s=_median(values("time/samples_per_s")),
        comm_bytes_per_step=_median(values("comm/bytes_per_step")),
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
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder; give a sweep folder or outputs/")
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise UsageError(f"{root}: no run folders below it (a run folder holds .hydra/config.yaml and event files)")
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # it logs every event file it opens at INFO
    runs = []
    for run_dir in run_dirs:
        try:
            runs.append(read_run(run_dir, root))
        except Exception as error:  # a hand-edited or truncated config: name the folder, not a traceback
            reason = " ".join(str(error).split())
            raise UsageError(f"{run_dir}: cannot read this run ({type(error).__name__}: {reason})") from error
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
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small")
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
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small")
    _save(figure, path)


def markdown_report(runs: list[Run], root: Path, scaling: str = "") -> str:
    return "\n".join([
        f"# Report: {root}", "",
        f"{counted(len(runs), 'run')}. Epoch times exclude validation. Speed-up is the median epoch time of the run on one "
        "device (devices x num_nodes = 1) with the same model, strategy and precision, divided by this run's; "
        "empty where there is no such run.", "",
        markdown_table(runs), "",
        "![validation accuracy per epoch](val_acc.png)", "",
        "![median epoch time against devices](epoch_time.png)", "",
        *(["# Predicted scaling (scaling.md, `python -m src.scaling`)", "", scaling, ""] if scaling else []),
    ])


def scaling_section(root: Path, out: Path) -> str:
    """The predicted scaling of the same runs (also written to scaling.*); empty when no run can be modelled."""
    from src.scaling import load_probe, write_scaling  # it imports this module

    try:
        return write_scaling(root, out, load_probe(root / "probe.json"))
    except UsageError as error:
        log.info(f"no scaling prediction: {error}")
        return ""


def write_report(root: Path, out: Path | None = None) -> list[Run]:
    """Read every run below `root` and write the report files into `out` (default: `root`)."""
    out = root if out is None else out
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    runs = collect_runs(root)
    out.mkdir(parents=True, exist_ok=True)
    scaling = scaling_section(root, out)
    (out / "report.md").write_text(markdown_report(runs, root, scaling))
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
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            runs = write_report(sweep_dir)
        except UsageError as error:
            log.warning(f"no sweep report: {error}")
            return
        write_tensorboard_text(runs, sweep_dir / "report")
        log.info(f"sweep report of {counted(len(runs), 'run')}: {sweep_dir / 'report.md'}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog="python -m src.report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder, a run folder or outputs/")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: the folder)")
    try:
        args = parser.parse_args(argv)
        runs = write_report(args.folder, args.out)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"{counted(len(runs), 'run')} -> {(args.out or args.folder) / 'report.md'}")


if __name__ == "__main__":
    main()

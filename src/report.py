"""`python -m src.report <folder> [--out DIR]`: tables and plots comparing every run below a folder.

Also written when a sweep ends. Where they apply: `epoch_time.png` (devices differ), `scaling.*` (DDP), `seeds.csv`,
`time_to_accuracy.csv` and `acc_time.png` (runs that timed their targets).
"""

import csv
import io
import itertools
import logging
import math
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from src import records
from src.errors import UsageError
from src.folders import figure_bytes, open_folder, write_file
from src.launch.console import counted, saying
from src.runs import ArgumentParser, RunFolder, median, output_folder, read_runs, usage_errors_exit

log = logging.getLogger(__name__)

# CSV header, in order, with the Markdown table's titles.
COLUMNS = {
    "run": "run", "model": "model", "strategy": "strategy", "devices": "devices", "num_nodes": "nodes",
    "precision": "precision", "seed": "seed", "finished": "finished", "test_acc": "test acc",
    "epoch_s": "epoch s (median)", "samples_per_s": "samples/s (median)", "tflops_per_s": "TFLOP/s a device (median)",
    "mfu": "MFU (median)", "peak_memory_mib": "peak memory MiB", "comm_bytes_per_step": "comm bytes/step (median)",
    "disturbed": "disturbed epochs", "speedup": "speed-up", "speedup_all": "speed-up, disturbed runs too",
}
DIGITS = {"test_acc": 4, "epoch_s": 3, "samples_per_s": 1, "tflops_per_s": 4, "mfu": 3, "speedup": 2, "speedup_all": 2}
MEASURED = ("tflops_per_s", "mfu", "peak_memory_mib", "comm_bytes_per_step")  # shown where some run measured them
FILES = ("report.md", "report.csv", "val_acc.png", "epoch_time.png", "time_to_accuracy.csv", "acc_time.png")  # where they apply
NOT_A_SETTING = ("seed", "tags", "ckpt_path")  # repeats with other seeds are one setting
PER_DEVICES = ("devices", "num_nodes", "world_size", "threads")  # what a speed-up compares (DDP divides the threads)


@dataclass
class Run:
    """What the report shows of one run folder; None where the run did not log it."""

    run: str
    model: str
    strategy: str
    devices: int
    num_nodes: int
    precision: str
    seed: int | None
    finished: str  # "yes", or "no" for a run that stopped before its result (resume it with ckpt_path=last)
    test_acc: float | None
    epoch_s: float | None
    samples_per_s: float | None
    comm_bytes_per_step: float | None
    tflops_per_s: float | None = None
    mfu: float | None = None
    peak_memory_mib: float | None = None
    val_acc: list[tuple[int, float]] = field(default_factory=list)
    speedup: float | None = None
    ddp: bool = False
    params: dict[str, Any] = field(default_factory=dict)  # its HParams record
    evaluation: bool = False  # a folder of `python -m src.eval`: a checkpoint scored, nothing trained
    checkpoint: str = ""  # the checkpoint it started from, or scored
    to_target: dict[str, float | None] = field(default_factory=dict)  # target val/acc: training seconds, None: not
    acc_time: list[tuple[float, float]] = field(default_factory=list)  # (training seconds, val/acc) at each validation
    stopped_early: bool = False  # stopped before its last epoch: a target it did not reach may still come
    warmup_s: float | None = None  # warm-up seconds (compiling, graph capture) in its times to accuracy
    disturbed_epochs: int = 0  # epochs that competed with other work (usage/disturbed)
    timed_epochs: int = 0  # epochs whose competition was measured
    speedup_marked: bool = False  # a side of it had disturbed epochs
    speedup_all: float | None = None  # the speed-up with the mostly disturbed one-device runs too, where it differs
    speedup_left_out: int = 0  # mostly disturbed one-device runs that `speedup` leaves out

    @property
    def disturbed(self) -> str | None:
        return f"{self.disturbed_epochs}/{self.timed_epochs}" if self.timed_epochs else None

    @property
    def disturbance(self) -> str:
        """"" where no epoch was disturbed (or none measured); "some"; "most": half its epochs or more, too many for
        its times to say anything about the setting."""
        if not self.disturbed_epochs:
            return ""
        return "most" if 2 * self.disturbed_epochs >= self.timed_epochs else "some"

    @property
    def interval_s(self) -> float | None:
        """The training seconds between its validations (the median gap): a time to accuracy is known to within it."""
        seconds = [0.0, *(x for x, _ in self.acc_time)]
        gaps = [later - earlier for earlier, later in zip(seconds, seconds[1:]) if later > earlier]
        return statistics.median(gaps) if gaps else None

    @property
    def setting(self) -> tuple:
        """Runs with the same setting are repeats."""
        rest = tuple(sorted((k, str(v)) for k, v in self.params.items() if k not in NOT_A_SETTING))
        return (self.model, self.strategy, self.devices, self.num_nodes, self.precision, rest)

    @property
    def but_devices(self) -> tuple:
        """Runs alike in this compare in speed-up and epoch time."""
        model, strategy, _, _, precision, rest = self.setting
        return (model, strategy, precision, tuple(item for item in rest if item[0] not in PER_DEVICES))

    @property
    def total_devices(self) -> int:
        return self.devices * self.num_nodes


def read_run(run: RunFolder) -> Run:
    # Lightning logs its epoch counter at the step of every epoch-end metric, which turns val/acc
    # steps into epochs (`trainer/epoch`; `epoch` in runs written before it was renamed).
    from src.loggers import EPOCH_TAG

    epoch_at_step = {step: int(epoch) for step, epoch in run.scalars(EPOCH_TAG, "epoch")}
    val_acc = [(epoch_at_step.get(step, index) + 1, acc) for index, (step, acc) in enumerate(run.scalars("val/acc"))]
    test_acc = run.values("test/acc")
    params = run.hparams()
    seed = params.get("seed", run.value("seed"))
    result = records.result(run.path)
    disturbed = run.values("usage/disturbed")
    epochs, max_epochs = len(run.values("time/epoch_s")), run.value("max_epochs")
    stopped = isinstance(max_epochs, int) and not isinstance(max_epochs, bool) and 0 < epochs < max_epochs
    warmups = [entry["warmup_s"] for entry in (result.time_to_accuracy if result else [])
               if entry.get("warmup_s") is not None]
    return Run(
        run=run.name, model=str(run.value("model_name")), strategy=str(run.value("strategy_name")),
        devices=int(run.value("devices")), num_nodes=int(run.value("num_nodes")),
        precision=str(run.value("precision_used") or params.get("precision_used") or run.value("precision")),
        seed=None if seed is None else int(seed), test_acc=test_acc[-1] if test_acc else None,
        finished="yes" if run.evaluation or result is not None else "no",
        epoch_s=median(run.values("time/epoch_s")), samples_per_s=median(run.values("time/samples_per_s")),
        # Per step where the run logged steps; a run shorter than the logging interval has the epoch means only.
        comm_bytes_per_step=median(run.values("xfer/bytes_per_step", "xfer/bytes_per_step_epoch")),
        tflops_per_s=median(run.values("usage/tflops_per_s")), mfu=median(run.values("usage/mfu")),
        peak_memory_mib=max(run.values("usage/peak_memory_mib"), default=None),
        val_acc=val_acc, ddp="hook" in (run.value("strategy") or {}), params=params, evaluation=run.evaluation,
        checkpoint=str(run.value("ckpt_path") or ""), to_target=time_to_targets(run, result),
        acc_time=accuracy_against_time(run), disturbed_epochs=sum(1 for flag in disturbed if flag),
        timed_epochs=len(disturbed), stopped_early=not run.evaluation and (result is None or stopped),
        warmup_s=max(warmups) if warmups else None,
    )


def time_to_targets(run: RunFolder, result: records.Result | None) -> dict[str, float | None]:
    """Seconds to each target val/acc from `result.json`; else from the points logged so far, with the config's other
    targets not (yet) reached."""
    if result is not None and result.time_to_accuracy:
        found = {records.target_name(entry["target"]): entry["seconds"] for entry in result.time_to_accuracy}
    else:
        configured = run.value("callbacks.time_to_accuracy.targets") or []
        found = {records.target_name(float(target)): None for target in configured
                 if isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target <= 1}
        found |= {tag[len(records.TO_TARGET):]: run.values(tag)[0] for tag in run.tags(records.TO_TARGET)}
    return dict(sorted(found.items(), key=lambda item: float(item[0])))


def accuracy_against_time(run: RunFolder) -> list[tuple[float, float]]:
    """Each validation's accuracy at the training seconds before it (`time/trained_s`, logged with it); for runs made
    before it was logged, each epoch's at the sum of the epoch times so far."""
    accuracies, seconds = run.values("val/acc"), run.values("time/trained_s")
    if not seconds:
        seconds = list(itertools.accumulate(run.values("time/epoch_s")))
    return list(zip(seconds, accuracies)) if len(seconds) == len(accuracies) else []


def add_speedups(runs: list[Run]) -> None:
    """Only where devices differ: between repeats it would be seed noise, between other settings no speed-up."""
    if not varies(runs, "total_devices"):
        return
    single: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        if run.total_devices == 1 and run.epoch_s:
            single[run.but_devices].append(run)
    for run in runs:
        baseline = single.get(run.but_devices)
        if run.total_devices == 1 and baseline is not None and len(baseline) > 1:
            continue  # one of several one-device runs: against their median it would show seed noise
        if not baseline or not run.epoch_s:
            continue
        # Mostly disturbed one-device runs would compare the machine's load: the figure leaves them out where others
        # remain, and `speedup_all` shows it with them.
        quiet = [side for side in baseline if side.disturbance != "most"] or baseline
        run.speedup = statistics.median(side.epoch_s for side in quiet) / run.epoch_s
        if len(quiet) < len(baseline):
            run.speedup_all = statistics.median(side.epoch_s for side in baseline) / run.epoch_s
            run.speedup_left_out = len(baseline) - len(quiet)
        run.speedup_marked = any(side.disturbance for side in [run, *quiet])


def varies(runs: list[Run], attribute: str) -> bool:
    return len({getattr(run, attribute) for run in runs}) > 1


def collect(root: Path, opened: dict[Path, RunFolder] | None = None) -> tuple[list[Run], list[Run]]:
    """The training runs below `root`, sorted, speed-ups filled in; and apart, the evaluations (nothing to compare)."""
    found = read_runs(root, read_run, opened=opened)
    runs = [run for run in found if not run.evaluation]
    if not runs:
        raise UsageError(f"{root}: no training run below it, only evaluations (python -m src.eval)")
    add_speedups(runs)
    return sorted(runs, key=lambda r: (r.model, r.strategy, r.precision, r.total_devices, r.seed or 0, r.run)), \
        [run for run in found if run.evaluation]


def collect_runs(root: Path) -> list[Run]:
    return collect(root)[0]


def markdown_cell(value: Any) -> str:
    """Text from a record or a folder name as one line of Markdown that shows it as written: whoever wrote the record
    adds no heading, link, emphasis, table cell or HTML to the report."""
    text = records.shown(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    # An underscore inside a word emphasises nothing (CommonMark): run names keep theirs.
    return re.sub(r"[\\`*\[\]|#~]|(?<![^\W_])_|_(?![^\W_])", r"\\\g<0>", text)


CSV_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # how a spreadsheet cell starts a formula
CSV_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?(e[-+]?[0-9]+)?")


def csv_cell(value: Any) -> Any:
    """A cell a spreadsheet shows as written: text that would start a formula gets a leading `'`, a number stays one."""
    if isinstance(value, str) and value.startswith(CSV_FORMULA) and not CSV_NUMBER.fullmatch(value):
        return "'" + value
    return value


def _cell(value: Any, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else markdown_cell(value)


def _table(header: Sequence[str], rows: Iterable[list[str]], rule: str = "") -> str:
    body = ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(["| " + " | ".join(header) + " |", rule or "|" + "---|" * len(header), *body])


def _write_csv(path: Path, header: Iterable[str], rows: Iterable[Iterable[Any]]) -> None:
    text = io.StringIO(newline="")
    csv.writer(text).writerows([csv_cell(cell) for cell in row] for row in [header, *rows])
    write_file(path, text.getvalue())


def markdown_table(runs: list[Run]) -> str:
    """A measured figure only where some run measured it (MFU: on a GPU in Lightning's peak table)."""
    shown = {"seed": varies(runs, "seed"), "finished": any(run.finished != "yes" for run in runs),
             "speedup": varies(runs, "total_devices"), "disturbed": any(run.disturbed_epochs for run in runs),
             "speedup_all": any(run.speedup_all is not None for run in runs),
             **{key: any(getattr(run, key) is not None for run in runs) for key in MEASURED}}
    columns = [key for key in COLUMNS if shown.get(key, True)]
    return _table([COLUMNS[key] for key in columns], ([_marked(run, key) for key in columns] for run in runs))


def _marked(run: Run, key: str) -> str:
    """A cell; a time measured beside other work, or a figure drawn from one, has `*`."""
    text = _cell(getattr(run, key), DIGITS.get(key, 0))
    marked = {"epoch_s": run.disturbance, "samples_per_s": run.disturbance, "speedup": run.speedup_marked,
              "speedup_all": True}.get(key, False)
    return text + "*" if marked and text else text


def disturbance_note(runs: list[Run]) -> str:
    """Below the table, where some run's epochs competed with other work."""
    if not any(run.disturbed_epochs for run in runs):
        return ""
    left_out = [f"{markdown_cell(run.run)} ({counted(run.speedup_left_out, 'run')})" for run in runs
                if run.speedup_left_out]
    every = all(run.disturbed_epochs for run in runs)
    return " ".join(part for part in [
        "\\* Other work ran beside some epochs (`disturbed epochs`: `usage/disturbed` in TensorBoard, other processes "
        "took at least a tenth of the run's cores while its threads waited for a CPU): their times measured the "
        "machine's load as well as the setting, and so does any comparison drawn from them; each such figure is marked "
        "`*` here, in the seeds' statistics and in the plots.",
        f"Speed-ups without their mostly disturbed one-device runs, which `speed-up, disturbed runs too` counts: "
        f"{'; '.join(left_out)}." if left_out else "",
        "Every run was disturbed: no figure here compares the settings alone." if every else "",
        "To compare settings, not the machine's load, run again on a quiet machine, or give the runs cores of their own "
        "(`taskset -c`, `OMP_NUM_THREADS`: docs/results.md, threads on a shared machine)."] if part)


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_975(df: int) -> float:
    """Student's t at 97.5 % (two-sided 95 %): the table to 30 degrees of freedom, beyond it the expansion in 1/df."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def spread_cells(values: list[float], digits: int, low: float, high: float) -> list[str]:
    """Mean, sd and 95 % interval of the mean; where t over a few seeds reaches past `low`..`high`, no interval."""
    if len(values) < 2:
        return ["", "", ""]
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = t_975(len(values) - 1) * sd / math.sqrt(len(values))
    # An interval reaching past what the figure can be says only that there are too few seeds.
    too_few = mean - half < low or mean + half > high
    interval = f"n={len(values)} too small" if too_few else f"[{mean - half:.{digits}f}, {mean + half:.{digits}f}]"
    return [f"{mean:.{digits}f}", f"{sd:.{digits}f}", interval]


SEED_COLUMNS = ("setting", "seeds", "n", "test acc mean", "test acc sd", "test acc 95% CI",
                "epoch s mean", "epoch s sd", "epoch s 95% CI")


def seed_rows(runs: list[Run]) -> list[list[str]]:
    """A row per setting run with more than one seed, one run per seed (two runs of one seed are not two samples); the
    epoch-time statistics have `*` where a run's epochs competed with other work."""
    repeated = [group for group in by_setting(runs) if len(group) > 1 and all(run.seed is not None for run in group)]
    return [[label, ",".join(str(run.seed) for run in group), str(len(group)),
             *spread_cells([run.test_acc for run in group if run.test_acc is not None], 4, 0.0, 1.0),
             *(cell + "*" if cell and any(run.disturbance for run in group) else cell
               for cell in spread_cells([run.epoch_s for run in group if run.epoch_s is not None], 3, 0.0, math.inf))]
            for label, group in zip(_labels([group[0] for group in repeated], with_seed=False), repeated)]


def by_setting(runs: list[Run]) -> list[list[Run]]:
    """The runs of each setting, one per seed, in the report's order."""
    groups: dict[tuple, dict[int | None, Run]] = defaultdict(dict)
    for run in runs:
        groups[run.setting].setdefault(run.seed, run)
    return [sorted(group.values(), key=lambda r: r.seed or 0) for group in groups.values()]


def targets_of(runs: list[Run]) -> list[str]:
    return sorted({name for run in runs for name in run.to_target}, key=float)


def resolution_digits(interval: float | None) -> int:
    """The decimals a time to accuracy has: a target is reached somewhere in the validation interval before it, so
    8 s between validations gives whole seconds, 0.5 s tenths, 25 s tens (-1). One decimal where it is not known."""
    return 1 if not interval else -math.floor(math.log10(interval))


def seconds_text(value: float, digits: int) -> str:
    return f"{round(value, digits):.{max(digits, 0)}f}"


def time_to_cell(seconds: list[float | None], marked: bool, digits: int = 1, pending: int = 0) -> str:
    """`median [fastest, slowest] (reached/n)`: the median over the seeds, a seed that never reached the target
    counting as slower than any (so `never` where half of them or more did not), as MLPerf ranks by the median run.
    `pending`: seeds stopped before their last epoch without reaching it, in neither the median nor `never`."""
    if not seconds and not pending:
        return ""
    reached = sorted(value for value in seconds if value is not None)
    count = f"({len(reached)}/{len(seconds) + pending}" + (f", {pending} not reached yet)" if pending else ")")
    if not seconds:
        return f"not reached yet {count}"
    middle = statistics.median(reached + [math.inf] * (len(seconds) - len(reached)))
    text = "never" if math.isinf(middle) else seconds_text(middle, digits) + ("*" if marked else "")
    spread = f" [{seconds_text(reached[0], digits)}, {seconds_text(reached[-1], digits)}]" if len(reached) > 1 else ""
    few = f" (n={len(seconds)}: too few seeds for a median)" if len(seconds) < 3 and reached else ""
    return f"{text}{spread} {count}{few}"


def setting_time_to(runs: list[Run], target: str, digits: int) -> str:
    """The cell of `runs`, one setting's seeds, for one target."""
    timed = [run for run in runs if target in run.to_target]
    pending = [run for run in timed if run.stopped_early and run.to_target[target] is None]
    return time_to_cell([run.to_target[target] for run in timed if run not in pending],
                        any(run.disturbance for run in timed), digits, len(pending))


def time_to_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """A row per setting: training seconds to each target over its seeds, at the precision the validation interval
    allows. Runs with half their epochs or more disturbed are left out of the figure and counted in a second one
    beside it; where every run was, the figure is theirs, marked."""
    targets = targets_of(runs)
    if not targets:
        return [], []
    warmups = any(run.warmup_s is not None for run in runs)
    groups = by_setting(runs)
    rows = []
    for label, group in zip(_labels([group[0] for group in groups], with_seed=False), groups):
        quiet = [run for run in group if run.disturbance != "most"]
        left_out = len(group) - len(quiet)
        intervals = [run.interval_s for run in group if run.interval_s]
        interval = statistics.median(intervals) if intervals else None
        digits = resolution_digits(interval)
        cells = []
        for target in targets:
            cell = setting_time_to(quiet or group, target, digits)
            if quiet and left_out:
                cell += f"; with the {left_out} disturbed: {setting_time_to(group, target, digits)}"
            cells.append(cell)
        seeds = counted(len(group), "seed") + (
            "" if not left_out else f" ({left_out} mostly disturbed: counted only after `;`)" if quiet
            else " (all mostly disturbed: figures marked *)")
        every = "" if interval is None else f"{interval:.2g} s" if interval < 100 else f"{interval:.0f} s"
        warm = [run.warmup_s for run in group if run.warmup_s is not None]
        warmup = [seconds_text(statistics.median(warm), digits) if warm else ""] if warmups else []
        rows.append([label, seeds, every, *warmup, *cells])
    header = ["setting", "seeds", "validated every", *(["warm-up s (included)"] if warmups else [])]
    return [*header, *(f"s to val acc {target}" for target in targets)], rows


def _labels(runs: list[Run], with_seed: bool = True) -> list[str]:
    """Alike labels get the first setting that tells them apart, else their row."""
    seeds = with_seed and varies(runs, "seed")
    labels = [f"{run.model} {run.strategy} {run.total_devices} dev {run.precision}"
              + (f" seed {run.seed}" if seeds else "") for run in runs]
    for label in set(labels):
        same = [i for i, other in enumerate(labels) if other == label]
        if len(same) < 2:
            continue
        keys = sorted({k for i in same for k in runs[i].params} - {*NOT_A_SETTING, *PER_DEVICES})
        differing = [k for k in keys if len({str(runs[i].params.get(k)) for i in same}) > 1]
        key = differing[0] if differing else None
        for i in same:
            labels[i] += f" {key}={_word(runs[i].params.get(key))}" if key else f" (row {i + 1})"
    return labels


def _word(value: Any) -> str:
    """A setting as a user types it: 1 for the 1.0 that HParams keeps, `none` for an unset one."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value in ("", None) else str(value)


def colour(index: int) -> Any:
    """matplotlib's tab20, its dark shades first."""
    from matplotlib import colormaps

    return colormaps["tab20"]((2 * index) % 20 + (index // 10) % 2)


def _plot(path: Path, lines: list[tuple[Any, Any, dict[str, Any]]], **settings: Any) -> None:
    # matplotlib, TensorBoard, Lightning and torch are imported where used: the command answers first.
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figure state

    figure = Figure(figsize=(11, 5))
    axes = figure.add_subplot()
    for x, y, style in lines:
        axes.plot(x, y, **style)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set(**settings)
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # off the data
    figure.tight_layout()
    write_file(path, figure_bytes(figure, dpi=120))


def plot_val_acc(runs: list[Run], path: Path) -> None:
    """One line per run; repeats of a setting share a colour and differ in line style and marker."""
    colours: dict[tuple, Any] = {}
    repeats: dict[tuple, int] = defaultdict(int)
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    lines = []
    for run, label in zip(runs, _labels(runs)):
        if run.val_acc:
            shade = colours.setdefault(run.setting, colour(len(colours)))
            line, marker = styles[repeats[run.setting] % len(styles)]
            repeats[run.setting] += 1
            lines.append((*zip(*run.val_acc), {"color": shade, "linestyle": line, "marker": marker, "label": label}))
    _plot(path, lines, xlabel="epoch", ylabel="val/acc", title="Validation accuracy per epoch")


def mean_curve(curves: list[list[tuple[float, float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, lowest and highest y of curves at every x of any of them, over the span all of them cover."""
    import numpy as np

    start, end = max(curve[0][0] for curve in curves), min(curve[-1][0] for curve in curves)
    xs = sorted({x for curve in curves for x, _ in curve if start <= x <= end})
    ys = np.array([np.interp(xs, *zip(*curve)) for curve in curves]).reshape(len(curves), len(xs))
    return xs, list(ys.mean(axis=0)), list(ys.min(axis=0)), list(ys.max(axis=0))


def plot_acc_time(runs: list[Run], path: Path) -> None:
    """val/acc against training seconds, a curve per setting: the mean over its seeds, and a band from the lowest to
    the highest where there are several."""
    from matplotlib.figure import Figure

    groups = [[run for run in group if run.acc_time] for group in by_setting(runs)]
    groups = [group for group in groups if group]
    figure = Figure(figsize=(11, 5))
    axes = figure.add_subplot()
    for index, (group, label) in enumerate(zip(groups, _labels([group[0] for group in groups], with_seed=False))):
        xs, mean, low, high = mean_curve([run.acc_time for run in group])
        shown = f"{label} ({counted(len(group), 'seed')})" if len(group) > 1 else label
        shown += " *disturbed" if any(run.disturbance for run in group) else ""
        axes.plot(xs, mean, marker="o", markersize=3, color=colour(index), label=shown)
        if len(group) > 1:
            axes.fill_between(xs, low, high, color=colour(index), alpha=0.2, linewidth=0)
    for target in targets_of(runs):
        axes.axhline(float(target), color="grey", linewidth=0.5, linestyle=":")
    axes.set(xlabel="training seconds (warm-up included, validation excluded)", ylabel="val/acc", title="Validation accuracy against "
             "training time (mean over seeds, band: lowest to highest)", xlim=(0, None))
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    figure.tight_layout()
    write_file(path, figure_bytes(figure, dpi=120))


def plot_epoch_time(runs: list[Run], path: Path) -> None:
    """One line per setting but for devices; a point with a disturbed run in it is circled in black and its setting's
    label has `*`, as the tables mark its times."""
    points: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    disturbed: set[tuple[tuple, int]] = set()
    first: dict[tuple, Run] = {}
    for run in runs:
        if run.epoch_s is not None:
            points[run.but_devices][run.total_devices].append(run.epoch_s)
            first.setdefault(run.but_devices, run)
            if run.disturbance:
                disturbed.add((run.but_devices, run.total_devices))
    settings = sorted(points)
    labels = _labels([first[key] for key in settings], with_seed=False)
    lines = [(sorted(points[key]), [statistics.median(points[key][d]) for d in sorted(points[key])],
              {"marker": "o", "color": colour(index), "label": label.replace(f" {first[key].total_devices} dev", "")
               + (" *" if any(key == marked for marked, _ in disturbed) else "")})
             for index, (key, label) in enumerate(zip(settings, labels))]
    if disturbed:
        marked = sorted((devices, statistics.median(points[key][devices])) for key, devices in disturbed)
        lines.append((*zip(*marked), {"marker": "o", "markersize": 12, "markerfacecolor": "none", "color": "black",
                                      "linestyle": "none", "label": "* disturbed: other work ran beside"}))
    _plot(path, lines, xlabel="devices (all nodes)", ylabel="median epoch time (s)", title="Epoch time against devices",
          xticks=sorted({d for by_devices in points.values() for d in by_devices}), ylim=(0, None))


def markdown_report(runs: list[Run], root: Path, seeds: list[list[str]], scaling: str,
                    failed: dict[str, str] | None, evaluations: list[Run],
                    time_to: tuple[list[str], list[list[str]]] = ([], [])) -> str:
    by_devices = varies(runs, "total_devices")
    speedup = ("Speed-up: the median epoch time of the one-device runs (devices x num_nodes = 1) alike but for devices "
               "(model, strategy, precision, batches, epochs, ...) over this run's; empty where there is none, and for "
               "those runs themselves where there are several. ") if by_devices else ""
    parts = [f"# Report: {markdown_cell(root)}",
             f"{counted(len(runs), 'run')}. Epoch times exclude validation. {speedup}".rstrip(), markdown_table(runs)]
    if disturbance_note(runs):
        parts.append(disturbance_note(runs))
    if time_to[1]:
        parts += ["## Time to accuracy", "Which setting gets there first: the training seconds until val/acc first "
                  "reached each target, at the validation that showed it. Validation is excluded, as epoch times "
                  "exclude it; warm-up (compiling, capturing CUDA graphs) is included, as it is a cost of getting "
                  "there, and shown apart (`warm-up s (included)`). A target was reached somewhere in the interval "
                  "before that validation (`validated every`, training seconds; `trainer.val_check_interval` makes it "
                  "finer), and the figures are rounded to it. The median over the seeds, a seed that never reached the "
                  "target counting as slowest, then [fastest, slowest] of those that did, and how many did; a seed "
                  "stopped before its last epoch is `not reached yet` where it had not, and counts neither way; under "
                  "3 seeds a median says little. Runs with half their epochs or more disturbed are left out of the "
                  "first figure and counted in the one after `;`; where all were, the figure is theirs, marked `*` "
                  "(`time_to_accuracy.csv`).", _setting_table(*time_to),
                  "![validation accuracy against training seconds](acc_time.png)"]
    if failed:
        parts += [f"{counted(len(failed), 'job')} failed:", _table(["job", "error"], (
            [markdown_cell(job), markdown_cell(line)] for job, line in failed.items()))]
    if evaluations:
        parts += ["## Evaluations", "Checkpoints scored by `python -m src.eval`, apart from the training runs above.",
                  _table(["evaluation", "checkpoint", "test acc"],
                         ([markdown_cell(run.run), markdown_cell(run.checkpoint), _cell(run.test_acc, 4)]
                          for run in evaluations), "|---|---|---:|")]
    if seeds:
        parts += ["## Seeds", "Runs of one setting that differ only in their seed: mean, sample standard deviation and "
                  "the 95 % confidence interval of the mean (Student t, n - 1 degrees of freedom) over the seeds "
                  "(`seeds.csv`); `*`: some of them had disturbed epochs.", _setting_table(SEED_COLUMNS, seeds)]
    parts.append("![validation accuracy per epoch](val_acc.png)")
    if by_devices:
        parts.append("![median epoch time against devices](epoch_time.png)")
    if scaling:
        parts.append("# Predicted scaling (scaling.md, `python -m src.scaling`)")
        if any(run.disturbed_epochs for run in runs):
            parts.append("\\* It reads the runs above, the disturbed ones (`*`) too.")
        parts.append(scaling)
    return "\n\n".join(parts) + "\n"


def _setting_table(header: Sequence[str], rows: list[list[str]]) -> str:
    """A table of settings: the header names targets and the first column labels a setting, both from records."""
    return _table([markdown_cell(title) for title in header], ([markdown_cell(row[0]), *row[1:]] for row in rows))


def reached_cell(run: Run, target: str) -> Any:
    """Seconds; `never` where the run's record says it never reached the target, `not reached yet` where it stopped
    before its last epoch; empty where it did not time it."""
    if target not in run.to_target:
        return ""
    seconds = run.to_target[target]
    return seconds if seconds is not None else "not reached yet" if run.stopped_early else "never"


def write_report(root: Path, out: Path | None = None, failed: dict[str, str] | None = None) -> list[Run]:
    """`failed`: a sweep's failed jobs with their error lines."""
    out = output_folder(root if out is None else out)
    opened: dict[Path, RunFolder] = {}  # the scaling section reads the same folders
    runs, evaluations = collect(root, opened)
    os.close(open_folder(root, out, create=True))  # `<sweep>/report` a folder of the sweep's own, never a link
    scaling = ""
    if any(run.ddp for run in runs):  # without DDP, the runs asked nothing of communication
        # It reads what `python -m src.scaling <folder> --probe` saved: a sweep's report follows in seconds.
        from src.scaling.predict import load_probe, write_scaling

        try:
            scaling = write_scaling(root, out, load_probe(root / "probe.json"), report=True, opened=opened)
        except UsageError as error:
            log.info(f"no scaling prediction: {records.shown(error)}")
    seeds, time_to, targets = seed_rows(runs), time_to_rows(runs), targets_of(runs)
    write_file(out / "report.md", markdown_report(runs, root, seeds, scaling, failed, evaluations, time_to))
    _write_csv(out / "report.csv", [*COLUMNS, *(f"s_to_val_acc_{target}" for target in targets)],
               ([*("" if getattr(run, key) is None else getattr(run, key) for key in COLUMNS),
                 *(reached_cell(run, target) for target in targets)] for run in runs))
    plot_val_acc(runs, out / "val_acc.png")
    if time_to[1]:
        _write_csv(out / "time_to_accuracy.csv", *time_to)
        plot_acc_time(runs, out / "acc_time.png")
    if varies(runs, "total_devices"):
        plot_epoch_time(runs, out / "epoch_time.png")
    if seeds:
        _write_csv(out / "seeds.csv", SEED_COLUMNS, seeds)
    return runs


def write_sweep_report(sweep_dir: Path, failed: dict[str, str]) -> Path | None:
    """Also `<sweep>/report` in TensorBoard: the table and the sweep's HParams columns; None where no run was read."""
    try:
        runs = write_report(sweep_dir, failed=failed)
    except UsageError as error:
        log.warning(f"no sweep report: {records.shown(error)}")
        return None
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(sweep_dir / "report")) as writer:
        writer.add_text("report", markdown_table(runs))
    if any(run.params for run in runs):
        from src.hparams import override_keys, write_experiment
        from src.launch.naming import sweep_args

        write_experiment([run.params for run in runs if run.params], sweep_dir / "report",
                         override_keys(sweep_args(str(sweep_dir))), targets_of(runs))
    return sweep_dir / "report.md"


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m src.report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder, a run folder or outputs/")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: the folder)")
    with usage_errors_exit():
        args = parser.parse_args(argv)
        with saying(f"reading the runs below {records.shown(args.folder)} and writing their report"):
            runs = write_report(args.folder, args.out)
    print(f"{counted(len(runs), 'run')} -> {records.shown((args.out or args.folder) / 'report.md')}")


if __name__ == "__main__":
    main()

"""`python -m src.scaling <run or sweep folder>`: each model's run with the fewest processes scaled by
`src.scaling.costmodel` to every hook, interconnect and 1 to 1024 processes, and checked against the other runs."""

import csv
import io
import os
import statistics
from argparse import Namespace
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any
from pathlib import Path

from hydra.utils import instantiate
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from src.data.fashion_mnist import IMAGE_SIZE
from src import records
from src.errors import UsageError
from src.folders import figure_bytes, write_file
from src.launch.console import processes, saying
from src.runs import RESOLVED_CONFIG, RunFolder, median, output_folder, read_runs, require_folder, usage_errors_exit
from src.scaling import probe as gloo_probe
from src.scaling import timed as timing
from src.scaling import whatif
from src.scaling.cli import parse
from src.scaling.costmodel import (
    BACKWARD_SHARE, DDP_GPU_MULTI_SHARE, DDP_GPU_SHARE, HOOKS, INTERCONNECTS, MIB, NEEDS_GPU_STEP, Interconnect, Step,
    Terms, bucketed, predict_step,
)
from src.scaling.timed import Timed

PROCESS_COUNTS = tuple(2**k for k in range(11))  # 1 ... 1024
COLUMNS = ("model", "batch_size", "mode", "interconnect", "hook", "processes", "global_batch", "bytes_per_step", "compute_ms",
           "overhead_ms", "comm_ms", "exposed_ms", "skew_ms", "epoch_s", "speedup", "efficiency")


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
    net: Any  # the model's `net` config, to time its step here
    input_shape: tuple[int, int, int]
    steps_per_epoch: int
    epoch_s: float  # median over epochs
    step_s: float  # median over epochs of epoch_s / steps
    exposed_comm_s: float = 0.0  # DDP's all-reduce time not hidden behind the backward pass
    backward_s: float | None = None
    overlap_frac: float | None = None
    bytes_per_step: float | None = None  # the smallest: PowerSGD's warm-up steps send more
    hook_s: float | None = None  # median over the steps that sent the smallest bytes
    precision: str = "32-true"  # the precision the run trained in (its `precision_used`), to time its step the same way
    accelerator: str = "cpu"  # "cuda" for a run on GPUs (its HParams record's `accelerator`)

    def setting(self) -> tuple:
        """What makes two runs repeats of each other."""
        return self.model, self.batch_size, self.processes, self.hook, self.powersgd_rank, self.precision, self.steps_per_epoch


def read_figures(run: RunFolder) -> RunFigures | None:
    """A run's figures; None for a run without a timed epoch or one that is neither one process nor DDP."""
    config, strategy = run.config, run.config.strategy
    is_ddp = "hook" in strategy
    if not is_ddp and OmegaConf.select(strategy, "_target_") != "builtins.str":  # dp: not modelled
        return None

    def series(tag: str) -> list[tuple[int, float]]:
        return run.scalars(tag, f"{tag}_epoch")  # or its per-epoch mean, when only that was logged

    def typical(tag: str) -> float | None:
        return median(v for _, v in series(tag))

    epochs = series("time/epoch_s")
    if not epochs:
        return None
    # The network is built here, and timed: only from a class this project's conf/ names.
    records.check_data(OmegaConf.to_container(config.model), run.path / RESOLVED_CONFIG, "model")
    ends = [-1] + [step for step, _ in epochs]  # Lightning files an epoch's time at its last step, global_step - 1
    steps = [max(1, b - a) for a, b in zip(ends, ends[1:])]
    figures = RunFigures(
        run=run.name, model=str(run.value("model_name")), batch_size=int(config.data.batch_size),
        processes=int(config.devices) * int(config.num_nodes) if is_ddp else 1, hook=str(strategy.hook) if is_ddp else None,
        powersgd_rank=int(OmegaConf.select(strategy, "powersgd_rank", default=1)),
        shapes=[tuple(p.shape) for p in instantiate(config.model.net).parameters() if p.requires_grad],
        net=config.model.net, input_shape=(int(config.data.in_channels), IMAGE_SIZE, IMAGE_SIZE),
        precision=str(run.hparams().get("precision_used", "32-true")),
        accelerator=str(run.hparams().get("accelerator", "cpu")),
        steps_per_epoch=int(statistics.median(steps)), epoch_s=statistics.median(s for _, s in epochs),
        step_s=statistics.median(s / n for (_, s), n in zip(epochs, steps)),
    )
    if is_ddp:
        comm, overlap = typical("xfer/backward_comm_ms"), typical("xfer/overlap_ms")
        backward = typical("xfer/backward_compute_ms")
        figures.overlap_frac = typical("xfer/overlap_frac")
        figures.exposed_comm_s = max(0.0, (comm or 0.0) - (overlap or 0.0)) / 1000
        figures.backward_s = None if backward is None else backward / 1000
        sent = series("xfer/bytes_per_step")
        if sent:
            figures.bytes_per_step = min(v for _, v in sent)
            steady = {step for step, v in sent if v == figures.bytes_per_step}
            hook_ms = median(v for s, v in series("xfer/hook_ms") if s in steady)
            figures.hook_s = None if hook_ms is None else hook_ms / 1000
    return figures


TIMED = ("epoch_s", "step_s", "exposed_comm_s", "backward_s", "overlap_frac", "bytes_per_step", "hook_s")


def merge_repeats(runs: list[RunFigures]) -> list[RunFigures]:
    """One figure set per setting, the median of each timed figure over repeats: on shared cores one run's epoch
    can differ from the next one's by as much as the differences the model predicts."""
    settings: dict[tuple, list[RunFigures]] = {}
    for run in sorted(runs, key=lambda r: r.run):
        settings.setdefault(run.setting(), []).append(run)
    merged = []
    for repeats in settings.values():
        if len(repeats) == 1:
            merged.append(repeats[0])
            continue
        medians = {name: median(v for r in repeats if (v := getattr(r, name)) is not None) for name in TIMED}
        merged.append(replace(repeats[0], run=f"{repeats[0].run}, median of {len(repeats)} runs",
                              **{name: value for name, value in medians.items() if value is not None}))
    return merged


@dataclass(frozen=True)
class Options:
    """The command line's say over the model's terms; None: measured (or the run's own figure)."""

    overlap: float | None = None
    overhead_ms: float | None = None
    skew: float | None = None
    bus_share: float | None = None
    per_process_batch: int | None = None  # None: strong scaling
    bucket_mb: float = 25.0  # DDP's bucket_cap_mb


@dataclass
class Baseline:
    """One process's figures for a model and global batch, derived from its run with the fewest processes."""

    run: RunFigures
    compute_1: float  # s per step on one process (device), at the run's global batch, overhead included
    terms: Terms
    origin: dict[str, str]  # how each term was found, in words
    buckets: dict[str, list[list[int]]]  # bytes of each all-reduce per hook, bucket by bucket
    encode: dict[str, float]  # s per step of each hook itself, its all-reduces' transfer aside
    lags: dict[int, float]  # processes -> the model's steps' lag meeting on this machine's cores (`stepclock.meeting_lags`)
    reducer: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOOKS, 0.0))

    @property
    def on_gpu(self) -> bool:
        return self.run.accelerator == "cuda"

    @classmethod
    def from_run(cls, run: RunFigures, cores: int, options: Options = Options(), timed: Timed | None = None) -> "Baseline":
        """Undo the run's own scaling (its processes shared `cores` cores, or each had a GPU); each term as the options
        state it, else as `timed` here (`timed.time_run`), else assumed."""
        gpu = run.accelerator == "cuda"
        share = run.processes if gpu else min(run.processes, cores)
        compute_1 = (run.step_s - run.exposed_comm_s) * share
        timed = None if timed is None or timed.on_gpu != gpu else timed
        batch = max(1, run.batch_size // run.processes)  # each process's, as the run computed it
        untimed = ("assumed 0: not timed on a GPU; the run's step holds it" if gpu else
                   "assumed 0: not timed (`python -m src.scaling <folder>` times it here)")
        origin = {}
        if options.overhead_ms is not None:
            overhead, origin["overhead"] = min(options.overhead_ms / 1000, compute_1), "stated (--overhead-ms)"
        elif timed is not None and timed.overhead_share is not None:
            overhead = timed.overhead_share * compute_1
            origin["overhead"] = (f"{timed.overhead_share:.0%} of the step: the model's step timed here at batch {batch} "
                                  f"and a quarter of it, one thread, {run.precision} (--overhead-ms)")
        else:
            overhead, origin["overhead"] = 0.0, f"{untimed} (--overhead-ms)"
        if options.skew is not None:
            skew, origin["skew"] = options.skew, "stated (--skew)"
        elif timed is not None and timed.skew is not None:
            skew, origin["skew"] = timed.skew, "standard deviation / mean of the model's step timed here, one thread (--skew)"
        else:
            skew, origin["skew"] = 0.0, f"{untimed} (--skew)"
        if run.overlap_frac is not None:
            overlap, origin["overlap"] = run.overlap_frac, f"`xfer/overlap_frac` of {run.run}"
        else:
            overlap, how = (0.0, "assumed 0") if options.overlap is None else (options.overlap, "stated")
            origin["overlap"] = f"a one-process run measures none: {how} (--overlap)"
        backward_share = BACKWARD_SHARE if run.backward_s is None else min(1.0, run.backward_s * share / compute_1)
        origin["backward"] = (f"`xfer/backward_compute_ms` of {run.run}" if run.backward_s is not None else
                              "2/3 of the compute (assumed: backward about twice the forward pass)")
        encode, reducer = dict.fromkeys(HOOKS, 0.0), dict.fromkeys(HOOKS, 0.0)
        if gpu:  # DDP's own work on each of N > 1 GPU processes, measured or assumed
            origin["hook"] = "0 on its own: on a GPU the hook's work is part of DDP's, below"
            if timed is not None and timed.reducer:
                reducer = {hook: timed.reducer.get(hook, 0.0) + DDP_GPU_MULTI_SHARE * compute_1 for hook in HOOKS}
                origin["reducer"] = (
                    f"a DDP model of world size 1 against the plain model, the run's step measured on {timed.device} "
                    "(copies into buckets, the hook, the reducer, the all-reduce call), plus "
                    f"{DDP_GPU_MULTI_SHARE:.1%} of the step that more than one GPU adds (assumed: fitted to PyTorch's "
                    "DDP benchmark, docs/scaling.md)")
            else:
                reducer = dict.fromkeys(HOOKS, (DDP_GPU_SHARE + DDP_GPU_MULTI_SHARE) * compute_1)
                origin["reducer"] = (
                    f"assumed {DDP_GPU_SHARE:.1%} + {DDP_GPU_MULTI_SHARE:.1%} of the step: one GPU under DDP against "
                    "none, and what more than one GPU adds, both fitted to PyTorch's DDP benchmark on V100s "
                    "(docs/scaling.md); `python -m src.scaling <folder>` on a GPU measures the first")
        elif timed is None:
            origin["hook"] = origin["reducer"] = untimed
        else:
            encode, reducer = timed.hooks, timed.reducer or reducer
            if timed.hooks_estimated:
                origin["hook"] = ("the hook's arithmetic estimated on tensors of these shapes, one thread (hooks could "
                                  "not be timed)")
                origin["reducer"] = "assumed 0 (DDP could not be timed)"
            else:
                origin["hook"] = ("torch's hook timed here in a DDP model of these shapes on a one-process gloo group, "
                                  "one thread")
                origin["reducer"] = ("that DDP model's forward and backward pass less a plain model's and the hook's, "
                                     "median over hooks")
        lags = timed.lags if timed is not None else {}
        origin["lag"] = ("the model's step timed on N processes at once, one thread each, meeting after each step, "
                         "against one of them stepping alone" if lags else "the probe's meeting of matrix products")
        buckets = {h: bucketed(run.shapes, h, run.powersgd_rank, int(options.bucket_mb * MIB)) for h in HOOKS}
        terms = Terms(overhead, skew, overlap, backward_share)
        return cls(run, compute_1, terms, origin, buckets, encode, lags, reducer)

    def sent(self, hook: str) -> int:
        return sum(map(sum, self.buckets[hook]))

    def step(self, hook: str, processes: int, link: Interconnect, per_process_batch: int | None = None) -> Step:
        batch_share = None if per_process_batch is None else per_process_batch / self.run.batch_size
        if link.timed_processes in self.lags:  # the measured interconnect: the model's own lag at its probed count
            link = replace(link, lag=self.lags[link.timed_processes])
        terms = replace(self.terms, reducer=self.reducer[hook])
        return predict_step(self.compute_1, self.buckets[hook], self.encode[hook], processes, link, terms, batch_share)


def load_probe(path: Path) -> gloo_probe.Probe | None:
    """A saved probe; None where there is no file."""
    if not path.exists():
        return None
    try:
        return gloo_probe.load(path)
    except ValueError as error:
        raise UsageError(f"--probe-file {error}") from error


def link_for(processes: int, measured: dict[int, Interconnect]) -> Interconnect:
    """The measured fit for this process count, else the nearest one below it (or the smallest)."""
    below = [n for n in measured if n <= processes]
    return measured[max(below) if below else min(measured)]


def predictions(base: Baseline, links: list[Interconnect], per_process_batch: int | None = None) -> list[dict]:
    """One row per interconnect, hook and process count; strong scaling only at counts that divide the run's batch."""
    run, rows = base.run, []
    counts = [n for n in PROCESS_COUNTS if per_process_batch is not None or run.batch_size % n == 0]
    for link in links:
        for hook in HOOKS:
            for row in whatif.rows(lambda n: base.step(hook, n, link, per_process_batch), run.batch_size, counts,
                                   run.steps_per_epoch * run.batch_size, per_process_batch):
                sent = base.sent(hook) if row["processes"] > 1 else 0
                rows.append({"model": run.model, "batch_size": run.batch_size, "interconnect": link.name, "hook": hook,
                             "mode": "strong" if per_process_batch is None else "weak", "bytes_per_step": sent, **row})
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
        step = base.step(run.hook, run.processes, link)  # as the run ran: its global batch split over its processes
        epoch_s = run.steps_per_epoch * step.total
        hook_ms = None if run.hook_s is None else run.hook_s * 1e3
        rows.append(" | ".join([
            "", run.run, run.hook, str(run.processes), link.name, f"{base.sent(run.hook):,}",
            "" if run.bytes_per_step is None else f"{run.bytes_per_step:,.0f}", f"{step.comm * 1e3:.1f}",
            "" if hook_ms is None else f"{hook_ms:.1f}", _pct_error(step.comm * 1e3, hook_ms),
            f"{step.compute * 1e3:.1f} + {step.overhead * 1e3:.1f} + {step.exposed * 1e3:.1f} + {step.skew * 1e3:.1f}",
            f"{epoch_s:.2f}", f"{run.epoch_s:.2f}", _pct_error(epoch_s, run.epoch_s),
            why_missed(epoch_s, run.epoch_s, step.comm * 1e3, hook_ms), "",
        ]).strip())
    return rows


MISSED = 0.25  # a prediction further off than this from the run's own measurement is explained beside it


def why_missed(epoch_s: float, measured_s: float | None, hook_ms: float, measured_hook_ms: float | None) -> str:
    """Where a prediction contradicts the run's measurement, the part of the model it traces to."""
    if not measured_s or abs(epoch_s - measured_s) <= MISSED * measured_s:
        return ""
    off = "slower" if measured_s > epoch_s else "faster"
    if measured_hook_ms and abs(hook_ms - measured_hook_ms) > MISSED * measured_hook_ms:
        return (f"the run was {off} than predicted, and its all-reduces took {measured_hook_ms:.1f} ms where the probe "
                f"gives {hook_ms:.1f}: the link or the machine's load was not what the probe met")
    return (f"the run was {off} than predicted while its all-reduces took what the probe gives: its compute or "
            "overhead differed from the one-process run's (another load, or short epochs whose start-up counts)")


def terms_lines(base: Baseline, bucket_mb: float = 25.0) -> list[str]:
    """The model's terms for this baseline, each with how it was found."""
    terms, origin = base.terms, base.origin
    last = sum(base.buckets["none"][-1])
    ms = {hook: f"{base.reducer[hook] * 1e3:.1f}" for hook in HOOKS}
    reducer_ms = ms["none"] if len(set(ms.values())) == 1 else ", ".join(f"{hook} {v}" for hook, v in ms.items())
    return [
        f"- per-step overhead, the same on any number of processes: {terms.overhead * 1e3:.1f} ms; {origin['overhead']}",
        f"- DDP's own work besides its hook, on more than one process (copying the gradients into its buckets and the "
        f"averaged ones back): {reducer_ms} ms per step, part of the overhead; {origin['reducer']}",
        f"- the hook's own work: {origin['hook']}",
        f"- skew between ranks: {terms.skew:.3f} of the step per standard deviation, times the expected lag of the slowest of "
        f"N ranks (0.56 at 2, 1.03 at 4, 1.42 at 8 standard deviations); {origin['skew']}",
        f"- overlap: {terms.overlap:.2f} of every bucket's all-reduce but the last runs during the backward pass "
        f"({origin['overlap']}); the last bucket never does ({last:,} bytes under `none`: DDP's buckets of {bucket_mb:g} MiB "
        f"after a first of 1 MiB, --bucket-mb); the backward pass: {terms.backward_share:.2f} of the compute, {origin['backward']}",
        *([] if base.on_gpu else [
            "- lag of processes meeting on this machine's shared cores (the measured interconnect only): "
            + (", ".join(f"{share:.1%} at {n} processes" for n, share in sorted(base.lags.items())) + "; " if base.lags else "")
            + origin["lag"]]),
    ]


def section(base: Baseline, rows: list[dict], links: list[Interconnect], measured: dict[int, Interconnect],
            runs: list[RunFigures], plot: str | None, options: Options, root: Path) -> str:
    """The Markdown of one model, tables first, then the terms of the model; without `links`, why not."""
    run, weak = base.run, options.per_process_batch
    counts = sorted({r["processes"] for r in rows})
    mode = ("strong scaling: the global batch of the run split over the processes" if weak is None else
            f"weak scaling: {weak} samples per process, the global batch {weak} x N")
    device = "a GPU" if base.on_gpu else "one process"
    lines = [
        f"## {run.model}, global batch {run.batch_size}", "",
        f"From `{run.run}` ({processes(run.processes)}{' on GPUs' if base.on_gpu else ''}, {run.steps_per_epoch} steps per "
        f"epoch, median {run.step_s * 1e3:.1f} ms per step): {device} takes {base.compute_1 * 1e3:.1f} ms a step. Mode: {mode}.", "",
    ]
    if links and not base.on_gpu:
        lines += [CPU_LINKS, ""]
    if links:
        speedup = {(r["interconnect"], r["hook"], r["processes"]): r["speedup"] for r in rows}
        epoch = {(r["interconnect"], r["hook"], r["processes"]): r["epoch_s"] for r in rows}
        lines += [f"Speed-up over one process ({mode.split(':')[0]}), by interconnect, hook and processes:", "",
                  "| interconnect | hook | " + " | ".join(str(n) for n in counts) + " |", "|---|---|" + "---:|" * len(counts)]
        for link in links:
            for hook in HOOKS:
                lines.append(f"| {link.name} | {hook} | " + " | ".join(f"{speedup[link.name, hook, n]:.2f}" for n in counts) + " |")
        lines += ["", "Processes at which each hook's epoch is shorter than plain all-reduce's (`none`):", "",
                  "| interconnect | " + " | ".join(HOOKS[1:]) + " |", "|---|" + "---|" * (len(HOOKS) - 1)]
        for link in links:
            wins = [_ranges([n for n in counts if n > 1 and epoch[link.name, h, n] < epoch[link.name, "none", n]]) for h in HOOKS[1:]]
            lines.append(f"| {link.name} | " + " | ".join(wins) + " |")
        lines += ["", f"![predicted speed-up]({plot})", ""]
        compared = checks(base, runs, measured) if measured and not base.on_gpu else []
        if compared:
            lines += ["Predicted against measured, on the measured interconnect (this machine's cores shared):", "",
                      "| run | hook | processes | fit | bytes/step predicted | measured | hook_ms predicted | measured | error "
                      "| step ms: compute + overhead + exposed comm + skew | epoch s predicted | measured | error "
                      f"| where more than {MISSED:.0%} off, why |",
                      "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
                      *compared, ""]
    else:
        lines += [NO_PROBE.format(root=root), ""]
    lines += [  # the hook's own time only beside predictions that use it
        "Bytes per step and process, bucket by bucket (the last one cannot overlap)"
        + (f", and the hook's own time ({base.origin['hook']}):" if links else ":"), "",
        "| hook | all-reduces (bytes) | bytes per step |" + (" hook ms |" if links else ""),
        "|---|---|---:|" + ("---:|" if links else ""),
        *[f"| {h} | {' / '.join(', '.join(f'{b:,}' for b in bucket) for bucket in base.buckets[h])} "
          f"| {base.sent(h):,} |" + (f" {base.encode[h] * 1e3:.1f} |" if links else "") for h in HOOKS], "",
        *(["Terms of the model:", "", *terms_lines(base, options.bucket_mb), ""] if links else []),
    ]
    return "\n".join(lines)


def plot(base: Baseline, rows: list[dict], links: list[Interconnect], path: Path) -> None:
    """One panel per interconnect: speed-up against processes, a line per hook, and the ideal."""
    columns, counts = min(4, len(links)), sorted({r["processes"] for r in rows})
    panel_rows = -(-len(links) // columns)
    figure = Figure(figsize=(4 * columns, 3.5 * panel_rows))
    for index, link in enumerate(links):
        axes = figure.add_subplot(panel_rows, columns, index + 1)
        for hook in HOOKS:
            points = [(r["processes"], r["speedup"]) for r in rows if r["interconnect"] == link.name and r["hook"] == hook]
            axes.plot(*zip(*points), marker=".", label=hook)
        axes.plot(counts, counts, color="grey", linestyle=":", label="ideal")
        axes.set(xscale="log", yscale="log", title=link.name, xlabel="processes", ylabel="speed-up")
        axes.set_xticks(counts, [str(n) for n in counts], fontsize="x-small")
        axes.grid(alpha=0.3)
    figure.axes[0].legend(fontsize="x-small")
    figure.suptitle(f"{base.run.model}, global batch {base.run.batch_size}: predicted speed-up")
    figure.tight_layout()
    write_file(path, figure_bytes(figure, dpi=110))


def assumptions(links: list[Interconnect], has_probe: bool, weak: int | None = None) -> str:
    """How the tables above were predicted: the mode, the formula, and the interconnects."""
    scaling = ("Strong scaling: `data.batch_size` is the global batch, split over the processes, so the steps per "
               "epoch stay fixed and each process computes 1/N of the batch; a process count that does not divide it "
               "is left out." if weak is None else
               f"Weak scaling (`--per-process-batch {weak}`): each process computes {weak} samples a step, the "
               f"global batch grows as {weak} x N and an epoch of the run's samples takes fewer steps.")
    lines = [
        "## How these are predicted", "",
        f"{scaling} On the measured interconnect, processes beyond the cores take turns on them. Per step: compute = "
        "(one process's step - overhead) x its share of the batch; overhead = the per-step cost no split shrinks, "
        "plus DDP's own work besides its hook on more than one process; comm = the hook + one ring all-reduce per "
        "collective, 2(N-1) x latency + 2(N-1)/N x bytes / (bus share x bandwidth), on the measured interconnect at "
        "a probed process count read between the all-reduces timed there; hidden = overlap x min(comm of every "
        "bucket but the last, backward compute); skew = (the step's spread x the expected lag of the slowest of N "
        "ranks + the lag of processes meeting on shared cores, the model's own where timed, else the probe's below) "
        "x (compute + overhead); step = compute + overhead + comm - hidden + skew. A CPU run's compute, DDP's own "
        "work and hook are this machine's, predicted on its measured interconnect alone; a GPU run's are its GPU's. "
        "Speed-up = one process's epoch / N processes'; efficiency = speed-up / N.",
    ]
    if links:
        lines += ["",
                  "| interconnect | bandwidth GB/s | bus share | latency us | probe's lag of processes meeting on shared cores | source |",
                  "|---|---:|---:|---:|---:|---|",
                  *[f"| {link.name} | {link.bandwidth / 1e9:.3g} | {link.bus_share:.2f} | {link.latency * 1e6:.3g} | {link.lag:.1%} "
                    f"| {link.source} |" for link in links]]
    if not has_probe:
        lines += ["", "No probe: run `python -m src.scaling <folder> --probe` for the measured interconnect."]
    return "\n".join(lines)


NO_PROBE = ("No predictions here: the run ran on CPU, and the one interconnect this report can stand behind for "
            "it, this machine's own, has no probe saved in the folder (`probe.json`). `python -m src.scaling {root} "
            "--probe` times it and the model's terms (a minute or two on 2 cores) and saves both there for the report "
            f"to predict from. {NEEDS_GPU_STEP}, not this CPU's, and the Ethernet links one timed on the "
            "machines they join.")
CPU_LINKS = (f"A CPU run is predicted on this machine's measured interconnect alone: {NEEDS_GPU_STEP}, not this "
             "CPU's, and the Ethernet links one timed on the machines they join.")


def write_scaling(root: Path, out: Path | None = None, probe: gloo_probe.Probe | None = None,
                  options: Options = Options(), report: bool = False, opened: dict[Path, RunFolder] | None = None) -> str:
    """Write scaling.md, scaling.csv and one plot per model into `out` (default `root`); returns the Markdown sections.
    `report`, which must not wait, times nothing and predicts a CPU run only on a saved probe's interconnect; `opened`:
    the folders it read (`read_runs`)."""
    out = output_folder(root if out is None else out)
    runs = merge_repeats(read_runs(root, read_figures, opened))
    if not runs:
        raise UsageError(f"{root}: no run below it has a timed training epoch (time/epoch_s) on one process or under DDP")
    cores = probe.cores if probe is not None else len(os.sched_getaffinity(0))
    measured = {} if probe is None else {
        n: Interconnect(f"gloo here, {n} proc.", bandwidth, latency, "python -m src.scaling --probe", probe.cores,
                        timed=probe.timed(n), timed_processes=n, lag=probe.lags.get(n, 0.0))
        for n, (latency, bandwidth) in probe.fits().items()}
    named = [link if options.bus_share is None else replace(link, bus_share=options.bus_share) for link in INTERCONNECTS]
    groups: dict[tuple[str, int], list[RunFigures]] = {}
    for run in sorted(runs, key=lambda r: (r.model, r.batch_size, r.processes, r.run)):
        groups.setdefault((run.model, run.batch_size), []).append(run)
    out.mkdir(parents=True, exist_ok=True)
    saved = timing.load(root / timing.FILE)
    sections, all_rows, all_links = [], [], {}
    for (model, batch), group in groups.items():
        run = group[0]
        name = timing.key(run.model, run.batch_size, run.processes, run.precision, options.per_process_batch,
                          options.bucket_mb, run.powersgd_rank)
        if not report:
            saved[name] = time_baseline(run, cores, options, tuple(measured))
        base = Baseline.from_run(run, cores, options, saved.get(name))
        links = named if base.on_gpu else list(measured.values())  # a CPU's step prices no other link (CPU_LINKS)
        rows = predictions(base, links, options.per_process_batch)
        image = None
        if links:
            image = f"scaling_{model}_{batch}.png" if sum(m == model for m, _ in groups) > 1 else f"scaling_{model}.png"
            plot(base, rows, links, out / image)
        sections.append(section(base, rows, links, measured, group, image, options, root))
        all_rows += rows
        all_links.update((link.name, link) for link in links)
    if not report:
        timing.save(out / timing.FILE, saved)
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(all_rows)
    write_file(out / "scaling.csv", table.getvalue())
    on_cpu = any(run.accelerator != "cuda" for run in runs)  # only a CPU run is predicted on this machine's interconnect
    how = [assumptions(list(all_links.values()), probe is not None or not on_cpu, options.per_process_batch)] if all_links else []
    body = "\n".join(sections + how)
    write_file(out / "scaling.md", f"# Scaling: {root}\n\n{body}")
    return body


def time_baseline(run: RunFigures, cores: int, options: Options, meet_at: Sequence[int]) -> Timed:
    if options.per_process_batch is not None:
        batches = {n: options.per_process_batch for n in meet_at}
    else:  # strong scaling: the counts that split the run's batch evenly
        batches = {n: run.batch_size // n for n in meet_at if run.batch_size % n == 0}
    return timing.time_run(run.net, run.shapes, run.input_shape, max(1, run.batch_size // run.processes), run.precision,
                           run.accelerator, run.powersgd_rank, options.bucket_mb, cores, batches,
                           need_clock=options.overhead_ms is None or options.skew is None)


def main(argv: list[str] | None = None) -> None:
    with usage_errors_exit():
        run(parse(argv))


def run(args: Namespace) -> None:
    """What the parsed command line asks for: a what-if, a probe, or the predictions for a folder."""
    if args.model is not None or args.params is not None:
        text = whatif.report(args)
        print(text)
        if args.out is not None:  # the what-if as printed, where the command says
            write_file(args.out / "whatif.md", text + "\n", root=args.out)
            print(f"-> {args.out / 'whatif.md'}")
        return
    out = args.out or args.folder or Path("outputs")
    if args.folder is not None:
        require_folder(args.folder)
    if args.probe:
        with saying("timing gloo all-reduces on this machine's cores for the probe (about a minute)"):
            probe = gloo_probe.run_probe()
        out.mkdir(parents=True, exist_ok=True)
        gloo_probe.save(probe, out / "probe.json")
        for n, (latency, bandwidth) in probe.fits().items():
            print(f"gloo, {n} processes: latency {latency * 1e6:.1f} us per ring step, bandwidth {bandwidth / 1e9:.3f} "
                  f"GB/s, meeting after equal work {probe.lags.get(n, 0.0):.1%} later than the work")
    elif args.probe_file is not None and not args.probe_file.is_file():
        raise UsageError(f"--probe-file {args.probe_file}: no such file; give a probe.json that --probe wrote")
    else:
        probe = load_probe(args.probe_file or args.folder / "probe.json")
    if args.folder is not None:
        with saying(f"reading the runs below {args.folder} and predicting their scaling (timing what no saved probe or "
                    "terms hold)"):
            options = Options(**{option.name: getattr(args, option.name) for option in fields(Options)})
            write_scaling(args.folder, out, probe, options)
        print(f"-> {out / 'scaling.md'}")

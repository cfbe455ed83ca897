"""A what-if without a run: `python -m src.scaling --model <import path> | --params <count> ...`. The step is stated
(`--step-ms`, taken as a GPU's) or timed here on one thread (`stepclock`); see docs/scaling.md."""

import importlib
import math
import warnings
from argparse import ArgumentParser, Namespace
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from src.errors import UsageError
from src.scaling.costmodel import (
    BACKWARD_SHARE, DDP_GPU_MULTI_SHARE, DDP_GPU_SHARE, GPU_LINKS, HOOKS, MIB, PRESET_BUS_SHARE, PRESETS, Interconnect,
    Step, Terms, bucketed, epoch_steps, expected_max_normal, predict_step,
)

if TYPE_CHECKING:  # torch is imported where a model is built or timed: the command line is checked without it
    import torch

TRAIN_SAMPLES = 55_000  # this project's training split: Fashion-MNIST's 60,000 less data.val_size
CHUNK = 2**18  # --params: gradients as 1 MiB fp32 tensors, so that DDP's buckets fill as they would
DEFAULT_PROCESSES = (1, 2, 4, 8, 16, 32, 64)


def add_arguments(parser: ArgumentParser) -> None:
    group = parser.add_argument_group("what-if without a run (python -m src.scaling --model ... or --params ...)")
    group.add_argument("--model", help="import path of a class or function that builds the model, e.g. "
                       "torchvision.models.resnet50 or src.models.lenet.LeNet")
    group.add_argument("--params", type=float, help="the model's parameter count instead of --model, e.g. 25.6e6")
    group.add_argument("--step-ms", type=float, help="one process's step at --batch, in ms (default: timed here, needs --model)")
    group.add_argument("--batch", type=int, help="the batch --step-ms is for; the global batch of strong scaling (default 256)")
    group.add_argument("--input", default="1x28x28", help="one sample's shape, to time --model here (default 1x28x28)")
    group.add_argument("--link", choices=sorted(PRESETS), help="a named link: " + ", ".join(
        f"{key} ({link.name})" for key, link in PRESETS.items()))
    group.add_argument("--bandwidth", type=float, help="a link's line rate in GB/s, one direction (with --latency)")
    group.add_argument("--latency", type=float, help="a link's latency per ring step in us (with --bandwidth)")
    group.add_argument("--processes", type=int, nargs="+", help=f"process counts (default {' '.join(map(str, DEFAULT_PROCESSES))})")
    group.add_argument("--hook", default="none", help=f"the DDP hook: {', '.join(HOOKS)} (default none)")
    group.add_argument("--samples", type=int, help=f"training samples per epoch (default {TRAIN_SAMPLES:,})")
    group.add_argument("--ddp-share", type=float, help="DDP's own cost on one GPU as a share of the step: a DDP model of "
                       f"world size 1 against the plain model (default {DDP_GPU_SHARE:g} with a stated step, fitted to "
                       "published V100 timings; docs/scaling.md)")


WHATIF_ONLY = ("params", "step_ms", "batch", "link", "bandwidth", "latency", "processes", "samples", "ddp_share")


def refuse(args: Namespace) -> None:
    defaults = {"hook": "none", "input": "1x28x28"}
    given = [name for name in (*WHATIF_ONLY, *defaults) if getattr(args, name) != defaults.get(name)]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')} belongs to a what-if: give --model or --params with it")


def check(args: Namespace) -> None:
    """The what-if options that `cli.parse`'s table of ranges does not check, before anything is built or timed."""
    if (args.model is None) == (args.params is None):
        raise UsageError("give one of --model (an import path) and --params (a parameter count), not both")
    if args.hook not in HOOKS:
        raise UsageError(f"--hook {args.hook} is not allowed; it must be one of {', '.join(HOOKS)}")
    if args.params is not None and args.hook.startswith("powersgd"):
        raise UsageError(f"--hook {args.hook} needs the gradients' shapes: give --model instead of --params")
    if args.step_ms is None and args.model is None:
        raise UsageError("--step-ms is needed with --params: only a model given by --model can be timed here")
    if args.link is None and (args.bandwidth is None or args.latency is None):
        raise UsageError(f"give a link: --link (one of {', '.join(sorted(PRESETS))}) or both --bandwidth and --latency")
    if args.link is not None and (args.bandwidth is not None or args.latency is not None):
        raise UsageError("--link names a preset: give it alone, or --bandwidth and --latency instead")
    if args.link in GPU_LINKS and args.step_ms is None:
        raise UsageError(f"--link {args.link} joins GPUs, and its prediction needs a GPU's step time: give --step-ms, "
                         "a GPU's step at --batch (a step timed here is this CPU's)")
    if args.bandwidth is not None and not (args.bandwidth > 0 and args.latency >= 0):
        raise UsageError(f"--bandwidth {args.bandwidth:g} --latency {args.latency:g} is not allowed; bandwidth above 0 GB/s, latency 0 us or more")
    if args.processes is not None and min(args.processes) < 1:
        raise UsageError(f"--processes {min(args.processes)} is not allowed; process counts are whole numbers of 1 or more")
    batch = args.batch or 256
    bad = [n for n in args.processes or () if batch % n and args.per_process_batch is None]
    if bad:
        raise UsageError(f"--processes {bad[0]} does not divide the global batch {batch}; strong scaling needs counts "
                         "that divide --batch (or give --per-process-batch for weak scaling)")
    input_shape(args.input)


def input_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise UsageError(f"--input {text} is not allowed; give one sample's shape as CxHxW, e.g. 3x224x224")
    return shape


def build(path: str, device: str | None = None) -> "torch.nn.Module":
    """The model an import path names, built with its defaults (on the meta device: shapes only, no memory)."""
    import torch
    module_name, _, attribute = path.rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise UsageError(f"--model {path}: cannot import it ({type(error).__name__}: {error}); give an import path "
                         "such as torchvision.models.resnet50 or src.models.lenet.LeNet") from error
    try:
        with warnings.catch_warnings(action="ignore"), torch.device(device or "cpu"):
            model = factory()
    except Exception as error:
        raise UsageError(f"--model {path}: building it with its defaults failed ({type(error).__name__}: {error})") from error
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {path} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def gradient_shapes(args: Namespace) -> list[tuple[int, ...]]:
    if args.model is not None:
        return [tuple(p.shape) for p in build(args.model, "meta").parameters() if p.requires_grad]
    full, rest = divmod(int(args.params), CHUNK)
    return [(CHUNK,)] * full + ([(rest,)] if rest else [])


def the_link(args: Namespace) -> tuple[Interconnect, str]:
    if args.link is not None:
        link, origin = PRESETS[args.link], f"--link {args.link}"
    else:
        link = Interconnect(f"{args.bandwidth:g} GB/s, {args.latency:g} us", args.bandwidth * 1e9, args.latency * 1e-6,
                            "stated", bus_share=PRESET_BUS_SHARE)
        origin = "--bandwidth, --latency"
    return (link if args.bus_share is None else replace(link, bus_share=args.bus_share)), origin


def report(args: Namespace) -> str:
    """The what-if's Markdown: what it assumed, then one row per process count."""
    batch, weak = args.batch or 256, args.per_process_batch
    shapes = gradient_shapes(args)
    parameters = sum(math.prod(s) for s in shapes)
    buckets = bucketed(shapes, args.hook, cap=int(args.bucket_mb * MIB))
    if args.step_ms is not None:
        step_1, overhead, skew = args.step_ms / 1000, 0.0, 0.0
        origin = {"step": "stated (--step-ms)", "overhead": "assumed 0: a stated step time holds its own",
                  "skew": "assumed 0"}
    else:
        from src.scaling import stepclock  # torch and the model: only to time it

        try:
            clock = stepclock.measure(build(args.model), input_shape(args.input), batch)
        except Exception as error:
            raise UsageError(f"--input {args.input}: timing --model {args.model} on it failed "
                             f"({stepclock.reason(error, 200)}); give one sample's shape as CxHxW, e.g. 3x224x224, "
                             "or --step-ms") from error
        step_1, overhead, skew = clock.step_s, clock.overhead_share * clock.step_s, clock.skew
        origin = {"step": f"timed here: one thread, input {args.input}, fp32 SGD step",
                  "overhead": f"timed here: the line through the step at batch {batch} and at a quarter of it",
                  "skew": "timed here: standard deviation / mean of the timed steps"}
    if args.overhead_ms is not None:
        overhead, origin["overhead"] = min(args.overhead_ms / 1000, step_1), "stated"
    if args.skew is not None:
        skew, origin["skew"] = args.skew, "stated"
    origin["overlap"] = ("stated (--overlap)" if args.overlap is not None else
                         "assumed: DDP, Horovod and Caffe2 start each bucket during the backward pass (--overlap)")
    reducer, reducer_origin = ddp_cost(args, step_1, args.step_ms is not None)
    terms = Terms(overhead, skew, 1.0 if args.overlap is None else args.overlap, BACKWARD_SHARE, reducer)
    link, link_origin = the_link(args)
    counts = sorted(set(args.processes or DEFAULT_PROCESSES))
    samples = args.samples or TRAIN_SAMPLES
    mode = (f"strong scaling: the global batch {batch} split over the processes" if weak is None else
            f"weak scaling: {weak} samples per process, the global batch {weak} x N")
    lines = [
        f"# What-if: {args.model or f'{parameters:,} parameters'}, hook {args.hook}", "",
        f"Mode: {mode}; {samples:,} samples per epoch.", "",
        f"- model: {parameters:,} parameters; {sum(sum(b) for b in buckets):,} bytes per step and process in "
        f"{len(buckets)} bucket(s): {' / '.join(f'{sum(b):,}' for b in buckets)}",
        f"- one process's step: {step_1 * 1e3:.1f} ms at batch {batch}, {origin['step']}",
        f"- link: {link.name} ({link_origin}): {link.bandwidth / 1e9:.4g} GB/s line rate x bus share {link.bus_share:.2f} "
        f"= {link.bus_bandwidth / 1e9:.4g} GB/s, {link.latency * 1e6:.3g} us per ring step"
        + (f"; {link.source}" if link.source != "stated" else ""),
        "- ring all-reduce: each process sends and receives 2(N-1)/N of the bytes, in 2(N-1) steps",
        f"- bus share {link.bus_share:.2f}: " + ("stated (--bus-share)" if args.bus_share is not None else
                                                  "assumed for every link (nccl-tests' bus bandwidth over the line rate; --bus-share)"),
        f"- per-step overhead that does not shrink with more processes: {overhead * 1e3:.1f} ms, {origin['overhead']} "
        "(--overhead-ms)",
        f"- last bucket ({sum(buckets[-1]):,} bytes; buckets of {args.bucket_mb:g} MiB after a first of 1, "
        f"--bucket-mb) never overlaps; the other buckets' all-reduces overlap with the backward pass "
        f"({BACKWARD_SHARE:.2f} of the compute, assumed) for a share {terms.overlap:.2f}, {origin['overlap']}",
        f"- skew between ranks: {terms.skew:.3f} of the step per standard deviation, {origin['skew']} (--skew); the "
        f"slowest of N ranks lags by {expected_max_normal(2):.2f} (N=2) to {expected_max_normal(max(counts)):.2f} "
        f"(N={max(counts)}) standard deviations",
        f"- DDP's own work on each of N > 1 processes (copies of the gradients into its buckets and back, the hook, the "
        f"reducer, the all-reduce call, and what more than one GPU adds besides the transfer): {reducer * 1e3:.1f} ms a step, "
        + reducer_origin,
        "",
        "| processes | global batch | per process | compute ms | overhead ms | comm ms | exposed ms | skew ms | step ms "
        "| epoch s | speed-up | efficiency |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    share = None if weak is None else weak / batch
    for row in rows(lambda n: predict_step(step_1, buckets, 0.0, n, link, terms, share), batch, counts, samples, weak):
        lines.append(
            f"| {row['processes']} | {row['global_batch']} | {row['per_process']:g} | {row['compute_ms']:.1f} "
            f"| {row['overhead_ms']:.1f} | {row['comm_ms']:.1f} | {row['exposed_ms']:.1f} | {row['skew_ms']:.1f} "
            f"| {row['step_ms']:.1f} | {row['epoch_s']:.4g} | {row['speedup']:.2f} | {row['efficiency']:.1%} |")
    return "\n".join(lines)


def ddp_cost(args: Namespace, step_1: float, stated_step: bool) -> tuple[float, str]:
    """Seconds per step DDP's own work adds on N > 1 processes, and how that was found. A stated step is taken as a
    GPU's, with the fitted shares; one timed here is this CPU's."""
    if not stated_step:
        share = args.ddp_share or 0.0
        return share * step_1, (f"{share:.1%} of the step, stated (--ddp-share)" if args.ddp_share is not None else
                                "0: the step was timed on this CPU, not a GPU (--ddp-share states it)")
    one = DDP_GPU_SHARE if args.ddp_share is None else args.ddp_share
    how = "stated (--ddp-share)" if args.ddp_share is not None else "assumed, not measured (--ddp-share)"
    return (one + DDP_GPU_MULTI_SHARE) * step_1, (
        f"{one:.1%} of the step on one GPU under DDP against none, {how}, + {DDP_GPU_MULTI_SHARE:.1%} that more than one "
        "GPU adds; both fitted to PyTorch's DDP benchmark on V100s (docs/scaling.md)")


def rows(step: Callable[[int], Step], batch: int, counts: Sequence[int], samples: int,
         per_process_batch: int | None) -> list[dict]:
    """Predicted step and epoch for each process count; speed-up and efficiency against one process in the same mode."""

    def predict(n: int) -> dict:
        predicted = step(n)
        global_batch = batch if per_process_batch is None else per_process_batch * n
        return {"processes": n, "global_batch": global_batch, "per_process": global_batch / n,
                "compute_ms": predicted.compute * 1e3, "overhead_ms": predicted.overhead * 1e3,
                "comm_ms": predicted.comm * 1e3, "exposed_ms": predicted.exposed * 1e3, "skew_ms": predicted.skew * 1e3,
                "step_ms": predicted.total * 1e3, "epoch_s": epoch_steps(samples, global_batch) * predicted.total}

    one = predict(1)["epoch_s"]
    table = [predict(n) for n in counts]
    for row in table:
        row["speedup"] = one / row["epoch_s"]
        row["efficiency"] = row["speedup"] / row["processes"]
    return table

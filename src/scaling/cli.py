"""`python -m src.scaling <run or sweep folder>`: predicted epoch time and speed-up on 1 to 1024 processes.
Parsed and checked without torch, so that `--help` and a mistake are answered in about a second."""

from argparse import Namespace
from pathlib import Path

from src.errors import UsageError
from src.runs import ArgumentParser
from src.scaling import whatif
from src.scaling.costmodel import PRESET_BUS_SHARE


def parse(argv: list[str] | None) -> Namespace:
    parser = ArgumentParser(prog="python -m src.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", help="a run folder, a sweep folder or outputs/")
    parser.add_argument("--out", type=Path, help="where to write (default: the folder; outputs/ for --probe alone; a "
                                                  "what-if writes whatif.md there only with --out)")
    parser.add_argument("--probe", action="store_true", help="time gloo all-reduces here first and save probe.json")
    parser.add_argument("--probe-file", type=Path, help="a saved probe.json (default: probe.json in the folder, if any)")
    parser.add_argument("--per-process-batch", type=int, help="weak scaling: samples per process and step (default: strong "
                        "scaling, the global batch split over the processes)")
    terms = parser.add_argument_group("terms of the model (default: measured, or the assumption docs/scaling.md states)")
    terms.add_argument("--overlap", type=float, help="share of every bucket's all-reduce but the last that hides behind the "
                       "backward pass, where the run logged none (default 0; what-if: 1)")
    terms.add_argument("--overhead-ms", type=float, help="per-step overhead that does not shrink with more processes "
                       "(default: timed here; what-if: 0)")
    terms.add_argument("--skew", type=float, help="spread of one process's step time, standard deviation / mean "
                       "(default: timed here; what-if: 0)")
    terms.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb: the size of the buckets, and "
                       "so of the last one, which cannot overlap (default 25)")
    terms.add_argument("--bus-share", type=float, help="share of a named link's bandwidth an all-reduce reaches "
                       f"(default {PRESET_BUS_SHARE}; the probe's fit: 1)")
    whatif.add_arguments(parser)
    args = parser.parse_args(argv)
    whatif_mode = args.model is not None or args.params is not None
    if args.folder is None and not args.probe and not whatif_mode:
        raise UsageError("give a run or sweep folder, --probe, or a what-if (--model or --params)")
    whole = "a whole number of 1 or more"
    allowed = [
        ("--overlap", args.overlap, lambda value: 0 <= value <= 1, "between 0 and 1"),
        ("--skew", args.skew, lambda value: 0 <= value <= 10, "between 0 and 10"),
        ("--bus-share", args.bus_share, lambda value: 0 < value <= 1, "above 0 and at most 1"),
        ("--bucket-mb", args.bucket_mb, lambda value: value > 0, "above 0"),
        ("--overhead-ms", args.overhead_ms, lambda value: value >= 0, "0 or more"),
        ("--per-process-batch", args.per_process_batch, lambda value: value >= 1, whole),
        ("--params", args.params, lambda value: value >= 1 and value == int(value), whole),
        ("--step-ms", args.step_ms, lambda value: value > 0, "above 0"),
        ("--batch", args.batch, lambda value: value >= 1, whole),
        ("--samples", args.samples, lambda value: value >= 1, whole),
        ("--ddp-share", args.ddp_share, lambda value: 0 <= value <= 1, "a share of the step, from 0 to 1"),
    ]
    for option, value, ok, rule in allowed:
        if value is not None and not ok(value):
            raise UsageError(f"{option} {value:g} is not allowed; it must be {rule}")
    if whatif_mode:
        if args.folder is not None or args.probe:
            raise UsageError("--model/--params is a what-if without a run: give no run folder and no --probe with it")
        whatif.check(args)
    else:
        whatif.refuse(args)
    return args

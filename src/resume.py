"""A resume continues the run as it was: `ckpt_path=last|auto hydra.run.dir=<run>` takes the run's own settings, and
a key may differ from its `config.yaml` only where it cannot change what the run computes."""

import logging
import re
from pathlib import Path
from typing import Any

from hydra.core.override_parser.types import Override
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from src import config, records
from src.errors import ResumeRefused, UsageError
from src.records import CKPT_WORDS, has_checkpoints

log = logging.getLogger("src.train")
# Keys that cannot change what a run computes: where the data is, what is shown, logged, saved and tested, how fast
# the same steps run; devices too, as DDP computes what one process does at the same global batch (docs/equivalence.md).
MAY_CHANGE = {
    "data.root", "data.download", "tags", "test_weights", "checkpoint.every_n_train_steps",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps", "trainer.profiler",
    "trainer.limit_test_batches", "trainer.benchmark",
    "channels_last", "compile", "cuda_graphs", "steps_per_execution", "accelerator", "devices", "num_nodes",
    "strategy.timeout_s", "strategy.process_group_backend", "strategy.bucket_cap_mb",
    "strategy.gradient_as_bucket_view", "strategy.static_graph", "ckpt_path", "output_dir", "run_name", "precision",
    "threads",  # follows devices and the cores; a folder from before it was recorded has none
}
# Of those, where the data is: a record never carries it, so a resume reads the data where the run did unless its own
# command types another folder (conf/'s default in its place would download afresh).
TYPED_TO_CHANGE = {"data.root"}
LENGTH = ("max_epochs", "trainer.max_steps")  # a resume may move these, unless a learning-rate schedule spans them


def typed_values() -> dict[str, str]:
    """The running command's `key=value` overrides, as it typed them (none outside a Hydra job)."""
    lines = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    return dict(line.split("=", 1) for line in lines if "=" in line)


def with_record(args: list[str]) -> list[str]:
    """The overrides the run (or sweep) recorded, then the command's own; arguments that resume nothing as they are."""
    typed = {o.key_or_group: o for o in config.parse(args)}
    multirun = "-m" in args or "--multirun" in args
    ckpt_path = typed.get("ckpt_path")
    word = str(ckpt_path.value()) if ckpt_path is not None and not ckpt_path.is_sweep_override() else None
    if multirun and word == "auto" and "hydra.sweep.dir" in typed:
        path = Path(str(typed["hydra.sweep.dir"].value())) / "multirun.yaml"
        if not path.is_file():
            return args
        data = records.load(path)
        overrides = records.overrides(records.select(data, "hydra.overrides.task"), path)
        recorded = records.settings([line for line in overrides if line not in args], path, sweep=True)
        launch = records.launch_settings(records.select(data, "hydra.overrides.hydra") or [], path)
    elif not multirun and word in CKPT_WORDS and "hydra.run.dir" in typed:
        folder = Path(str(typed["hydra.run.dir"].value()))
        if word == "last" and not folder.is_dir():
            raise UsageError(f"ckpt_path=last: hydra.run.dir={folder} does not exist; "
                             "name the folder of the run to resume")
        path = folder / ".hydra" / "overrides.yaml"
        if not has_checkpoints(folder):
            return args
        if not path.is_file():
            raise UsageError(f"{path} is missing: a resume takes the run's settings from it; resume a folder that a "
                             "run wrote, or start a new run elsewhere")
        moved = resumed(folder, set(typed))
        recorded = [line for line in records.settings(records.load(path, root=folder), path, typed=set(typed))
                    if key_of(line) not in {key_of(later) for later in moved}] + moved
        launch = []
    else:
        return args
    if multirun:  # the lines typed again as they were are the sweep's too
        check_sweep(config.parse([*recorded, *(line for line in overrides if line in args)]), typed, path.parent)
    taken = [line for line in [*launch, *recorded] if line.partition("=")[0].lstrip("+~") not in typed]
    return [*taken, *args]


def resumed(folder: Path, typed: set[str]) -> list[str]:
    """The settings the run's earlier resumes typed (`.hydra/resumes.yaml`), each a line of its own key, the latest
    one's: a key a resume moved (max_epochs) stays where it moved it, as its `config.yaml` says."""
    path = folder / records.RESUMES
    lines: dict[str, str] = {}
    for entry in records.resumes(folder):
        kept = [line for line in entry["overrides"] if records.carried(key_of(line)) or key_of(line) in config.GROUPS]
        lines |= {key_of(line): line for line in records.settings(kept, path, typed=typed)}
    return list(lines.values())


def key_of(line: str) -> str:
    return line.lstrip("+~").partition("=")[0]


def check_sweep(recorded: list[Override], typed: dict[str, Override], folder: Path) -> None:
    """The same keys swept over the same values, the jobs' settings as they were (a job that never started has no
    config.yaml to hold it to)."""
    before = {o.key_or_group: o for o in recorded}
    for name, override in typed.items():
        old = before.get(name)
        was_swept = old is not None and old.is_sweep_override()
        if was_swept or override.is_sweep_override():
            if not (was_swept and override.is_sweep_override() and swept(override) == swept(old)):
                ran = f"it swept {old.input_line}" if was_swept else f"it did not sweep {name}"
                raise UsageError(f"{override.input_line} is not allowed in a resume of the sweep {folder}: {ran}; a "
                                 "resume runs the same jobs, so give the sweep as it was, or start a new one elsewhere")
        elif old is not None and old.input_line != override.input_line and name not in MAY_CHANGE | set(LENGTH) \
                and not name.startswith("hydra"):
            raise UsageError(f"{override.input_line} is not allowed in a resume of the sweep {folder}: its jobs "
                             f"used {old.input_line}, and a resume continues them as they were; start a new sweep to "
                             "change it")


def swept(override: Override) -> Any:
    """Its values in any order (a job's folder is found by its values, and `shuffle()` draws a new order), or the
    space of an `interval()` (a search: hydra/sweeper=optuna)."""
    return override.value() if override.is_interval_sweep() else sorted(override.sweep_string_iterator())


def gradient_math(flat: dict[str, Any]) -> tuple[Any, ...]:
    """A strategy's hook, and PowerSGD's settings where it compresses."""
    hook = flat.get("strategy.hook") or "none"
    powersgd = ("strategy.powersgd_rank", "strategy.start_powersgd_iter") if str(hook).startswith("powersgd") else ()
    state = {k: v for k, v in flat.items() if k.startswith("strategy.hook_state") and v is not None}
    return (hook, sorted(state.items()), *(flat.get(k) for k in powersgd))


def check(cfg: DictConfig) -> records.Result | None:
    """The recorded result of a run that finished, else None."""
    from src.checkpoints import check_new_run  # torch: once the config passed its checks

    folder = Path(cfg.output_dir)
    if cfg.ckpt_path is None:
        check_new_run(folder)  # before the records are written: they are the other run's
    if str(cfg.ckpt_path) not in CKPT_WORDS or not has_checkpoints(folder):
        return None
    path = folder / "config.yaml"
    if not path.is_file():
        raise UsageError(f"{path} is missing: a resume is checked against the config the run used; resume a folder "
                         "that a run wrote, or start a new run elsewhere")
    before, after = config.flatten(records.config(path)), config.values(cfg, derived=True)
    recorded = before.get("output_dir", str(folder))
    if not isinstance(recorded, str):
        raise UsageError(f"{path}: output_dir={records.shown(recorded)} is not allowed; it names the run's folder")
    here = moved(before, Path(recorded), folder)
    typed = typed_values()
    strategy_changed = before.get("strategy_name") != after.get("strategy_name")
    if strategy_changed and gradient_math(before) != gradient_math(after):
        raise refused("strategy", before.get("strategy_name"), after["strategy_name"], folder,
                      f", and the two treat gradients differently (hook {gradient_math(before)[0]} against "
                      f"{gradient_math(after)[0]}); leave it out, or start a new run (without ckpt_path) to change it")
    for name in sorted(before.keys() | after.keys(), key=lambda k: (k not in GROUP_NAMES, "." in k, k)):
        old, new = before.get(name, "(none)"), after.get(name, "(none)")
        same = old == new or name in here and here[name] == new  # where the folder is now
        may_change = name in MAY_CHANGE and (name not in TYPED_TO_CHANGE or name in typed)
        if same or may_change or strategy_changed and name.startswith("strategy"):
            continue
        if name == "precision_used":
            raise ResumeRefused(f"precision={cfg.precision} is not allowed in a resume of {folder}: on this machine it "
                                f"means {new}, where the run used {old}; resume it with precision={old} on hardware "
                                f"that computes in {old}")
        if name in LENGTH and before.get("optim.schedule", "none") == "none":
            continue
        if name in LENGTH:
            raise refused(name, old, new, folder, f", over which its learning rate follows optim.schedule="
                          f"{before['optim.schedule']}: another length would change every step of it; start a new run "
                          "to train longer")
        if not records.carried(name):
            raise refused(name, old, new, folder, ", which a record never sets (where a run reads its data, "
                          f"writes and logs come from the command); type {name}={quoted(old)} to go on with it, or "
                          "start a new run (without ckpt_path)")
        raise refused(name, old, new, folder, ", and a resume continues the run as it was; leave it out, or start a "
                                              "new run (without ckpt_path) to change it")
    return finished(cfg, folder)


def moved(before: dict[str, Any], recorded: Path, folder: Path) -> dict[str, Any]:
    """The recorded paths where the run folder is now: a folder moved or copied since, or a folder above it moved with
    it (a sweep's folder, which holds its study; a checkout, whose outputs/ holds the run and the MLflow store), found
    by the names the recorded and the present folder share at their end. Paths outside what moved stay as they were."""
    old, new = recorded.parts, folder.absolute().parts
    shared = 0
    while shared < min(len(old), len(new)) - 1 and old[-1 - shared] == new[-1 - shared]:
        shared += 1
    if shared and len(old) - shared < 2:  # never the file system's root: every path would move
        shared = 0
    was, now = str(Path(*old[:len(old) - shared])), str(Path(*new[:len(new) - shared]))
    if was == now:
        return {}
    under = re.compile(rf"(?<![\w.-]){re.escape(was)}(?=/|$)")
    return {key: under.sub(lambda _: now, value) for key, value in before.items() if isinstance(value, str)}


GROUP_NAMES = {"model_name": "model", "strategy_name": "strategy"}  # refused by the option chosen, before its keys


def refused(name: str, old: Any, new: Any, folder: Path, why: str) -> ResumeRefused:
    name = GROUP_NAMES.get(name, name)
    return ResumeRefused(f"{name}={quoted(new)} is not allowed in a resume of {folder}: the run used "
                         f"{name}={quoted(old)}{why}")


def quoted(value: Any) -> str:
    """A value as the command line types it, bounded as a record's (the run's config.yaml may say anything)."""
    return records.bounded(config.shown(value))


def finished(cfg: DictConfig, folder: Path) -> records.Result | None:
    """The result of a run that trained as far as its config asks and was tested."""
    from src.checkpoints import check_readable, newest  # torch: once the config passed its checks

    done, saved = records.result(folder), newest(folder)
    check_readable(saved, cfg.ckpt_path)  # before anything of the run is written again
    if done is None or saved is None or saved.path.name != "last.ckpt" or done.step != saved.step:
        return None  # no result, or another attempt's: the run goes on
    epochs, max_steps = saved.contents.get("epoch", -1) + 1, cfg.trainer.get("max_steps", -1)
    if epochs < cfg.max_epochs and not 0 < max_steps <= saved.step:
        return None
    log.info(f"finished before, not run again: {done.line}")
    return records.Result(done.metrics, done.line, done.step, skipped=True, time_to_accuracy=done.time_to_accuracy)

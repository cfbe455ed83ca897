"""A resume continues the run as it was: `ckpt_path=last|auto hydra.run.dir=<run>` takes the run's own config.

The run folder's `.hydra/overrides.yaml` holds the command-line settings the run was started with.
A resume composes its config from them first and then from what its own command line gives, so that
`python -m src.train ckpt_path=last hydra.run.dir=<run>` alone trains on with the run's batch size,
optimizer, model, epochs and batch limits. A key given again with another value is allowed only
where it cannot change what the run computes (`MAY_CHANGE`; where the run ends, `max_epochs`, unless
a learning-rate schedule spreads over it; the precision as what it means on this machine); any other
change is refused in one line that names the key, the run's value and the new one. This runs before
Hydra starts, which would otherwise rewrite the folder's records of the run.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from src import records
from src.checks import CONF_DIR, flatten, is_hydra, parse_overrides
from src.errors import UsageError
from src.runs import RESOLVED_CONFIG, resolved_config

RUN_OVERRIDES = Path(".hydra", "overrides.yaml")
SWEEP_CONFIG = "multirun.yaml"  # in a sweep folder: Hydra's record of the sweep, its overrides among it
PRECISION_USED = "precision_used"  # in a run folder's config.yaml, beside `precision`: what `auto` became there
# Keys a resume may give anew: where the data is, what is shown, logged, saved and tested, how long a
# collective may wait, and how fast the same steps run (layout, compilation, graphs, cuDNN's choice,
# DDP's buckets). Devices and nodes too: DDP computes what one process does at the same global batch
# (docs/equivalence.md); the run says so when the number of processes changes (src/callbacks/run_state.py).
MAY_CHANGE = {
    "data.root", "data.download", "tags", "test_weights", "checkpoint.every_n_train_steps",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps", "trainer.profiler",
    "trainer.limit_test_batches", "trainer.benchmark",
    "channels_last", "compile", "cuda_graphs", "steps_per_execution", "accelerator", "devices", "num_nodes",
    "strategy.timeout_s", "strategy.process_group_backend", "strategy.bucket_cap_mb", "strategy.gradient_as_bucket_view",
    "strategy.static_graph",
}
# Where the run ends: a resume may move it (to train longer), unless a schedule spreads the learning rate up to it.
LENGTH = ("max_epochs", "trainer.max_steps")


# A resumed folder, its settings' overrides, and Hydra's own (a launcher chosen, `hydra/launcher=slurm`).
Record = tuple[Path, list[str], list[str]]


def run_record(overrides: list[Override]) -> Record | None:
    """The run folder a one-run command resumes (`ckpt_path=last|auto` with `hydra.run.dir`) and the overrides it
    was started with; None where there is no run to resume (no folder, or no checkpoint in it yet)."""
    given = {o.key_or_group: o.value() for o in overrides if not o.is_sweep_override()}
    folder = given.get("hydra.run.dir")
    if given.get("ckpt_path") is None or folder is None:
        return None
    from src.checkpoints import CKPT_WORDS, has_checkpoints  # torch: only for a command that names a checkpoint

    if str(given["ckpt_path"]) not in CKPT_WORDS:
        return None
    folder = Path(str(folder))
    if given["ckpt_path"] == "last" and not folder.is_dir():
        raise UsageError(f"ckpt_path=last: hydra.run.dir={folder} does not exist; name the folder of the run to resume")
    if not has_checkpoints(folder) or not (folder / RUN_OVERRIDES).is_file():
        return None
    # Hydra's own settings of the run (`.hydra/hydra.yaml`) are not taken: a record may set no Hydra callback or folder.
    return folder, records.overrides(records.load(folder / RUN_OVERRIDES), folder / RUN_OVERRIDES), []


def sweep_record(overrides: list[Override]) -> Record | None:
    """The sweep folder a sweep with `ckpt_path=auto` continues (`hydra.sweep.dir`) and the overrides it swept."""
    given = {o.key_or_group: o.value() for o in overrides if not o.is_sweep_override()}
    folder = given.get("hydra.sweep.dir")
    if given.get("ckpt_path") != "auto" or folder is None or not (Path(str(folder)) / SWEEP_CONFIG).is_file():
        return None
    path = Path(str(folder)) / SWEEP_CONFIG
    return Path(str(folder)), records.overrides(records.select(records.load(path), "hydra.overrides.task"), path), []


def with_run_config(args: list[str]) -> list[str]:
    """`python -m src.train` arguments with the resumed run's (or sweep's) own overrides before the command's; a
    change it cannot take is a UsageError. Arguments that resume nothing come back as they are."""
    multirun = "-m" in args or "--multirun" in args
    overrides = parse_overrides(args)
    record = sweep_record(overrides) if multirun else run_record(overrides)
    if record is None:
        return args
    folder, recorded, started = record
    for line in [line for line in recorded if line not in args]:  # a line typed again is the command's own
        records.check_override(line, folder / (SWEEP_CONFIG if multirun else RUN_OVERRIDES))
    base = [o for o in parse_overrides(recorded) if o.key_or_group != "ckpt_path"]
    given = [o for o in overrides if o.key_or_group != "ckpt_path" and not is_hydra(o.key_or_group)]
    replaced = {o.key_or_group for o in given}
    merged = [o for o in base if o.key_or_group not in replaced] + given
    check_sweep(base, merged, folder)
    search = [o.input_line for o in overrides if o.key_or_group == "hydra.searchpath"]
    before, after = composed(first_job(base) + search), composed(first_job(merged) + search)
    check_changes(before, after, Resumed(folder, sweep=multirun))
    runs = sorted(path.parent for path in folder.glob(f"*/{RESOLVED_CONFIG}")) if multirun else [folder]
    check_precision(before, after, runs)
    given_lines = {o.input_line for o in given}
    hydra_given = {o.key_or_group for o in overrides if is_hydra(o.key_or_group)}
    hydra_kept = [o.input_line for o in parse_overrides(started) if o.key_or_group not in hydra_given]
    # flags, the command's hydra.* and ckpt_path, Hydra's own settings of the run not given again, then the settings
    return [*(arg for arg in args if arg not in given_lines), *hydra_kept, *(o.input_line for o in merged)]


def first_job(overrides: list[Override]) -> list[str]:
    """A sweep's overrides with each swept key at its first value: one job's, whose config stands for the rest."""
    lines = []
    for override in overrides:
        if override.is_sweep_override():
            lines.append(f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}")
        else:
            lines.append(override.input_line)
    return lines


def check_sweep(base: list[Override], merged: list[Override], folder: Path) -> None:
    """A sweep resumes as the same sweep: the keys it swept, with the same values, and no other key swept."""
    swept = {o.key_or_group: o for o in base if o.is_sweep_override()}
    for override in merged:
        old = swept.get(override.key_or_group)
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else None
        if (old is None) != (values is None) or old is not None and values != list(old.sweep_string_iterator()):
            ran = f"it swept {old.input_line}" if old is not None else f"it did not sweep {override.key_or_group}"
            raise UsageError(f"{override.input_line} is not allowed in a resume of the sweep {folder}: {ran}; a resume "
                             "runs the same jobs, so give the sweep as it was, or start a new one elsewhere")


def composed(overrides: list[str]) -> dict[str, Any]:
    """The training config these overrides compose, flat and unresolved, with Hydra's group choices as `<group>=` keys."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    choices = {f"{group}=": choice for group, choice in cfg.hydra.runtime.choices.items() if not group.startswith("hydra")}
    settings = {key: value for key, value in OmegaConf.to_container(cfg, resolve=False).items() if key != "hydra"}
    return {**choices, **flatten(settings)}


def gradient_math(config: dict[str, Any]) -> tuple[Any, ...]:
    """What a strategy does to the gradients: its hook, and PowerSGD's settings where it compresses."""
    hook = config.get("strategy.hook") or "none"
    powersgd = ("strategy.powersgd_rank", "strategy.start_powersgd_iter") if str(hook).startswith("powersgd") else ()
    return (hook, config.get("strategy.hook_state"), *(config.get(key) for key in powersgd))


@dataclass(frozen=True)
class Resumed:
    """What is resumed, for the refusals' words: a run folder, or a sweep folder whose jobs are resumed."""

    folder: Path
    sweep: bool = False

    def __str__(self) -> str:
        return f"the sweep {self.folder}" if self.sweep else str(self.folder)

    @property
    def owner(self) -> str:
        return "its jobs" if self.sweep else "the run"


def refused(name: str, old: Any, new: Any, resumed: Resumed, why: str) -> UsageError:
    return UsageError(f"{name}={shown(new)} is not allowed in a resume of {resumed}: {resumed.owner} used "
                      f"{name}={shown(old)}{why}")


def check_changes(before: dict[str, Any], after: dict[str, Any], folder: Resumed) -> None:
    """Every key whose value the command changes must be one a resume may change."""
    strategy_changed = before.get("strategy=") != after.get("strategy=")
    if strategy_changed and gradient_math(before) != gradient_math(after):
        raise refused("strategy", before["strategy="], after["strategy="], folder,
                      f", and the two treat gradients differently (hook {gradient_math(before)[0]} against "
                      f"{gradient_math(after)[0]}); leave it out, or start a new run (without ckpt_path) to change it")
    for key in sorted(before.keys() | after.keys(), key=lambda k: (not k.endswith("="), k)):
        old, new = before.get(key), after.get(key)
        if old == new or key in MAY_CHANGE or key == "precision" or strategy_changed and key.startswith("strategy"):
            continue  # precision: compared as what it means on this machine (`check_precision`)
        if key in LENGTH and before.get("optim.schedule", "none") == "none":
            continue
        if key in LENGTH:
            raise length_refused(key, old, new, folder, before["optim.schedule"])
        raise refused(key.removesuffix("="), old, new, folder, ", and a resume continues the run as it was; leave it "
                      "out, or start a new run (without ckpt_path) to change it")


def length_refused(key: str, old: Any, new: Any, folder: Resumed, schedule: str) -> UsageError:
    return refused(key, old, new, folder, f", over which its learning rate follows optim.schedule={schedule}: another "
                   "length would change every step of it; start a new run to train longer")


def shown(value: Any) -> str:
    """A value as a command line types it."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_precision(before: dict[str, Any], after: dict[str, Any], runs: list[Path]) -> None:
    """The resume must compute in the precision each run used. `precision=auto` picks by hardware, so a value is
    compared by what it means on this machine, against what each run's config.yaml says it became there."""
    from src.fast_path import LIGHTNING_SPELLING, resolve_accelerator, resolve_precision  # torch: only on a resume

    def meaning(precision: object, accelerator: object) -> str:
        return resolve_precision(precision, resolve_accelerator(str(accelerator)), quiet=True)

    changed = before["precision"] != after["precision"]
    for run in runs:
        saved = resolved_config(run) or {}
        asked = after["precision"] if changed or "precision" not in saved else saved["precision"]
        used = str(saved.get(PRECISION_USED) or meaning(before["precision"], before["accelerator"]))
        used = LIGHTNING_SPELLING.get(used, used)  # as written before config.yaml took Lightning's spelling
        if meaning(asked, after["accelerator"]) != used:
            raise UsageError(
                f"precision={asked} is not allowed in a resume of {run}: on this machine it means "
                f"{meaning(asked, after['accelerator'])}, where the run used {used}; resume it with precision={used} "
                f"on hardware that computes in {used}"
            )


def finished(cfg: DictConfig) -> str | None:
    """With `ckpt_path=auto`, the result line of a run folder whose run already finished: trained as far as its
    config asks, tested, and recorded. Such a run is reported, not opened again (which would test it a second
    time and write its scalars again). None for any other folder."""
    folder = Path(cfg.output_dir)
    if str(cfg.get("ckpt_path")) != "auto" or not (folder / "train.log").is_file():
        return None
    lines = [line.split(" - ", 1)[-1] for line in (folder / "train.log").read_text().splitlines() if " - test/acc=" in line]
    from src.checkpoints import newest
    from src.hparams import has_hparams

    saved = newest(folder)
    if not lines or saved is None or saved.path.name != "last.ckpt" or not has_hparams(folder):
        return None
    epochs, max_steps = saved.contents.get("epoch", -1) + 1, cfg.trainer.get("max_steps", -1)
    return lines[-1] if epochs >= cfg.max_epochs or 0 < max_steps <= saved.step else None

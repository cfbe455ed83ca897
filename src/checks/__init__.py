"""Checks of user input, done once and early, each failing with one line that names the option.

Checks only check: they take config values and raise `UsageError`; building happens in `src/runner.py`.
The types of the top-level keys are the schema's (`src/config.py`), enforced by Hydra while composing;
the rules for values live in `src/checks/schema.py`. This module applies them to the command line
before Hydra composes it (`check_flags`, `check_overrides`, `check_run_dir`) and to the composed config
(`check_config`), without torch or Lightning, so that a mistake is answered at once. The checks of
objects already built or read, and of this machine, are in `src/checks/objects.py`.
"""

import difflib
import fnmatch
import importlib.util
import itertools
import re
import tempfile
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from src.launch.ranks import external_rank
from src.errors import UsageError
from src.checks.lightning_names import trainer_arguments
from src.checks.schema import ALIASES, SCHEMA, shown
from src.config import TrainConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Trainer arguments that the top-level keys own; `trainer.<name>` may not set them.
OWNED_BY_TOP_LEVEL = {"accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks",
                      "max_epochs", "sync_batchnorm", "default_root_dir", "use_distributed_sampler", "plugins"}
# Keys computed from other settings; typing them would make the run's records disagree with it.
DERIVED = {"model_name": "model=<option>", "strategy_name": "strategy=<option>", "output_dir": "hydra.run.dir=<folder>",
           "run_name": "model, strategy, devices, num_nodes and precision"}


def group_options(group: str, dirs: tuple[Path, ...] = (CONF_DIR,)) -> list[str]:
    """The options of a config group: its files in conf/ and in the folders of `hydra.searchpath`."""
    return sorted({p.stem for folder in dirs for p in (folder / group).glob("*.yaml")})


def config_dirs(overrides: list[Override]) -> tuple[Path, ...]:
    """conf/ and the folders that `hydra.searchpath=[file://<folder>,pkg://<package>]` adds to it."""
    dirs = [CONF_DIR]
    for override in overrides:
        if override.key_or_group != "hydra.searchpath" or override.is_sweep_override():
            continue
        value = override.value()
        for entry in map(str, value if isinstance(value, list) else [value]):
            if entry.startswith("file://"):
                dirs.append(Path(entry.removeprefix("file://")))
            elif entry.startswith("pkg://"):
                spec = importlib.util.find_spec(entry.removeprefix("pkg://").replace("/", "."))
                dirs += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return tuple(dirs)


def not_allowed(key: str, value: Any, allowed: str) -> UsageError:
    return UsageError(f"{key}={shown(value)} is not allowed; {allowed}")


# --- the command line, before Hydra composes it -------------------------------------------------------------


def parse_overrides(args: list[str]) -> list[Override]:
    """The overrides among `args`, each in Hydra's grammar."""
    parser = OverridesParser.create()
    overrides = []
    for arg in args:
        if arg.startswith("-") or not ("=" in arg or arg.startswith("~")):
            continue
        try:
            overrides += parser.parse_overrides([arg])
        except OverrideParseException as error:
            reason = next(line for line in str(error).splitlines() if not line.startswith("Error parsing"))
            raise UsageError(f"{arg} is not allowed; it must follow Hydra's override grammar ({reason}); quote odd values: key='...'") from None
    return overrides


def is_hydra(key: str) -> bool:
    """Hydra's own settings (`hydra.run.dir`, `hydra/launcher=slurm`): Hydra checks those."""
    return re.split(r"[./]", key)[0] == "hydra"


def is_group(key: str, dirs: tuple[Path, ...] = (CONF_DIR,)) -> bool:
    return any((folder / key).is_dir() for folder in dirs) and not is_hydra(key)


def override_values(override: Override) -> list[Any]:
    """Each value an override gives, typed as Hydra parses it (`devices=1,2` gives 1 and 2, not "1" and "2")."""
    return list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]


def check_flags(args: list[str]) -> None:
    """A `--name value` that Hydra does not know is a setting typed as a flag: say how to type it, where Hydra
    would print its usage text."""
    from hydra._internal.utils import get_args_parser  # Hydra's own flags; no public list of them

    known = {option for action in get_args_parser()._actions for option in action.option_strings}
    for index, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and name not in known and not re.fullmatch(r"-\d.*", arg):
            value = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else "...")
            raise UsageError(f"{arg} is not an option; settings are typed key=value: {name.lstrip('-')}={value}")


def check_overrides(args: list[str]) -> None:
    """Reject unknown group options and unknown keys in one line, before Hydra prints its multi-line error."""
    overrides = parse_overrides(args)
    dirs = config_dirs(overrides)
    search = [o.input_line for o in overrides if o.key_or_group == "hydra.searchpath" and o.input_line]
    for override in overrides:
        if override.is_delete() and is_group(override.key_or_group, dirs) and override.key_or_group != "experiment":
            raise UsageError(f"~{override.key_or_group} is not allowed; choose {override.key_or_group}=<option> instead")
    groups = [o for o in overrides if is_group(o.key_or_group, dirs) and not o.is_delete()]
    for override in groups:
        allowed = group_options(override.key_or_group, dirs)
        for value in override_values(override):
            if value is not None and str(value) not in allowed:
                raise UsageError(f"{override.key_or_group}={value} is not an option; choose one of: {', '.join(allowed)}")
    values = [o for o in overrides if not is_group(o.key_or_group, dirs) and not is_hydra(o.key_or_group)]
    if not values:
        return
    # Each combination of the group choices (a sweep may have several) has its own keys.
    choices = [[f"{o.key_or_group}={shown(v)}" for v in override_values(o)] for o in groups]
    for combination in itertools.product(*choices):
        known = config_keys([*combination, *search])
        for override in values:
            check_override_key(override, known, [c for c in combination if c.split("=")[0] == override.key_or_group.split(".")[0]])
    for override in values:
        if not override.is_delete():
            check_type(override)


def check_type(override: Override) -> None:
    """Each value of the type the schema (src/config.py) gives its key: Hydra would refuse it while
    composing, in several lines. The words say what the key allows, its range included. A value typed
    out (not an interpolation) is also held to its key's rule now, as `check_config` holds the composed
    config later: the mistake is answered before Hydra starts the job."""
    key = override.key_or_group
    rule = rule_for(key)
    for value in override_values(override):
        try:
            OmegaConf.update(OmegaConf.structured(TrainConfig), key, value, merge=False)
        except ValidationError as error:
            allowed = must_be(key, value, rule) if rule else str(error).splitlines()[0]
            raise not_allowed(key, value, allowed) from None
        except OmegaConfBaseException:
            pass  # a key of a config group, which the schema leaves to the class the group names
        if rule is not None and not (isinstance(value, str) and "${" in value) and not rule.test(value):
            raise not_allowed(key, value, must_be(key, value, rule))


def config_keys(group_choices: list[str]) -> set[str]:
    """Every key, inner nodes included, of the config composed from these group choices alone
    (and `hydra.searchpath`, which may add options)."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=group_choices)
    except Exception as error:
        raise UsageError(f"{' '.join(group_choices)}: {str(error).splitlines()[0]}") from None
    return set(flatten(OmegaConf.to_container(cfg, resolve=False), nodes=True))


def flatten(tree: Any, prefix: str = "", nodes: bool = False) -> dict[str, Any]:
    """`{"a": {"b": 1}}` as `{"a.b": 1}` (and `"a"` too with `nodes`); lists and empty dicts are values."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {prefix: tree} if prefix and nodes else {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key), nodes))
    return flat


def check_override_key(override: Override, known: set[str], choice: list[str]) -> None:
    """`choice`: the group option typed for this key's group, if any (`strategy=auto` for `strategy.hook`)."""
    key = override.key_or_group
    if key.startswith("trainer."):
        check_trainer_args({key.removeprefix("trainer."): None})
    if key in DERIVED:
        raise UsageError(f"{key} is derived from the other settings; set {DERIVED[key]} instead")
    if override.is_add() and is_new_callback(key, known):
        return  # +callbacks.<new name>._target_=... and its arguments: a callback the config does not have
    if key.endswith("._target_") or key == "_target_":
        group = key.split(".")[0]
        raise UsageError(f"{key} is set by the config group; choose {group}=<option> (a file under conf/{group}/)")
    if key not in known:
        raise UsageError(unknown_key_message(key, known, choice[0] if choice else ""))
    if override.is_add():
        raise UsageError(f"+{key}: {key} is already in the config; set it with {key}=...")
    if override.is_delete() and not (re.fullmatch(r"callbacks\.\w+", key) or key.startswith("trainer.")):
        raise UsageError(f"~{key}: only a callback (~callbacks.<name>) or a trainer argument can be removed; set {key}=... instead")


def is_new_callback(key: str, known: set[str]) -> bool:
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "callbacks" and not any(k.startswith(f"callbacks.{parts[1]}.") for k in known)


def unknown_key_message(key: str, known: set[str], choice: str = "") -> str:
    """Name the unknown key, the closest known one, and the keys beside it."""
    parent, _, name = key.rpartition(".")
    siblings = sorted(k.rpartition(".")[2] for k in known
                      if k.rpartition(".")[0] == parent and not k.endswith("_target_") and k not in DERIVED)
    abbreviation = "".join(word[:1] for word in name.split("_"))  # learning_rate -> lr
    close = [s for s in siblings if s == abbreviation] or difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        suggestion = f"{parent}.{close[0]}" if parent else close[0]
    else:  # a misspelled parent, e.g. optm.lr
        suggestion = next(iter(difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)), "")
    message = f"{key} is not a known key" + (f" of {choice}" if choice else "") + (f"; did you mean {suggestion}?" if suggestion else "")
    where = f"{parent}'s keys" if parent else "top-level keys"
    return f"{message} ({where}: {', '.join(siblings)})" if siblings else message


def check_run_dir(args: list[str]) -> None:
    """The run (or sweep) folder must be creatable; Hydra creates it before the task and fails with a traceback."""
    multirun = "-m" in args or "--multirun" in args
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o.value() for o in parse_overrides(args) if o.key_or_group == key and not o.is_sweep_override()]
    if given:
        folder = str(given[-1])
    else:
        hydra_defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "hydra" / "default.yaml"), resolve=False)
        folder = str(hydra_defaults["sweep" if multirun else "run"]["dir"])
    folder = re.sub(r"^\$\{claim_dir:(.*?)(,sweep)?\}$", r"\1", folder)  # the folder that claim_dir creates
    # Only the part before the first interpolation is known now: check the folder it names.
    existing = Path(folder.split("${")[0] + "x").parent if "${" in folder else Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise not_allowed(key, folder, f"it must be a folder that can be created, and {existing} is a file")
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".write-test-")).rmdir()
    except OSError as error:
        raise not_allowed(key, folder, f"it must be a folder that can be created, and {existing} is not writable ({error.strerror})") from None


# --- the composed config -------------------------------------------------------------------------------------


def rule_for(key: str):
    return next((rule for pattern, rule in SCHEMA.items() if fnmatch.fnmatchcase(key, pattern)), None)


def must_be(key: str, value: Any, rule: Any) -> str:
    """What `key` allows, after `did you mean ...?` where the value is another tool's name for an allowed one."""
    alias = ALIASES.get(key, {}).get(str(value).lower())
    return (f"did you mean {key}={alias}? " if alias else "") + f"{key} must be {rule.allowed}"


def check_config(cfg: DictConfig) -> None:
    """Every key known and every value in its range (see src/checks/schema.py), then the rules across keys."""
    try:
        nodes = {key: cfg[key] for key in cfg if key != "hydra"}
        values = flatten({k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in nodes.items()})
    except OmegaConfBaseException as error:
        first_line = str(error).splitlines()[0]
        raise UsageError(f"{getattr(error, 'full_key', '') or 'config'}: {first_line}") from None
    for key, value in values.items():
        rule = rule_for(key)
        if rule is None:
            raise UsageError(unknown_key_message(key, {k for k in values if rule_for(k)}))
        if not rule.test(value):
            raise not_allowed(key, value, must_be(key, value, rule))
    check_trainer_args(values_under(values, "trainer"))
    check_across_keys(cfg, values)


def values_under(values: dict[str, Any], group: str) -> dict[str, Any]:
    return {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(group + ".")}


def check_across_keys(cfg: DictConfig, values: dict[str, Any]) -> None:
    """Rules that tie one key to another, or to how the processes were started."""
    if values["num_nodes"] > 1 and external_rank() is None:
        raise not_allowed(
            "num_nodes", values["num_nodes"],
            "more than one node needs one process per node started by torchrun or SLURM (see docs/cluster.md); "
            "on this machine alone use num_nodes=1",
        )
    if values["compile"] and str(cfg.strategy.get("_target_", "")).endswith(".DataParallelStrategy"):
        raise not_allowed("compile", True, "nn.DataParallel copies the network each step and would drop the compiled "
                                           "code; use compile=false with strategy=dp, or strategy=ddp")
    for key, value in values.items():  # e.g. model.net.num_classes: the output layer must fit the labels
        name = key.rpartition(".")[2]
        if key.startswith("model.") and name in ("num_classes", "in_channels") and f"data.{name}" in values:
            if value != values[f"data.{name}"]:
                raise not_allowed(key, value, f"it must equal data.{name}={shown(values[f'data.{name}'])}, what data={data_choice()} holds")
    min_epochs = values.get("trainer.min_epochs")
    if min_epochs is not None and min_epochs > values["max_epochs"]:
        raise not_allowed("trainer.min_epochs", min_epochs, f"it must be at most max_epochs={values['max_epochs']}")
    for name, callback in cfg.callbacks.items():
        target = callback.get("_target_")
        if not target:
            raise UsageError(f"callbacks.{name} has no _target_; a new callback needs +callbacks.{name}._target_=<module.Class>")
        module_name = str(target).rpartition(".")[0]
        if not module_name or importlib.util.find_spec(module_name.split(".")[0]) is None:
            raise not_allowed(f"callbacks.{name}._target_", target, "it must name a class of an importable module")
    checkpoints = [name for name, c in cfg.callbacks.items() if c.get("_target_", "").endswith("ModelCheckpoint")]
    if values.get("trainer.enable_checkpointing") is False and checkpoints:
        raise not_allowed(
            "trainer.enable_checkpointing", False,
            "it must be null or true while checkpoint callbacks are set; remove them with "
            + " ".join(f"~callbacks.{name}" for name in checkpoints),
        )


def data_choice() -> str:
    """The data option of this run (`fashion_mnist`), for messages."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return str(choices.get("data", "<option>"))


def check_trainer_args(trainer_cfg: dict) -> None:
    for key in trainer_cfg:
        if key in OWNED_BY_TOP_LEVEL:
            raise UsageError(f"trainer.{key} is set by the top-level key; use {key}=... instead")
        if key not in trainer_arguments():
            close = difflib.get_close_matches(key, sorted(trainer_arguments()), n=1, cutoff=0.8)
            hint = ""
            if close and close[0] in OWNED_BY_TOP_LEVEL:
                hint = f"; did you mean {close[0]}? (a top-level key: {close[0]}=...)"
            elif close:
                hint = f"; did you mean trainer.{close[0]}?"
            raise UsageError(f"trainer.{key} is not a lightning.Trainer argument{hint}")

"""The config of a run: its schema (`TrainConfig`), the rule of every key (`RULES`), and the checks, once, before
anything is built and without torch. A new top-level key needs a field and a rule; a key no rule matches is refused."""

import copy
import difflib
import fnmatch
import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from src.errors import UsageError, missing_package

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def options(group: str) -> str:
    return ", ".join(sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml")))


@dataclass
class CheckpointConfig:
    every_n_train_steps: int = MISSING


@dataclass
class TrainConfig:
    """Switches stay `Any`: OmegaConf's bool also takes `yes` and `1`, which `RULES` refuses; so do keys of two types
    (precision) and the config groups, whose keys are their classes' own."""

    accelerator: str = MISSING
    devices: int = MISSING
    num_nodes: int = MISSING
    precision: Any = MISSING
    channels_last: Any = MISSING
    compile: Any = MISSING
    cuda_graphs: Any = MISSING
    steps_per_execution: Any = MISSING
    sync_batchnorm: Any = MISSING
    max_epochs: int = MISSING
    seed: int = MISSING
    ckpt_path: str | None = None
    tags: list[str] = field(default_factory=list)
    test_weights: str = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model_name: str = MISSING
    strategy_name: str = MISSING
    precision_used: str = MISSING
    threads: int = MISSING
    run_name: str = MISSING
    output_dir: str = MISSING
    model: dict[str, Any] = field(default_factory=dict)
    optim: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)  # a typed node could not drop an argument: ~trainer.<name>
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def shown(value: Any) -> str:
    """A value as the command line types it: `null`, `true`, `1e+30`."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Rule:
    test: Callable[[Any], bool]
    allowed: str

    def __or__(self, other: "Rule") -> "Rule":
        return Rule(lambda v: self.test(v) or other.test(v), f"{self.allowed}, or {other.allowed}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole(lo: int | None = None, hi: int | None = None) -> Rule:
    words = f"a whole number from {lo} to {hi}" if hi is not None else \
        "a whole number" + (f" of at least {lo}" if lo is not None else "")
    return Rule(lambda v: is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi), words)


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> Rule:
    parts = ([f"above {lo}" if lo_open else f"at least {lo}"] if lo is not None else []) + \
            ([f"below {hi}" if hi_open else f"at most {hi}"] if hi is not None else [])
    return Rule(lambda v: (is_int(v) or isinstance(v, float) and math.isfinite(v))
                and (lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)),
                "a number" + (" " + " and ".join(parts) if parts else ""))


def fraction(lo_open: bool) -> Rule:
    return Rule(lambda v: isinstance(v, float) and (0 < v if lo_open else 0 <= v) and v <= 1,
                "a fraction in (0, 1]" if lo_open else "a fraction in [0, 1]")


def one_of(*choices: Any, why: str = "") -> Rule:
    """One of `choices`, of the same type: `1` is not `true`, `"10"` is not `10`."""
    words = ("one of: " if len(choices) > 1 else "") + ", ".join(shown(c) for c in choices) + (f" ({why})" if why else "")
    return Rule(lambda v: any(type(v) is type(c) and v == c for c in choices), words)


def is_duration(value: Any) -> bool:
    match = isinstance(value, str) and re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", value.strip())
    return bool(match) and any(int(part) for part in match.groups())


def is_import_path(value: Any) -> bool:
    """Whose top-level package is installed (finding it imports nothing)."""
    return isinstance(value, str) and bool(re.fullmatch(r"[A-Za-z_][\w.]*\.\w+", value)) and \
        importlib.util.find_spec(value.split(".")[0]) is not None


ANY = Rule(lambda v: True, "anything")
NULL = one_of(None)
BOOL = one_of(True, False)
TEXT = Rule(lambda v: isinstance(v, str) and v != "", "a non-empty string")
DURATION = Rule(is_duration, "a duration DD:HH:MM:SS above zero, e.g. 00:01:30:00")
SEED_MAX = 2**32 - 1  # Lightning's seed_everything takes what numpy does
MAIN_PRECISIONS = ("auto", "32", "16-mixed", "bf16-mixed", "64")
# `Trainer(precision=...)`'s values in Lightning 2.6 (tests/test_config.py compares them with its `_PRECISION_INPUT`).
LIGHTNING_PRECISIONS = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
                        "bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16")
PRECISION = Rule(lambda v: not isinstance(v, bool) and str(v) in ("auto", *LIGHTNING_PRECISIONS),
                 f"one of {', '.join(MAIN_PRECISIONS)}, or Lightning's other spellings of them "
                 f"({', '.join(p for p in LIGHTNING_PRECISIONS if p not in MAIN_PRECISIONS and 'engine' not in p)})")
# What other tools call a value, and what it means here: `precision=fp16` gets `did you mean 16-mixed?`.
ALIASES = {"precision": {"fp16": "16-mixed", "float16": "16-mixed", "half": "16-mixed", "amp": "16-mixed",
                         "bfloat16": "bf16-mixed", "fp32": "32", "float32": "32", "float": "32", "full": "32",
                         "fp64": "64", "float64": "64", "double": "64"}}
# Checkpoint callbacks by class name (Lightning's and conf/callbacks' subclass), known without importing them.
CHECKPOINT_CALLBACKS = ("ModelCheckpoint", "RunCheckpoint", "BestCheckpoint", "StepCheckpoint")
HOOKS = ("none", "fp16", "bf16", "powersgd", "powersgd_fp16")
METRICS = ("val/acc", "val/acc_best", "val/loss", "train/acc", "train/loss")  # what a checkpoint callback can watch
# Loggers whose library is an extra of this project (pyproject.toml): their class, and the package that is the extra.
LOGGER_EXTRAS = {"MLFlowLogger": "mlflow", "MLflowRunLogger": "mlflow", "WandbLogger": "wandb", "WandbRunLogger": "wandb"}

RULES: dict[str, Rule] = {
    # conf/train.yaml
    "accelerator": one_of("auto", "cpu", "gpu", "cuda"),
    "devices": whole(1),
    "num_nodes": whole(1),
    "precision": PRECISION,
    "sync_batchnorm": BOOL,
    "channels_last": BOOL,
    "compile": BOOL,
    "cuda_graphs": BOOL | one_of("auto"),
    "steps_per_execution": one_of("auto") | whole(1),
    "max_epochs": whole(1),
    "seed": whole(0, SEED_MAX),
    "ckpt_path": NULL | TEXT,  # a file, `last` or `auto`: `check_the_files` says whether it is there, src/checkpoints.py
                               # whether it is a checkpoint
    "test_weights": one_of("best", "last"),
    "checkpoint.every_n_train_steps": whole(0),
    "tags": Rule(lambda v: isinstance(v, list) and all(isinstance(t, str) and t for t in v),
                 "a list of words, e.g. tags=[baseline,lr-sweep]"),
    "model_name": TEXT, "strategy_name": TEXT,
    # conf/optim: a partial of an optimizer class, which checks the rest of its arguments when built
    "optim._target_": TEXT,
    "optim._partial_": one_of(True, why="the Classifier calls the optimizer with its parameters"),
    "optim.lr": number(0, lo_open=True),
    "optim.momentum": number(0, 1, hi_open=True),  # 1 would keep every past gradient forever
    "optim.weight_decay": number(0),
    "optim.lr_scaling": one_of("none", "linear"),
    "optim.base_batch_size": whole(1),
    "optim.schedule": one_of("none", "cosine"),
    "optim.warmup": number(0, 1, hi_open=True),
    "optim.*": ANY,
    # conf/model: a LightningModule and its parts, which check their other arguments when built
    "model._target_": TEXT,
    "model._recursive_": one_of(False, why="the Classifier builds its network and loss itself, and records them"),
    "model.*._target_": TEXT,
    "model.loss.label_smoothing": number(0, 1),  # torch checks it only in the first forward pass
    "model.*": ANY,
    # conf/data
    "data.num_classes": whole(2),
    "data.in_channels": whole(1),
    "data._target_": TEXT,
    "data.root": TEXT,
    "data.batch_size": whole(1),
    "data.val_size": whole(0),  # its upper bound, the training images less one, is known once the data is read
    "data.download": BOOL,
    "data.shuffle": BOOL,
    "data.seed": whole(0, SEED_MAX),
    "data.random_crop": whole(0),
    "data.hflip": BOOL,
    "data.*": ANY,  # a data module of one's own checks its own arguments
    # conf/strategy: CommHookDDPStrategy's options; another strategy checks its own
    "strategy.hook": one_of(*HOOKS) | Rule(is_import_path, "the import path of a hook function (package.module.function)"),
    "strategy.powersgd_rank": whole(1),
    "strategy.start_powersgd_iter": Rule(whole(2).test, "a whole number of at least 2 (PowerSGD's error feedback needs "
                                                        "plain all-reduce steps first)"),
    "strategy.timeout_s": number(0, lo_open=True),
    "strategy.process_group_backend": NULL | one_of("gloo", "nccl", "mpi"),
    "strategy.bucket_cap_mb": NULL | number(0, lo_open=True),
    "strategy.gradient_as_bucket_view": BOOL,
    "strategy.static_graph": BOOL,
    "strategy.find_unused_parameters": BOOL,
    "strategy.*": ANY,
    # conf/trainer: lightning.Trainer's arguments
    "trainer.max_steps": one_of(-1, why="no limit") | whole(1),
    "trainer.max_time": NULL | DURATION,
    "trainer.min_epochs": NULL | whole(0),
    "trainer.min_steps": NULL | whole(0),
    "trainer.limit_train_batches": NULL | whole(1) | fraction(lo_open=True),
    "trainer.limit_val_batches": NULL | whole(0) | fraction(lo_open=False),
    "trainer.limit_test_batches": NULL | whole(1) | fraction(lo_open=True),
    "trainer.limit_predict_batches": NULL | whole(0) | fraction(lo_open=False),
    "trainer.overfit_batches": whole(0) | fraction(lo_open=False),
    "trainer.val_check_interval": NULL | whole(1) | fraction(lo_open=True) | DURATION,
    "trainer.check_val_every_n_epoch": NULL | whole(1),
    "trainer.num_sanity_val_steps": NULL | whole(-1),
    "trainer.log_every_n_steps": NULL | whole(1),
    "trainer.enable_checkpointing": NULL | BOOL,
    "trainer.enable_progress_bar": NULL | BOOL,
    "trainer.enable_model_summary": NULL | BOOL,
    "trainer.accumulate_grad_batches": whole(1),
    "trainer.gradient_clip_val": NULL | number(0),
    "trainer.gradient_clip_algorithm": NULL | one_of("norm", "value"),
    "trainer.deterministic": NULL | BOOL | one_of("warn"),
    "trainer.benchmark": NULL | BOOL,
    "trainer.inference_mode": BOOL,
    "trainer.profiler": NULL | one_of("simple", "advanced", "pytorch"),
    "trainer.detect_anomaly": BOOL,
    "trainer.reload_dataloaders_every_n_epochs": whole(0),
    "trainer.enable_autolog_hparams": BOOL,
    # These would turn off the logger and checkpoints that make a run folder a result.
    "trainer.fast_dev_run": one_of(False, why="for a short run use max_epochs=1 trainer.limit_train_batches=<n>"),
    "trainer.barebones": one_of(False, why="barebones turns off the logging and checkpoints of every run"),
    "trainer.model_registry": one_of(None, why="the model registry needs the litmodels package"),
    # conf/logger: one or more loggers, each a class and its arguments
    "logger.*": ANY,
    # conf/callbacks
    "callbacks.*._target_": TEXT,
    "callbacks.*_checkpoint.dirpath": TEXT,
    "callbacks.*_checkpoint.filename": TEXT,
    "callbacks.best_checkpoint.auto_insert_metric_name": BOOL,
    "callbacks.best_checkpoint.monitor": one_of(*METRICS),
    "callbacks.best_checkpoint.mode": one_of("min", "max"),
    "callbacks.best_checkpoint.save_last": BOOL | one_of("link"),
    "callbacks.time_to_accuracy.targets": Rule(
        lambda v: isinstance(v, list) and all(fraction(lo_open=True).test(t) for t in v),
        "a list of validation accuracies in (0, 1], e.g. [0.80,0.85,0.90] ([] for none)"),
    "callbacks.*.*": ANY,
}
# Trainer arguments that a top-level key owns.
OWNED_BY_TOP_LEVEL = {"accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks",
                      "max_epochs", "sync_batchnorm", "default_root_dir", "use_distributed_sampler", "plugins"}
# Keys that follow from other settings: typed, they would make a run's records disagree with it.
DERIVED = {"model_name": "model=<option>", "strategy_name": "strategy=<option>", "output_dir": "hydra.run.dir=<folder>",
           "precision_used": "precision and accelerator", "threads": "OMP_NUM_THREADS (or taskset's cores)",
           "run_name": "model, strategy, devices, num_nodes, precision and experiment"}
GROUPS = ("model", "optim", "data", "strategy", "trainer", "callbacks", "logger", "experiment", "debug")


def rule_for(key: str) -> Rule | None:
    return next((rule for pattern, rule in RULES.items() if fnmatch.fnmatchcase(key, pattern)), None)


def not_allowed(key: str, value: Any, allowed: str) -> UsageError:
    return UsageError(f"{key}={shown(value)} is not allowed; {allowed}")


def must_be(key: str, value: Any, rule: Rule) -> str:
    """After `did you mean ...?` where the value is another tool's name for an allowed one."""
    alias = ALIASES.get(key, {}).get(str(value).lower())
    return (f"did you mean {key}={alias}? " if alias else "") + f"{key} must be {rule.allowed}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` as `{"a.b": 1}`; lists and empty mappings are values."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def values(cfg: DictConfig, derived: bool = False) -> dict[str, Any]:
    """Flat and resolved; `DERIVED` keys only if asked for (their resolvers ask the hardware)."""
    try:
        return flatten({key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
                        for key in cfg if key != "hydra" and (derived or key not in DERIVED)})
    except OmegaConfBaseException as error:
        raise UsageError(f"{getattr(error, 'full_key', '') or 'config'}: {str(error).splitlines()[0]}") from None


# What keys that refer to a run's names see before its folder is named (`check(named=False)`): naming asks torch what
# `precision=auto` means here. No rule reads these keys; those that refer to them take any text.
UNNAMED = {"precision_used": "<precision_used>", "run_name": "<run_name>", "output_dir": "<output_dir>"}


def check(cfg: DictConfig, named: bool = True) -> None:
    """Every key's rule, then the rules across keys; `named=False`: before the run's folder is named."""
    if not named:
        cfg = copy.deepcopy(cfg)
        for key, stand_in in UNNAMED.items():
            cfg[key] = stand_in
    flat = values(cfg)
    for key, value in flat.items():
        rule = rule_for(key)
        if rule is None:
            raise UsageError(unknown_key(key, {k for k in flat if rule_for(k)}))
        if not rule.test(value):
            raise not_allowed(key, value, must_be(key, value, rule))
    check_across_keys(cfg, flat)
    check_the_files(flat)
    check_the_global_batch(flat)


def check_across_keys(cfg: DictConfig, flat: dict[str, Any]) -> None:
    from src.launch.ranks import external_rank

    if flat["num_nodes"] > 1 and external_rank() is None:
        raise not_allowed("num_nodes", flat["num_nodes"], "more than one node needs one process per node started by "
                          "torchrun or SLURM (see docs/cluster.md); on this machine alone use num_nodes=1")
    strategy = str(flat.get("strategy._target_", ""))
    if strategy == "builtins.str" and flat.get("strategy._args_") == ["auto"] and flat["devices"] > 1:
        raise UsageError(f"strategy=auto runs on one device, not devices={flat['devices']}; use strategy=ddp (or dp on GPUs)")
    if flat["sync_batchnorm"] and strategy.endswith(".DataParallelStrategy") and flat["devices"] > 1:
        raise not_allowed("sync_batchnorm", True, "with strategy=dp each GPU's replica normalises with its own shard; "
                                                  "use strategy=ddp")
    if flat["compile"] and strategy.endswith(".DataParallelStrategy"):
        raise not_allowed("compile", True, "nn.DataParallel copies the network each step and would drop the compiled "
                                           "code; use compile=false with strategy=dp, or strategy=ddp")
    hook, state = flat.get("strategy.hook"), OmegaConf.select(cfg, "strategy.hook_state")
    if state is not None and hook in HOOKS:
        raise UsageError(f"strategy.hook_state is not allowed with strategy.hook={hook}; it is for a hook named by its "
                         "import path (the built-in hooks make their own state)")
    if state is not None and not (isinstance(state, DictConfig) and state.get("_partial_") is True):
        raise not_allowed("strategy.hook_state", state, "it must be null or a config with _target_ and _partial_: true "
                          "(it is called with process_group=)")
    for key, value in flat.items():  # e.g. model.net.num_classes: the output layer must fit the labels
        name = key.rpartition(".")[2]
        data = flat.get(f"data.{name}", value)
        if key.startswith("model.") and name in ("num_classes", "in_channels") and data != value:
            raise not_allowed(key, value, f"it must equal data.{name}={shown(data)}, what the data holds")
    if "optim._target_" in flat and flat.get("optim._partial_") is not True:
        raise not_allowed("optim._partial_", flat.get("optim._partial_"), f"optim._partial_ must be {RULES['optim._partial_'].allowed}")
    min_epochs = flat.get("trainer.min_epochs")
    if min_epochs is not None and min_epochs > flat["max_epochs"]:
        raise not_allowed("trainer.min_epochs", min_epochs, f"it must be at most max_epochs={flat['max_epochs']}")
    for name, callback in cfg.callbacks.items():
        target = callback.get("_target_")
        if not target:
            raise UsageError(f"callbacks.{name} has no _target_; a new callback needs +callbacks.{name}._target_=<module.Class>")
        if not is_import_path(target):
            raise not_allowed(f"callbacks.{name}._target_", target, "it must name a class of an importable module")
    for name, logger in cfg.logger.items():
        package = LOGGER_EXTRAS.get(str(logger.get("_target_", "")).rpartition(".")[2])
        if package and importlib.util.find_spec(package) is None:
            raise missing_package(f"logger={name}", package)
    checkpoints = [name for name, c in cfg.callbacks.items()
                   if str(c.get("_target_", "")).rpartition(".")[2] in CHECKPOINT_CALLBACKS]
    if flat.get("trainer.enable_checkpointing") is False and checkpoints:
        raise not_allowed("trainer.enable_checkpointing", False, "it must be null or true while checkpoint callbacks are "
                          "set; remove them with " + " ".join(f"~callbacks.{name}" for name in checkpoints))


# Strategies that run one process per device, known without importing them (torch); another is checked at launch.
DDP_TARGETS = ("src.strategies.ddp.CommHookDDPStrategy", "lightning.pytorch.strategies.DDPStrategy",
               "lightning.pytorch.strategies.ddp.DDPStrategy")
FASHION_MNIST = "src.data.fashion_mnist.FashionMNISTDataModule"
CKPT_WORDS = ("last", "auto")  # as src.records.CKPT_WORDS: a run folder's newest checkpoint


def entry_name() -> str:
    """`train` or `eval`: the command whose config this is (Hydra's job name), `train` outside a command."""
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().job.name) if HydraConfig.initialized() else "train"


def check_the_files(flat: dict[str, Any]) -> None:
    """What the file system decides before torch loads: a checkpoint that is not there, and data that is not there
    and may not be downloaded (src/checkpoints.py and the data module meet the rest: a file that is not a
    checkpoint, a folder that holds part of the data)."""
    ckpt_path = flat.get("ckpt_path")
    if isinstance(ckpt_path, str) and ckpt_path not in CKPT_WORDS and not Path(ckpt_path).exists():
        given = "a .ckpt file or a run folder" if entry_name() == "eval" else "a .ckpt file, `last` or `auto`"
        raise UsageError(f"ckpt_path={ckpt_path}: no checkpoint at {ckpt_path}; give {given}")
    if flat.get("data._target_") == FASHION_MNIST and flat.get("data.download") is False:
        raw = Path(str(flat.get("data.root"))) / "FashionMNIST" / "raw"
        if not raw.is_dir():
            raise UsageError(f"data.root={flat.get('data.root')}: Fashion-MNIST not found in {raw} "
                             "(data.download=false); point data.root=<folder holding FashionMNIST/raw> at a copy, "
                             "or download it with data.download=true")


def per_process_batch(batch_size: int, world_size: int) -> int:
    """Each process's share of the global batch (also the data module's, in a rank that torchrun started)."""
    if batch_size < 1 or batch_size % world_size:
        raise UsageError(f"data.batch_size={batch_size} is the global batch and must be a positive multiple of the "
                         f"{world_size} processes (devices x num_nodes); try "
                         f"{max(world_size, batch_size // world_size * world_size)}")
    return batch_size // world_size


def check_the_global_batch(flat: dict[str, Any]) -> None:
    """The global batch splits evenly over a DDP run's processes, one per device (dp and `auto` run one)."""
    if flat.get("strategy._target_") in DDP_TARGETS and isinstance(batch := flat.get("data.batch_size"), int):
        per_process_batch(batch, int(flat["devices"]) * int(flat["num_nodes"]))


# Hydra's flags (`python -m src.train --help` lists them).
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run", "-r",
               "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}


def parse(args: list[str]) -> list[Override]:
    overrides = []
    for arg in args:
        if arg.startswith("-") or not ("=" in arg or arg.startswith("~")):
            continue
        try:
            overrides += OverridesParser.create().parse_overrides([arg])
        except OverrideParseException as error:
            raise grammar(arg, error) from None
    return overrides


def grammar(arg: str, error: Exception) -> UsageError:
    reason = next((line for line in str(error).splitlines() if line and not line.startswith(("Error parsing", "See "))), "")
    return UsageError(f"{arg} is not allowed; it must follow Hydra's override grammar ({reason}); quote odd values: key='...'")


# Why a group cannot be left empty, where a template's habit (`logger=null`, `callbacks=null`) would.
EMPTY_GROUP = {"logger": "every run logs to TensorBoard, whose figures are the run's record (logger=tensorboard is "
                         "TensorBoard alone); ",
               "callbacks": "its callbacks write the run's checkpoints and figures (leave one out with "
                            "~callbacks.<name>); "}


def check_args(args: list[str]) -> None:
    """Refuse a flag Hydra does not know (`--name value`), and keys a command line may not set."""
    for index, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and name not in HYDRA_FLAGS and not re.fullmatch(r"-\d.*", arg):
            value = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else "...")
            raise UsageError(f"{arg} is not an option; settings are typed key=value: {name.lstrip('-')}={value}")
    for override in parse(args):
        key = override.key_or_group
        if key in DERIVED:
            raise UsageError(f"{key} is derived from the other settings; set {DERIVED[key]} instead")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and not str(override.value() or "").strip():
            raise UsageError(f"{key}= is not allowed; it must name a folder (the run's files would land in this one)")
        if override.is_delete() and key in GROUPS and key != "experiment":
            raise UsageError(f"~{key} is not allowed; choose {key}=<option> instead")
        if key in GROUPS and not override.is_sweep_override() and override.value() in (None, []):
            why = "it is the default: leave it out, or " if key in ("experiment", "debug") else EMPTY_GROUP.get(key, "")
            raise UsageError(f"{override.input_line} is not allowed; {why}choose {key}=<option> ({options(key)})")
        new_callback = override.is_add() and re.fullmatch(r"callbacks\.\w+\._target_", key)
        if key.endswith("_target_") and not new_callback:
            raise UsageError(f"{key} is set by the config group; choose {key.split('.')[0]}=<option> (a file under conf/)")
        if key.startswith("trainer.") and key.removeprefix("trainer.") in OWNED_BY_TOP_LEVEL:
            raise UsageError(f"trainer.{key.removeprefix('trainer.')} is set by the top-level key; use "
                             f"{key.removeprefix('trainer.')}=... instead")


def unknown_key(key: str, known: set[str], choice: str = "") -> str:
    parent, _, name = key.rpartition(".")
    if parent == "trainer" and name not in known:
        owned = difflib.get_close_matches(name, sorted(OWNED_BY_TOP_LEVEL), n=1, cutoff=0.8)
        if owned:
            return f"trainer.{name} is not a lightning.Trainer argument; did you mean {owned[0]}? (a top-level key: {owned[0]}=...)"
    siblings = sorted(k.rpartition(".")[2] for k in known
                      if k.rpartition(".")[0] == parent and not k.endswith("_target_") and k.rpartition(".")[2] not in DERIVED)
    abbreviation = "".join(word[:1] for word in name.split("_"))  # learning_rate -> lr
    close = [s for s in siblings if s == abbreviation] or difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    suggestion = (f"{parent}.{close[0]}" if parent else close[0]) if close else \
        next(iter(difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)), "")
    message = f"{key} is not a known key" + (f" of {choice}" if choice else "") + (f"; did you mean {suggestion}?" if suggestion else "")
    where = f"{parent}'s keys" if parent else "top-level keys"
    return f"{message} ({where}: {', '.join(siblings)})" if siblings else message


def explain(error: Exception, args: list[str]) -> str | None:
    """Hydra's refusal of a command line as one line; None for any other error."""
    if isinstance(error, OverrideParseException):
        return str(grammar(next((a for a in args if "=" in a), ""), error))
    if isinstance(error, MissingConfigException) and getattr(error, "options", None) is not None:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        close = difflib.get_close_matches(option, sorted(error.options), n=1, cutoff=0.6)
        return (f"{group}={option} is not an option; " + (f"did you mean {group}={close[0]}? " if close else "")
                + f"choose one of: {', '.join(sorted(error.options))}")
    if not isinstance(error, HydraException):
        return None
    cause, text = error.__cause__, str(error)
    typed = re.search(r"Could not override '([^']+)'|An item is already at '([^']+)'", text)
    if isinstance(cause, ValidationError) and cause.full_key:
        key = str(cause.full_key)
        value = cause.value if cause.value is not None else next(
            (a.split("=", 1)[1] for a in args if a.lstrip("+~").split("=", 1)[0] == key), None)
        rule = rule_for(key)
        return str(not_allowed(key, value, must_be(key, value, rule) if rule else str(cause).splitlines()[0]))
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and typed and typed.group(1):
        key, parent = typed.group(1), getattr(cause, "parent_node", None)
        missing = str(getattr(cause, "full_key", None) or key)  # the first part of `key` the config lacks
        missing = missing if key == missing or key.startswith(missing + ".") else key
        prefix = missing.rpartition(".")[0]
        known = {f"{prefix}.{name}" if prefix else str(name) for name in (parent or {}) if name != "hydra"}
        choice = next((a for a in args if a.split("=", 1)[0] == key.split(".")[0] and key.split(".")[0] in GROUPS), "")
        said, name = unknown_key(missing, known, choice), missing.rpartition(".")[2]
        return said if missing == key else said.replace(
            f"{missing} is not a known key", f"{key} is not a known key: {prefix or 'the config'} has no {name}", 1)
    if typed and typed.group(2):
        return f"+{typed.group(2)}: {typed.group(2)} is already in the config; set it with {typed.group(2)}=..."
    return " ".join(line.strip() for line in text.splitlines() if line.strip())

"""The record of a run in TensorBoard's HParams tab: its settings beside its final metrics. TensorBoard ticks the first
five hparams marked "differing": a run marks the keys its command line typed, a sweep its swept keys, then IDENTITY."""

import hashlib
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from lightning import Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2
from torch.utils.tensorboard.writer import FileWriter

from src import records
from src.config import TrainConfig
from src.errors import UsageError
from src.launch.stops import held
from src.loggers import RunLogger
from src.runs import EVENT_FILES, event_files

# Metric columns in TensorBoard's order: tag, title, what it is. It shows a tag's last value: medians are logged once.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("test/acc", "test acc", "accuracy on the test images, at the end"),
    ("val/acc_best", "best val acc", "best validation accuracy over the epochs"),
    ("time/epoch_s_median", "epoch s (median)", "median wall seconds of a training epoch, validation excluded"),
    ("time/samples_per_s_median", "samples/s (median)", "median training images per second over all processes"),
    ("usage/tflops_per_s_median", "TFLOP/s a device (median)", "median model TFLOP/s per device (forward and backward)"),
    ("usage/mfu_median", "MFU (median)", "median share of the device's peak FLOP/s for the precision used (GPUs it knows)"),
    ("usage/peak_memory_mib", "peak memory MiB", "peak memory of rank 0's device (CUDA allocator) or process (CPU)"),
    ("val/acc", "last val acc", "validation accuracy after the last epoch"),
    ("train/acc", "train acc", "training accuracy of the last epoch"),
    ("train/loss", "train loss", "training loss of the last epoch"),
)
HPARAM_METRICS = tuple(tag for tag, _, _ in METRICS)


def time_to_metrics(targets: Iterable[str]) -> list[tuple[str, str, str]]:
    """The time-to-accuracy columns (`src.callbacks.timing.TimeToAccuracy`), by target name (`0.85`), after the
    epoch time: a value for every run, so that the parallel coordinates draw each one."""
    return [(f"{records.HPARAMS_TO_TARGET}{name}", f"s to val acc {name}", records.hparams_target(name))
            for name in sorted(set(targets), key=float)]


def all_metrics(targets: Iterable[str]) -> list[tuple[str, str, str]]:
    return [*METRICS[:3], *time_to_metrics(targets), *METRICS[3:]]

IDENTITY = ("model", "strategy", "devices", "precision_used")
SHOWN = 5  # hparams columns TensorBoard's HParams tab ticks by default
# Settings recorded under another name than their config key, or following from others, by the keys that change them.
SOURCES = {
    "world_size": ("devices", "num_nodes", "strategy"),
    "precision_used": ("precision", "accelerator"),
    "lr_used": ("optim.lr", "optim.lr_scaling", "optim.base_batch_size", "data.batch_size"),
    "batch_size": ("data.batch_size",), "optimizer": ("optim",), "lr": ("optim.lr",),
    "lr_scaling": ("optim.lr_scaling",),
}
# Config keys under these nodes are recorded as `<node>.<key>`, unless they name a class or are copied from another.
NESTED = ("model.net", "model.loss", "data", "strategy", "trainer", "checkpoint")
NOT_SETTINGS = {"data.root", "data.download", "data.batch_size", "data.num_classes", "data.in_channels", "data.seed",
                "model.net.num_classes", "model.net.in_channels"}


def _plain(value: Any) -> bool | int | float | str:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def run_hparams(cfg: DictConfig, trainer: Trainer, model: torch.nn.Module, lr_used: float) -> dict[str, Any]:
    """Every key a command line can set, flat; the plain settings under `NESTED` leave None (a library default) out."""
    optim = {k: v for k, v in OmegaConf.to_container(cfg.optim, resolve=True).items() if not k.startswith("_")}
    choices = records.select(hydra_record(Path(cfg.output_dir)), "runtime.choices.experiment")
    parameters = list(model.parameters())
    total = sum(p.numel() for p in parameters)
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    nested: dict[str, Any] = {}
    for node in NESTED:
        items: dict = OmegaConf.to_container(OmegaConf.select(cfg, node) or OmegaConf.create(), resolve=True)
        nested |= {f"{node}.{key}": _plain(value) for key, value in items.items()
                   if not str(key).startswith("_") and value is not None and not isinstance(value, dict)
                   and f"{node}.{key}" not in NOT_SETTINGS}
    return {
        "model": cfg.model_name, "strategy": cfg.strategy_name, "devices": cfg.devices, "precision": str(cfg.precision),
        "num_nodes": cfg.num_nodes, "world_size": trainer.world_size, "precision_used": str(trainer.precision),
        "accelerator": trainer.accelerator.__class__.__name__.replace("Accelerator", "").lower(),
        "experiment": str(choices or ""),
        "batch_size": cfg.data.batch_size, "optimizer": str(cfg.optim._target_).rpartition(".")[2],
        "lr": optim.pop("lr"), "lr_scaling": optim.pop("lr_scaling", "none"), "lr_used": lr_used,
        **{k: _plain(v) for k, v in optim.items()},
        "max_epochs": cfg.max_epochs, "seed": cfg.seed,
        "sync_batchnorm": cfg.sync_batchnorm, "channels_last": cfg.channels_last, "compile": cfg.compile,
        "threads": torch.get_num_threads(),  # rank 0's: at one seed the thread count changed the result, and speed
        # The file a run started from (`last` and `auto` resume the same run: a resumed run's row is the unbroken one's).
        "ckpt_path": "" if cfg.ckpt_path in (None, "last", "auto") else str(cfg.ckpt_path), "tags": ",".join(str(tag) for tag in cfg.get("tags") or []),
        "params/total": total, "params/trainable": trainable, "params/non_trainable": total - trainable,
        **nested,
    }


# Top-level keys recorded under their own name; other plain names are the optimizer's arguments.
_TOP_LEVEL = {field.name for field in fields(TrainConfig)} | {"experiment"}


def hydra_record(run_dir: Path) -> Any:
    """Read from the folder: DDP workers have no Hydra."""
    saved = run_dir / ".hydra" / "hydra.yaml"
    return records.select(records.load(saved), "hydra") if saved.is_file() else None


STAMP = re.compile(r"^(\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d|torchrun-[^_]+|slurm-[^_]+)_")


def override_keys(overrides: Iterable[object]) -> list[str]:
    return [re.sub(r"@.*$", "", str(override).split("=", 1)[0].lstrip("+~")) for override in overrides]


def changed_names(params: Iterable[str], typed: Iterable[str]) -> set[str]:
    """The settings that the keys typed changed; a config group chosen (`optim=adam`) marks its own column only."""
    typed, changed = set(typed), set()
    for name in params:
        argument = "." not in name and "/" not in name and name not in _TOP_LEVEL
        if typed & set(SOURCES.get(name, (f"optim.{name}",) if argument else (name,))):
            changed.add(name)
    return changed


def hparam_info(name: str, values: list[Any], differs: bool) -> api_pb2.HParamInfo:
    info = api_pb2.HParamInfo(name=name, differs=differs)
    if all(isinstance(v, bool) for v in values):
        info.type = api_pb2.DATA_TYPE_BOOL
        info.domain_discrete.extend(sorted(set(values)))
    elif all(isinstance(v, float) for v in values):
        info.type = api_pb2.DATA_TYPE_FLOAT64
        info.domain_interval.min_value, info.domain_interval.max_value = min(values), max(values)
    else:  # whole numbers too (`session_start`), in their order: 2 before 16
        info.type = api_pb2.DATA_TYPE_STRING
        info.domain_discrete.extend(sorted({str(v) for v in values}, key=in_order))
    return info


def in_order(text: str) -> tuple[bool, float, str]:
    """Numbers by value (`2` before `16`, as recorded or read back as text), then words."""
    try:
        return False, float(text), text
    except ValueError:
        return True, 0.0, text


def _summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    """By hand: neither torch's `hparams()` nor TensorBoard's `hparams_config_pb` can mark a column (`differs`)."""
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))])


def session_start(params: Mapping[str, Any], group_name: str) -> Summary:
    """Whole numbers as text: TensorBoard shows every number with four decimals, `devices` 4 as 4.0000."""
    return summary_v2.hparams_pb({name: value if isinstance(value, (bool, float)) else str(value)
                                  for name, value in params.items()}, trial_id=group_name)


def session_end() -> Summary:
    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
    return _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=info))


def experiment(runs: list[Mapping[str, Any]], marked: Iterable[str] = (), typed: Iterable[str] = (),
               targets: Iterable[str] = ()) -> Summary:
    names = list(dict.fromkeys(name for params in runs for name in params))
    differing = sweep_columns(runs, names, typed, set(marked))
    infos = [hparam_info(name, [params[name] for params in runs if name in params], name in differing) for name in names]
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=title, description=description)
               for tag, title, description in all_metrics(targets)]
    data = api_pb2.Experiment(hparam_infos=infos, metric_infos=metrics, time_created_secs=time.time())
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=data))


def sweep_columns(runs: list[Mapping[str, Any]], names: list[str], typed: Iterable[str], marked: set[str]) -> set[str]:
    """`marked`, then up to five columns in all: typed settings that differ, other differing settings, `IDENTITY` (not
    the names that sort first), and what follows from the model (keys one model lacks, the parameter counts)."""
    def values(name: str) -> set[str]:
        return {repr(params.get(name, ...)) for params in runs}

    by_choice = [name for name in names if all(name in params for params in runs) and not name.startswith("params/")
                 and len(values(name)) > 1]
    typed_names = changed_names(by_choice, typed)
    follows = [name for name in names if len(values(name)) > 1 and name not in by_choice]
    ranked = [*(n for n in by_choice if n in typed_names), *(n for n in by_choice if n not in typed_names),
              *(n for n in IDENTITY if n in names), *follows]
    unmarked = [name for name in dict.fromkeys(ranked) if name not in marked]
    return marked | set(unmarked[:max(0, SHOWN - len(marked))])


# Typed keys a single run's trial id leaves out: its folder's name shows them, or they change no result.
UNNAMED = {"model", "strategy", "devices", "num_nodes", "precision", "experiment", "data.root", "ckpt_path"}


def trial_id(run_dir: Path, overrides: list[str], params: Mapping[str, Any]) -> str:
    """The run folder's name without its date, led by what tells it apart (the table cuts a trial id short): what a
    sweep varied or a run's command line typed (`optim.lr=0.1 lenet_...`); then a digest of the run's settings."""
    name = STAMP.sub("", run_dir.name)
    saved = run_dir / "config.yaml"
    label = str(records.select(records.load(saved), "run_name") or "") if saved.is_file() else ""
    if label and name.startswith(label + "_"):
        name = f"{name[len(label) + 1:]} {label}"
    else:
        keys = override_keys(overrides)
        shown = [o for o, key in zip(overrides, keys) if key not in UNNAMED and not key.startswith("hydra.")]
        name = " ".join([*shown, name])
    settings = {k: v for k, v in params.items() if k not in ("tags", "ckpt_path")}
    digest = hashlib.sha1(repr(sorted(settings.items())).encode()).hexdigest()[:4]
    return f"{name} #{digest}"


@held()  # see RunLogger
def log_settings(loggers: list[Logger], params: dict[str, Any]) -> None:
    """The loggers beside TensorBoard as training starts, so that a run stopped early has its settings there too;
    TensorBoard's HParams record is written at the end (`log_hparams`), after the points it sits beside."""
    for logger in loggers:
        if not isinstance(logger, RunLogger):
            logger.log_hyperparams(params)


@held()  # see RunLogger
def log_hparams(loggers: list[Logger], params: dict[str, Any], run_dir: Path, step: int = 0,
                targets: Iterable[str] = ()) -> None:
    """At the last step, so no event goes back; a sweep job writes only its session (the sweep adds the experiment)."""
    for logger in loggers:
        if not isinstance(logger, RunLogger):
            logger.log_hyperparams(params)
        elif not has_hparams(run_dir):  # a resumed run keeps the record it began with
            sweep_job = str(records.select(hydra_record(run_dir), "mode")) == "MULTIRUN"
            saved = run_dir / ".hydra" / "overrides.yaml"
            overrides = [str(o) for o in records.load(saved) or []] if saved.is_file() and not sweep_job else []
            if not sweep_job:
                logger.add_summary(experiment([params], changed_names(params, override_keys(overrides)),
                                              targets=targets), step)
            logger.add_summary(session_start(params, trial_id(run_dir, overrides, params)), step)
            logger.add_summary(session_end(), step)
            logger.experiment.flush()


def write_experiment(runs: list[Mapping[str, Any]], log_dir: Path, typed: Iterable[str] = (),
                     targets: Iterable[str] = ()) -> None:
    writer = FileWriter(str(log_dir))
    writer.add_summary(experiment(runs, typed=typed, targets=targets))
    writer.close()


def has_hparams(run_dir: Path) -> bool:
    try:
        with event_files(run_dir) as copy:
            return any(value.metadata.plugin_data.plugin_name == "hparams" for events in copy.glob(EVENT_FILES)
                       for event in EventFileLoader(str(events)).Load() for value in event.summary.value)
    except UsageError as error:
        raise UsageError(f"{records.shown(run_dir)}: {error}") from None

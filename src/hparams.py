"""The record of a run in TensorBoard's HParams tab: its settings beside its final metrics.

TensorBoard's HParams tab reads one experiment summary per log folder (the hparams and metric
columns, in order) and one session summary per run (its values). It shows the first five hparams
after sorting them "differs first, then by name", and the first five metrics in the order given.
So that it opens on the settings that tell runs apart:

- a single run writes its experiment summary with the settings typed on its command line
  marked as differing (`changed_names`);
- a sweep job writes only its session; when the sweep ends, `write_experiment` declares the
  union of the jobs' settings in the sweep's `report/` run, marking five: the swept keys first,
  what follows from the model (keys one model lacks, parameter counts) last (`sweep_columns`).

Where fewer than five are marked, model, strategy, devices and precision used fill the default
columns (`with_identity`) instead of the settings that come first by name (accelerator, ...).
"""

import hashlib
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning import Trainer
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from torch.utils.tensorboard.writer import FileWriter

from src import records
from src.launch.stops import held

# Metric columns, in the order TensorBoard shows them (the first five by default): the scalar tag,
# its column title and what it is. TensorBoard shows a tag's last value: the medians are logged once.
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

# What a run is: the columns a run with nothing typed on its command line opens on.
IDENTITY = ("model", "strategy", "devices", "precision_used")
SHOWN = 5  # hparams columns TensorBoard's HParams tab ticks by default
# Settings whose value follows from others: marked as changed when any of these config keys is.
DERIVED = {
    "world_size": ("devices", "num_nodes", "strategy"),
    "precision_used": ("precision", "accelerator"),
    "lr_used": ("optim.lr", "optim.lr_scaling", "optim.base_batch_size", "data.batch_size"),
}
# Settings recorded under a short name, with the config key they come from.
SOURCES = {"batch_size": "data.batch_size", "optimizer": "optim", "lr": "optim.lr", "lr_scaling": "optim.lr_scaling"}
# Config keys under these nodes are recorded as `<node>.<key>`, unless they name a class or are
# copied from another key (num_classes, in_channels, data.seed).
NESTED = ("model.net", "model.loss", "data", "strategy", "trainer", "checkpoint")
NOT_SETTINGS = {"data.root", "data.download", "data.batch_size", "data.num_classes", "data.in_channels", "data.seed",
                "model.net.num_classes", "model.net.in_channels"}


def _plain(value: Any) -> bool | int | float | str:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def _nested(cfg: DictConfig, node: str) -> dict[str, Any]:
    """`node.key: value` of every plain setting under `node`; None (a library default) is left out."""
    values = OmegaConf.select(cfg, node)
    if values is None:
        return {}
    items = OmegaConf.to_container(values, resolve=True)
    assert isinstance(items, dict)
    return {f"{node}.{key}": _plain(value) for key, value in items.items()
            if not str(key).startswith("_") and value is not None and not isinstance(value, dict)
            and f"{node}.{key}" not in NOT_SETTINGS}


def parameter_counts(trainer: Trainer) -> dict[str, int]:
    """Total, trainable and non-trainable parameters of the model, as the Lightning + Hydra template logs them."""
    model = trainer.lightning_module
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params/total": total, "params/trainable": trainable, "params/non_trainable": total - trainable}


def run_hparams(cfg: DictConfig, trainer: Trainer, lr_used: float) -> dict[str, Any]:
    """The flat settings shown per run in TensorBoard's HParams tab: every key a command line can set.

    Model, strategy, devices and precision come first; the optimizer's own arguments follow its
    class name, whichever it is; keys of the config's nested nodes are named by their path.
    """
    optim = {k: v for k, v in OmegaConf.to_container(cfg.optim, resolve=True).items() if not k.startswith("_")}
    choices = records.select(hydra_record(Path(cfg.output_dir)), "runtime.choices.experiment")
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
        # The file a run started from (`last` and `auto` resume the same run: a resumed run's row is the unbroken one's).
        "ckpt_path": "" if cfg.ckpt_path in (None, "last", "auto") else str(cfg.ckpt_path), "tags": ",".join(str(tag) for tag in cfg.get("tags") or []),
        **parameter_counts(trainer),
        **{k: v for node in NESTED for k, v in _nested(cfg, node).items()},
    }


# Top-level keys recorded under their own name; other plain names are the optimizer's arguments.
_TOP_LEVEL = {"devices", "precision", "num_nodes", "accelerator", "max_epochs", "seed", "sync_batchnorm",
              "channels_last", "compile", "ckpt_path", "tags", "cuda_graphs", "steps_per_execution"}


def _sources(name: str) -> tuple[str, ...]:
    if name in DERIVED:
        return DERIVED[name]
    if name in SOURCES:
        return (SOURCES[name],)
    if "." not in name and "/" not in name and name not in ("model", "strategy", "experiment") and name not in _TOP_LEVEL:
        return (f"optim.{name}",)  # the optimizer's own arguments
    return (name,)


def hydra_record(run_dir: Path) -> Any:
    """Hydra's own settings of the run (`.hydra/hydra.yaml`: its mode, the config group options chosen) as plain data;
    read from the folder, since DDP workers have no Hydra of their own."""
    saved = run_dir / ".hydra" / "hydra.yaml"
    return records.select(records.load(saved), "hydra") if saved.is_file() else None


STAMP = re.compile(r"^(\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d|torchrun-[^_]+|slurm-[^_]+)_")


def typed_keys(run_dir: Path) -> list[str]:
    """The keys and config groups set on the run's command line (Hydra's `.hydra/overrides.yaml`)."""
    saved = run_dir / ".hydra" / "overrides.yaml"
    return override_keys(records.load(saved) or []) if saved.is_file() else []


def override_keys(overrides: Iterable[object]) -> list[str]:
    """The key or config group of each override (`optim.lr=0.1`, `+callbacks.x._target_=...`, `model=resnet18`)."""
    return [re.sub(r"@.*$", "", str(override).split("=", 1)[0].lstrip("+~")) for override in overrides]


def changed_names(params: Iterable[str], typed: Iterable[str]) -> set[str]:
    """The settings that the keys typed on the command line changed, or that follow from them."""
    typed = set(typed)  # a config group chosen (`optim=adam`) marks its own column, not every key it brings
    return {name for name in params if typed & set(_sources(name))}


def hparam_info(name: str, values: list[Any], differs: bool) -> api_pb2.HParamInfo:
    """A column: its type from the values, their domain, and whether it differs between runs."""
    info = api_pb2.HParamInfo(name=name, differs=differs)
    if all(isinstance(v, bool) for v in values):
        info.type = api_pb2.DATA_TYPE_BOOL
        info.domain_discrete.extend(sorted(set(values)))
    elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        info.type = api_pb2.DATA_TYPE_FLOAT64
        info.domain_interval.min_value, info.domain_interval.max_value = min(values), max(values)
    else:
        info.type = api_pb2.DATA_TYPE_STRING
        info.domain_discrete.extend(sorted({str(v) for v in values}))
    return info


def _summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    """An HParams record as TensorBoard reads it: summary metadata only, no value. Written here because
    torch's `hparams()` can neither mark a column as differing nor name a trial, and TensorBoard's
    own `hparams.summary` needs TensorFlow."""
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))])


def session_start(params: Mapping[str, Any], group_name: str) -> Summary:
    info = plugin_data_pb2.SessionStartInfo(group_name=group_name, start_time_secs=time.time())
    for name, value in params.items():
        if isinstance(value, bool):
            info.hparams[name].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[name].number_value = value
        else:
            info.hparams[name].string_value = str(value)
    return _summary(metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=info))


def session_end() -> Summary:
    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
    return _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=info))


def metric_infos() -> list[api_pb2.MetricInfo]:
    return [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=title, description=description)
            for tag, title, description in METRICS]


def experiment(runs: list[Mapping[str, Any]], differing: set[str] | None = None, typed: Iterable[str] = ()) -> Summary:
    """The experiment summary of `runs`' settings: the union of their names, in the order first seen.

    `differing`: the names to mark; by default those that `sweep_columns` picks, the keys `typed` for the sweep first.
    """
    names: dict[str, None] = {}
    for params in runs:
        names.update(dict.fromkeys(params))
    differing = with_identity(differing, names) if differing is not None else sweep_columns(runs, list(names), typed)
    infos = [hparam_info(name, [params[name] for params in runs if name in params], name in differing) for name in names]
    data = api_pb2.Experiment(hparam_infos=infos, metric_infos=metric_infos(), time_created_secs=time.time())
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=data))


def sweep_columns(runs: list[Mapping[str, Any]], names: list[str], typed: Iterable[str]) -> set[str]:
    """The columns a sweep's HParams tab opens on. TensorBoard ticks the first five marked as differing, by name,
    so no more than five are marked, in this order: the settings the sweep's command line typed whose values
    differ, other settings chosen differently, what the runs are (model, strategy, devices, precision used),
    and last what follows from the model: keys one model has and another lacks (LeNet's `model.net.pool`
    beside ResNet-18), and the parameter counts."""
    def values(name: str) -> set[str]:
        return {repr(params.get(name, ...)) for params in runs}

    by_choice = [name for name in names if all(name in params for params in runs) and not name.startswith("params/")
                 and len(values(name)) > 1]
    typed_names = changed_names(by_choice, typed)
    follows = [name for name in names if len(values(name)) > 1 and name not in by_choice]
    ranked = [*(n for n in by_choice if n in typed_names), *(n for n in by_choice if n not in typed_names),
              *(n for n in IDENTITY if n in names), *follows]
    return set(list(dict.fromkeys(ranked))[:SHOWN])


def with_identity(marked: set[str], names: Iterable[str]) -> set[str]:
    """`marked`, and while they are fewer than the five columns TensorBoard shows, what the runs are
    (model, strategy, devices, precision used) rather than the settings that come first by name."""
    marked = set(marked)
    for name in IDENTITY:
        if len(marked) >= SHOWN:
            break
        if name in names:
            marked.add(name)
    return marked


def trial_name(run_dir: Path) -> str:
    """The run folder's name without its date, what a sweep varied first (`seed=1 lenet_auto_1dev_32-true`):
    the HParams table cuts a trial id to its first characters."""
    name = STAMP.sub("", run_dir.name)
    saved = run_dir / "config.yaml"
    label = str(records.select(records.load(saved), "run_name") or "") if saved.is_file() else ""
    if label and name.startswith(label + "_"):
        return f"{name[len(label) + 1:]} {label}"
    return name


def trial_id(name: str, params: Mapping[str, Any]) -> str:
    """The run's name in HParams' trial column: short, with a digest of its settings, so that two
    runs of the same name but other settings are not taken for one."""
    settings = {k: v for k, v in params.items() if k not in ("tags", "ckpt_path")}
    digest = hashlib.sha1(repr(sorted(settings.items())).encode()).hexdigest()[:4]
    return f"{name} #{digest}"


@held()  # see RunLogger
def log_hparams(loggers: list[Logger], params: dict[str, Any], run_dir: Path, step: int = 0) -> None:
    """The run's settings in each logger: TensorBoard's HParams summaries, pointing at scalars already logged (so no
    metric is written twice), and another logger's own record of hyperparameters.

    A sweep job writes only its session (the sweep declares the columns when it ends, `write_experiment`); a single
    run also its experiment, with the settings typed on its command line marked as differing. The summaries go into
    the logger's own event file, after the run's points, at the run's last step, so that no event goes back.
    """
    for logger in loggers:
        if not isinstance(logger, TensorBoardLogger):
            logger.log_hyperparams(params)
            continue
        if has_hparams(run_dir):  # a resumed run keeps the record it began with
            continue
        sweep_job = str(records.select(hydra_record(run_dir), "mode")) == "MULTIRUN"
        writer = logger.experiment._get_file_writer()  # SummaryWriter has no public call for a Summary of one's own
        if not sweep_job:
            writer.add_summary(experiment([params], changed_names(params, typed_keys(run_dir))), step)
        writer.add_summary(session_start(params, trial_id(trial_name(run_dir), params)), step)
        writer.add_summary(session_end(), step)
        writer.flush()


def write_experiment(runs: list[Mapping[str, Any]], log_dir: Path, typed: Iterable[str] = ()) -> None:
    """The sweep's experiment summary, in its own run folder: the columns of every job's settings, those it
    opens on marked (`sweep_columns`; `typed`: the config keys and groups the sweep's command line set)."""
    writer = FileWriter(str(log_dir))
    writer.add_summary(experiment(runs, typed=typed))
    writer.close()


def has_hparams(run_dir: Path) -> bool:
    """Whether an earlier part of this run (before a resume) already wrote its HParams record: a run keeps its first."""
    for events in run_dir.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            if any(value.metadata.plugin_data.plugin_name == "hparams" for value in event.summary.value):
                return True
    return False

"""The record of a run in TensorBoard's HParams tab: its settings beside its final metrics."""

from pathlib import Path
from typing import Any

from lightning import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch.utils.tensorboard.summary import hparams
from torch.utils.tensorboard.writer import FileWriter

# Scalars compared across runs in TensorBoard's HParams tab.
HPARAM_METRICS = ("test/acc", "val/acc", "val/acc_best", "train/acc", "time/epoch_s", "time/samples_per_s")


def run_hparams(cfg: DictConfig, trainer: Trainer, lr_used: float) -> dict[str, Any]:
    """The flat settings shown per run in TensorBoard's HParams tab.

    TensorBoard shows the first few of them before any is ticked: model, strategy, devices and
    precision come first. The optimizer's own arguments follow its class name, whichever it is.
    """
    optim = {k: v for k, v in OmegaConf.to_container(cfg.optim, resolve=True).items() if not k.startswith("_")}
    return {
        "model": cfg.model_name, "strategy": cfg.strategy_name, "devices": cfg.devices, "precision": str(cfg.precision),
        "num_nodes": cfg.num_nodes, "world_size": trainer.world_size, "precision_used": str(trainer.precision),
        "accelerator": trainer.accelerator.__class__.__name__.replace("Accelerator", "").lower(),
        "batch_size": cfg.data.batch_size, "optimizer": str(cfg.optim._target_).rpartition(".")[2],
        "lr": optim.pop("lr"), "lr_scaling": optim.pop("lr_scaling", "none"), "lr_used": lr_used,
        **{k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in optim.items()},
        "max_epochs": cfg.max_epochs, "seed": cfg.seed,
        "sync_batchnorm": cfg.sync_batchnorm, "channels_last": cfg.channels_last, "compile": cfg.compile,
        "ckpt_path": str(cfg.ckpt_path or ""),
    }


def log_hparams(logger: TensorBoardLogger, params: dict[str, Any], metrics: dict[str, float]) -> None:
    """Write the HParams summary pointing at scalars already logged, so no metric is written twice.

    SummaryWriter.add_hparams would log the metrics again, in a folder of their own; an event file of
    its own in the run folder (the logger's was closed when the test ended) is what TensorBoard reads.
    """
    writer = FileWriter(logger.experiment.get_logdir())
    for summary in hparams(params, {name: metrics[name] for name in HPARAM_METRICS if name in metrics}):
        writer.add_summary(summary)
    writer.close()


def has_hparams(run_dir: Path) -> bool:
    """Whether an earlier part of this run (before a resume) already wrote the HParams summary."""
    for events in run_dir.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            if any(value.metadata.plugin_data.plugin_name == "hparams" for value in event.summary.value):
                return True
    return False

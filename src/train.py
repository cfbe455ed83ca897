"""`python -m src.train`: compose the config, build the pieces, fit, test, log.

    python -m src.train                                   # LeNet, one device
    python -m src.train model=resnet18 strategy=ddp devices=4 precision=16-mixed
    python -m src.train -m strategy=ddp,ddp_fp16 devices=1,2,4
"""

import logging
import shutil
import statistics
import warnings
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch.utils.tensorboard.summary import hparams

from src import checks, stopping
from src.checkpoints import AtomicCheckpointIO, resolve_ckpt_path, saved_step
from src.data.fashion_mnist import per_process_batch
from src.ddp_jobs import child_argv, is_launching_process, job_scope
from src.errors import TrainingDiverged, UsageError
from src.models.module import Classifier
from src.naming import register_resolvers
from src.optim import optimizer_args
from src.strategies.sync_batchnorm import SyncBatchNormPlugin

log = logging.getLogger(__name__)
register_resolvers()
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")  # torch 2.14 vs Lightning 2.6

# Scalars compared across runs in TensorBoard's HParams tab.
HPARAM_METRICS = ("test/acc", "val/acc", "val/acc_best", "train/acc", "time/epoch_s", "time/samples_per_s")


def processes_per_node(strategy: str | Strategy, devices: int) -> int:
    """DDP runs one process per device; `auto` and dp run one process."""
    if isinstance(strategy, DDPStrategy):
        return devices
    if strategy == "auto" and devices > 1:
        raise UsageError(f"strategy=auto runs on one device, not devices={devices}; use strategy=ddp (or dp on GPUs)")
    return 1


def scalar_metrics(trainer: Trainer) -> dict[str, float]:
    return {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}


def run_hparams(cfg: DictConfig, trainer: Trainer, module: Classifier) -> dict[str, Any]:
    """The flat settings shown per run in TensorBoard's HParams tab."""
    return {
        "model": cfg.model_name, "strategy": cfg.strategy_name, "devices": cfg.devices, "num_nodes": cfg.num_nodes,
        "world_size": trainer.world_size, "precision": str(cfg.precision), "precision_used": str(trainer.precision),
        "accelerator": trainer.accelerator.__class__.__name__.replace("Accelerator", "").lower(),
        "batch_size": cfg.data.batch_size, "lr": cfg.optim.lr, "lr_scaling": cfg.optim.lr_scaling,
        "lr_used": module.hparams.lr, "momentum": cfg.optim.momentum,
        "weight_decay": cfg.optim.weight_decay, "max_epochs": cfg.max_epochs, "seed": cfg.seed,
        "sync_batchnorm": cfg.sync_batchnorm,
    }


def log_hparams(logger: TensorBoardLogger, params: dict[str, Any], metrics: dict[str, float]) -> None:
    """Write the HParams summary pointing at scalars already logged, so no metric is written twice."""
    writer = logger.experiment._get_file_writer()
    for summary in hparams(params, {name: metrics[name] for name in HPARAM_METRICS if name in metrics}):
        writer.add_summary(summary)
    writer.flush()


def has_hparams(run_dir: Path) -> bool:
    """Whether an earlier part of this run (before a resume) already wrote the HParams summary."""
    for events in run_dir.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            if any(value.metadata.plugin_data.plugin_name == "hparams" for value in event.summary.value):
                return True
    return False


def resumed_step(ckpt_path: Path | None, run_dir: Path) -> int | None:
    """Resuming in its own folder, a run hides the TensorBoard points its earlier part logged after
    the checkpoint (TensorBoard's purge step), so no step appears twice. Lightning logs optimizer
    step n at TensorBoard step n - 1, so the first point after a checkpoint at step s is at s."""
    if ckpt_path is None or ckpt_path.parent.parent.resolve() != run_dir.resolve():
        return None
    step = saved_step(ckpt_path)
    return step if step >= 0 else None


def route_lightning_logs() -> None:
    """Send Lightning's messages through the root logger (Hydra's console and `train.log`) instead of
    the console handlers Lightning installs for itself when imported."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: "litlogger" not in record.getMessage())


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test one configuration; returns the final metrics."""
    route_lightning_logs()
    checks.check_config(cfg)
    output_dir = Path(cfg.output_dir)
    accelerator = checks.resolve_accelerator(cfg.accelerator)
    devices, num_nodes = checks.positive_int(cfg, "devices"), checks.positive_int(cfg, "num_nodes")
    checks.positive_int(cfg, "max_epochs")
    checks.check_devices(accelerator, devices)
    precision = checks.resolve_precision(cfg.precision, accelerator)
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    checks.check_trainer_args(trainer_args)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir)
    strategy = instantiate(cfg.strategy, _convert_="all")
    world_size = processes_per_node(strategy, devices) * num_nodes
    per_process_batch(cfg.data.batch_size, world_size)

    seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    if is_launching_process():  # fail on missing or corrupt data before any process is started
        datamodule.prepare_data()
        datamodule.setup()
    module = Classifier(instantiate(cfg.model.net), **optimizer_args(cfg.optim, cfg.data.batch_size))
    checks.check_checkpoint(ckpt_path, cfg.ckpt_path, module, cfg.model_name)
    if rank_zero_only.rank == 0:  # every interpolation resolved: what this run really used
        OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
    callbacks: list[Callback] = [instantiate(c) for c in cfg.callbacks.values()]
    logger = TensorBoardLogger(save_dir=str(output_dir), name="", version="", default_hp_metric=False,
                               purge_step=resumed_step(ckpt_path, output_dir))
    plugins: list[Any] = [AtomicCheckpointIO()]
    if cfg.sync_batchnorm:
        plugins.append(SyncBatchNormPlugin(cuda=accelerator == "gpu"))
    trainer = Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision,
        max_epochs=cfg.max_epochs, logger=logger, callbacks=callbacks, plugins=plugins,
        default_root_dir=str(output_dir), use_distributed_sampler=False, **trainer_args,
    )
    stopping.attach(trainer)
    with job_scope(), checks.trainer_input_errors():
        trainer.fit(module, datamodule=datamodule, ckpt_path=None if ckpt_path is None else str(ckpt_path))
        metrics = scalar_metrics(trainer)
        trainer.test(module, datamodule=datamodule, verbose=False)
        metrics.update(scalar_metrics(trainer))
    epoch_times = next((c.epoch_times for c in callbacks if hasattr(c, "epoch_times")), [])
    if epoch_times:
        metrics["time/epoch_s"] = statistics.median(epoch_times)
    if trainer.is_global_zero and not has_hparams(output_dir):  # a resumed run keeps its folder's one record
        log_hparams(logger, run_hparams(cfg, trainer, module), metrics)
        log.info(
            f"test/acc={metrics.get('test/acc', float('nan')):.4f} val/acc_best={metrics.get('val/acc_best', float('nan')):.4f} "
            f"median epoch {metrics.get('time/epoch_s', float('nan')):.2f} s ({precision}, {world_size} process(es)) -> {output_dir}",
        )
    return metrics


def holds_only_settings(output_dir: Path) -> bool:
    """True for a folder with nothing but Hydra's settings and logs: no checkpoint, no TensorBoard run."""
    settings = (".hydra", "config.yaml")
    return output_dir.is_dir() and all(p.name in settings or p.suffix == ".log" for p in output_dir.iterdir())


def report_failure(error: UsageError | TrainingDiverged, output_dir: Path, new_folder: bool) -> int:
    """One `error:` line from the first process, and no folder that could pass for a result; the exit status.

    Only a folder this run started is removed: a resumed run's folder keeps its checkpoints.
    """
    if rank_zero_only.rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
        if new_folder:
            shutil.rmtree(output_dir, ignore_errors=True)
    return 2 if isinstance(error, UsageError) else 1


# Sweep jobs stopped by bad input or a diverged loss, with their exit status: the sweep goes on,
# and exits non-zero at its end.
failed_jobs: dict[str, int] = {}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    new_folder = holds_only_settings(Path(cfg.output_dir))
    try:
        with stopping.stop_cleanly():
            metrics = train(cfg)
    except (UsageError, TrainingDiverged) as error:
        status = report_failure(error, Path(cfg.output_dir), new_folder)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(status)
        failed_jobs[" ".join(HydraConfig.get().overrides.task)] = status
        return None
    return metrics.get("test/acc")


def main() -> None:
    sys.argv = child_argv(sys.argv)
    stopping.install()
    try:
        checks.check_overrides(sys.argv[1:])
        checks.check_run_dir(sys.argv[1:])
    except UsageError as error:
        if rank_zero_only.rank == 0:  # under torchrun every process checks the same command line
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    with stopping.stop_cleanly():  # a signal outside a job: while Hydra starts, between sweep jobs
        hydra_main()
    if failed_jobs:
        print(f"error: {len(failed_jobs)} sweep job(s) failed: {' | '.join(failed_jobs)}", file=sys.stderr, flush=True)
        sys.exit(max(failed_jobs.values()))


if __name__ == "__main__":
    main()

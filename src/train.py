"""`python -m src.train`: compose the config, build the pieces, fit, test, log.

    python -m src.train                                   # LeNet, one device
    python -m src.train model=resnet18 strategy=ddp devices=4 precision=16-mixed
    python -m src.train -m strategy=ddp,ddp_fp16 devices=1,2,4
"""

import logging
import statistics
import warnings
from pathlib import Path
from typing import Any

import hydra
from hydra.utils import instantiate
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, Strategy
from omegaconf import DictConfig, OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch.utils.tensorboard.summary import hparams

from src import checks
from src.callbacks.model_summary import without_zero_flops
from src.launch import cli, workers
from src.checkpoints import AtomicCheckpointIO, checkpoint_to_evaluate, read_checkpoint, resolve_ckpt_path, saved_step
from src.data.fashion_mnist import per_process_batch
from src.launch.console import processes
from src.launch.ddp_jobs import is_launching_process, is_rank_zero
from src.errors import UsageError
from src.fast_path import cudnn_benchmark, resolve_fast_steps, speed_up
from src.launch.naming import register_resolvers
from src.optim import build_optimizer, check_optimizer
from src.strategies.sync_batchnorm import SyncBatchNormPlugin

log = logging.getLogger(__name__)
register_resolvers()
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")  # torch 2.14 vs Lightning 2.6
# The comm/ epoch means are rank 0's own figures by design (src/callbacks/comm.py), not a sum over ranks.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('comm/")
# Every scalar has per-epoch points (comm/ its `_epoch` means), so a run of fewer steps than
# trainer.log_every_n_steps loses no curve: Lightning's advice to lower the interval does not apply.
warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging interval")

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


route_lightning_logs()  # once: Lightning installed its handlers when it was imported, above


def run(cfg: DictConfig, fit: bool = True) -> dict[str, float]:
    """Fit (unless `fit` is false) and test one configuration; returns the final metrics."""
    checks.check_config(cfg)
    output_dir = Path(cfg.output_dir)
    accelerator = checks.resolve_accelerator(cfg.accelerator)
    devices, num_nodes = cfg.devices, cfg.num_nodes  # in range: check_config
    checks.check_devices(accelerator, devices)
    precision = checks.resolve_precision(cfg.precision, accelerator)
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_args["benchmark"] = cudnn_benchmark(trainer_args["benchmark"], trainer_args["deterministic"])
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir) if fit else checkpoint_to_evaluate(cfg.ckpt_path)
    strategy = checks.instantiate_strategy(cfg.strategy)
    world_size = processes_per_node(strategy, devices) * num_nodes
    step_batch = per_process_batch(cfg.data.batch_size, world_size)

    seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    if is_launching_process():  # fail on missing or corrupt data before any process is started
        datamodule.prepare_data()
        datamodule.setup()
    optimizer = build_optimizer(cfg.optim, cfg.data.batch_size)
    module = checks.instantiate_model(cfg.model, optimizer)
    # The Classifier's network; a LightningModule of one's own (docs/extending.md) may have no `net`.
    speed_up(getattr(module, "net", module), channels_last=cfg.channels_last, compile=cfg.compile)
    batch_counts = {f"trainer.{key}": value for key in ("limit_train_batches", "val_check_interval")
                    if type(value := trainer_args.get(key)) is int}
    fast_steps = resolve_fast_steps(
        cfg.cuda_graphs, cfg.steps_per_execution, accelerator=accelerator, world_size=world_size, strategy=strategy,
        compile=cfg.compile, trainer_args=trainer_args,
        step_counts={"checkpoint.every_n_train_steps": cfg.checkpoint.every_n_train_steps,
                     "trainer.max_steps": trainer_args["max_steps"], **batch_counts},
        supported=hasattr(module, "use_fast_steps") and hasattr(datamodule, "steps_per_execution"),
    )
    for key in batch_counts:  # counted in optimizer steps: Lightning counts batches of steps_per_execution steps
        trainer_args[key.removeprefix("trainer.")] //= fast_steps.steps_per_execution
    if hasattr(module, "use_fast_steps"):
        module.use_fast_steps(fast_steps, step_batch)
    if fast_steps.manual:
        datamodule.steps_per_execution = fast_steps.steps_per_execution
    check_optimizer(optimizer, module.parameters())
    checks.check_checkpoint(ckpt_path, cfg.ckpt_path, module, cfg.model_name)
    if is_rank_zero():  # every interpolation resolved: what this run really used
        OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
    callbacks: list[Callback] = [instantiate(c) for c in cfg.callbacks.values()]
    purge_step = resumed_step(ckpt_path, output_dir) if fit else None  # scoring a checkpoint hides nothing
    logger = instantiate(cfg.logger, purge_step=purge_step)
    plugins: list[Any] = [AtomicCheckpointIO()]
    if cfg.sync_batchnorm:
        plugins.append(SyncBatchNormPlugin(cuda=accelerator == "gpu"))
    trainer = Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision,
        max_epochs=cfg.max_epochs, logger=logger, callbacks=callbacks, plugins=plugins,
        default_root_dir=str(output_dir), use_distributed_sampler=False, **trainer_args,
    )
    trainer.callbacks = without_zero_flops(trainer.callbacks)
    if workers.needed(trainer):  # local DDP: one worker process per device, each running this function
        return workers.start(run, cfg, fit)
    workers.stop_on_signals(trainer)
    with checks.trainer_input_errors():
        metrics: dict[str, float] = {}
        if fit:
            trainer.fit(module, datamodule=datamodule, ckpt_path=None if ckpt_path is None else str(ckpt_path),
                        weights_only=True)
            metrics = scalar_metrics(trainer)
        else:  # the weights alone: the training run's callbacks and loops have nothing to do here
            module.load_state_dict(read_checkpoint(ckpt_path)["state_dict"])
        trainer.test(module, datamodule=datamodule, verbose=False, weights_only=True)  # SLURM: Lightning may load hpc_ckpt_*
        metrics.update(scalar_metrics(trainer))
    epoch_times = next((c.epoch_times for c in callbacks if hasattr(c, "epoch_times")), [])
    if epoch_times:
        metrics["time/epoch_s"] = statistics.median(epoch_times)
    if trainer.is_global_zero:
        if purge_step is None or not has_hparams(output_dir):  # a run resumed in its folder keeps the one record
            params = run_hparams(cfg, trainer, optimizer.keywords["lr"])
            params.update(cuda_graphs=fast_steps.cuda_graphs,
                          steps_per_execution=fast_steps.steps_per_execution)
            log_hparams(logger, params, metrics)
        log.info(result_line(metrics, fit, f"precision {precision}, {processes(world_size)}", ckpt_path, output_dir))
    return metrics


def train(cfg: DictConfig) -> dict[str, float]:
    return run(cfg, fit=True)


def result_line(metrics: dict[str, float], fit: bool, how: str, ckpt_path: Path | None, output_dir: Path) -> str:
    """The one line a run ends with: what a person greps for."""
    def shown(name: str) -> str:
        return f"{name}={metrics.get(name, float('nan')):.4f}"

    if fit:
        return (f"{shown('test/acc')} {shown('val/acc_best')} median epoch {metrics.get('time/epoch_s', float('nan')):.2f} s "
                f"({how}) -> {output_dir}")
    return f"{shown('test/acc')} {shown('test/loss')} ({how}) of {ckpt_path} -> {output_dir}"


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    return cli.run_job(train, cfg)


def main() -> None:
    cli.run_entry(hydra_main)


if __name__ == "__main__":
    main()

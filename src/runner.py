"""What a run does, in each of its processes: check the config and this machine, build the data, model,
callbacks, logger and Trainer, fit, test, log. `python -m src.train` (and `src.eval`, which only tests) run
it as their Hydra job; importing it imports torch and Lightning, which the entry points leave until then."""

import logging
import statistics
import warnings
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.strategies import DDPStrategy, Strategy
from omegaconf import DictConfig, OmegaConf

from src import checks, resume
from src.checks import objects
from src.build import build
from src.callbacks.hardware import HardwareUse
from src.callbacks.model_summary import without_zero_flops
from src.callbacks.learning import LossFalls
from src.callbacks.progress import EpochBar
from src.launch import workers
from src.checkpoints import AtomicCheckpointIO, checkpoint_to_evaluate, resolve_ckpt_path, tested_weights
from src.data.fashion_mnist import per_process_batch
from src.launch.cli import Result
from src.launch.console import processes
from src.launch.ranks import is_launching_process, is_rank_zero
from src.errors import UsageError
from src.fast_path import (apply_fast_steps, cudnn_benchmark, keep_freed_memory, one_channel_nchw_pays, resolve_accelerator,
                           resolve_precision, speed_up)
from src.hparams import has_hparams, log_hparams, run_hparams
from src.launch.naming import register_resolvers
from src.loggers import purge_step, resumes_in
from src.optim import build_optimizer, build_schedule, check_optimizer
from src.strategies.sync_batchnorm import SyncBatchNormPlugin

log = logging.getLogger("src.train")  # the result line is the command's: named after it
register_resolvers()


def ignore_known_warnings() -> None:
    """Hide Lightning's and torch's warnings that ask nothing of this project's users."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")  # torch 2.14 vs Lightning 2.6
    # The xfer/ epoch means are rank 0's own figures by design (src/callbacks/comm.py), not a sum over ranks.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('xfer/")
    # Lightning's hint to prepend `srun` wherever the command exists: a run started without it on a SLURM
    # login or build node is a local run by choice (docs/cluster.md says how to run under SLURM).
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    # Every scalar has per-epoch points (xfer/ its `_epoch` means), so a run of fewer steps than
    # trainer.log_every_n_steps loses no curve: Lightning's advice to lower the interval does not apply.
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging interval")
    # The summary's size estimate falls back to 32 bits for bf16; the run's precision is said where it counts.
    warnings.filterwarnings("ignore", message=r"Precision \S+ is not supported by the model summary")
    # A run refuses a new start in a folder that holds checkpoints, so a non-empty one is always its own resume.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


ignore_known_warnings()


def route_lightning_logs() -> None:
    """Send Lightning's messages through the root logger (Hydra's console and `train.log`) instead of
    the console handlers Lightning installs for itself when imported."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: "litlogger" not in record.getMessage())


route_lightning_logs()  # once: Lightning installed its handlers when it was imported, above


def processes_per_node(strategy: str | Strategy, devices: int) -> int:
    """DDP runs one process per device; `auto` and dp run one process."""
    if isinstance(strategy, DDPStrategy):
        return devices
    if strategy == "auto" and devices > 1:
        raise UsageError(f"strategy=auto runs on one device, not devices={devices}; use strategy=ddp (or dp on GPUs)")
    return 1


def scalar_metrics(trainer: Trainer) -> dict[str, float]:
    return {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}


def weights_to_test(test_weights: str, best: Callback | None) -> Path | None:
    """The best checkpoint's file for `test_weights=best`; None for the weights training ended with.

    Every process asks its own ModelCheckpoint, which knows the file rank 0 wrote (also after a resume
    in the run folder), so all of them test the same weights.
    """
    if test_weights == "last":
        return None
    if isinstance(best, ModelCheckpoint) and best.best_model_path:
        return Path(best.best_model_path)
    if is_rank_zero():
        log.info("test_weights=best: no best checkpoint was saved (validation off, or no callbacks.best_checkpoint); "
                 "testing the last weights")
    return None


def run(cfg: DictConfig, fit: bool = True) -> Result:
    """Fit (unless `fit` is false) and test one configuration; its final metrics and result line."""
    # Check every value and this machine; read the checkpoint once. Nothing is written before the checks pass.
    checks.check_config(cfg)
    objects.check_hardware(cfg.accelerator, str(cfg.precision), cfg.devices)
    output_dir = Path(cfg.output_dir)
    accelerator = resolve_accelerator(cfg.accelerator)
    precision = resolve_precision(cfg.precision, accelerator)
    checkpoint = resolve_ckpt_path(cfg.ckpt_path, output_dir) if fit else checkpoint_to_evaluate(cfg.ckpt_path, cfg.test_weights)
    strategy = build("strategy", cfg.strategy, _convert_="all")
    world_size = processes_per_node(strategy, cfg.devices) * cfg.num_nodes
    step_batch = per_process_batch(cfg.data.batch_size, world_size)
    seed_everything(cfg.seed, workers=True, verbose=False)
    if accelerator == "cpu":
        keep_freed_memory()

    # Data, model, callbacks, logger, trainer.
    datamodule = instantiate(cfg.data)
    if is_launching_process():  # fail on missing or corrupt data before any process is started
        datamodule.prepare_data()
        datamodule.setup()

    optimizer = build_optimizer(cfg.optim, cfg.data.batch_size)
    schedule = build_schedule(cfg.optim)
    # A LightningModule of one's own (docs/extending.md) is handed a schedule only when one is asked for.
    model = build("model", cfg.model, optimizer=optimizer, **({} if schedule.name == "none" else {"schedule": schedule}))
    objects.check_model(model, cfg.model.get("_target_"))
    check_optimizer(optimizer, model.parameters())
    objects.check_checkpoint(checkpoint, cfg.ckpt_path, model, cfg.model_name)
    # The Classifier's network; a LightningModule of one's own (docs/extending.md) may have no `net`.
    speed_up(getattr(model, "net", model), channels_last=cfg.channels_last, compile=cfg.compile,
             one_channel_nchw=one_channel_nchw_pays(accelerator, strategy))
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_args["benchmark"] = cudnn_benchmark(trainer_args["benchmark"], trainer_args["deterministic"])
    fast_steps = apply_fast_steps(cfg, trainer_args, model, datamodule, accelerator=accelerator,
                                  world_size=world_size, strategy=strategy, step_batch=step_batch)
    if is_rank_zero():  # every interpolation resolved, and the precision that `precision` became: what this run really used
        used = OmegaConf.merge(OmegaConf.to_container(cfg, resolve=True), {resume.PRECISION_USED: precision})
        OmegaConf.save(used, output_dir / "config.yaml")

    callbacks: list[Callback] = [instantiate(c) for c in cfg.callbacks.values()]
    if trainer_args.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(EpochBar())  # Lightning's bar, counting epochs as train.log does
    resumed_at = purge_step(checkpoint, output_dir) if fit else None  # scoring a checkpoint hides nothing
    logger = instantiate(cfg.logger, purge_step=resumed_at)
    plugins: list[Any] = [AtomicCheckpointIO()]
    if cfg.sync_batchnorm:
        plugins.append(SyncBatchNormPlugin(cuda=accelerator == "gpu"))
    trainer = Trainer(
        accelerator=accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy=strategy, precision=precision,
        max_epochs=cfg.max_epochs, logger=logger, callbacks=callbacks, plugins=plugins,
        default_root_dir=str(output_dir), use_distributed_sampler=False, **trainer_args,
    )
    trainer.callbacks = without_zero_flops(trainer.callbacks)
    if workers.needed(trainer):  # local DDP: one worker process per device, each running this function
        return workers.start(run, cfg, fit)
    workers.stop_on_signals(trainer)

    # Fit, then test.
    with objects.trainer_input_errors():
        metrics: dict[str, float] = {}
        if fit:
            trainer.fit(model, datamodule=datamodule, ckpt_path=None if checkpoint is None else str(checkpoint.path),
                        weights_only=True)
            metrics = scalar_metrics(trainer)
            tested = weights_to_test(cfg.test_weights, dict(zip(cfg.callbacks, callbacks)).get("best_checkpoint"))
        else:  # the weights alone: the training run's callbacks and loops have nothing to do here
            model.load_state_dict(checkpoint.contents["state_dict"])
            tested = checkpoint.path
        # A file named here is read for its weights only; none leaves the model's (SLURM: Lightning may load hpc_ckpt_*).
        trainer.test(model, datamodule=datamodule, ckpt_path=str(tested) if fit and tested else None,
                     verbose=False, weights_only=True)
        metrics.update(scalar_metrics(trainer))

    # Log the result.
    epoch_times = next((c.epoch_times for c in callbacks if hasattr(c, "epoch_times")), [])
    if epoch_times:
        metrics["time/epoch_s"] = statistics.median(epoch_times)
    metrics.update(next((c.summary() for c in callbacks if isinstance(c, HardwareUse)), {}))
    how = f"precision {precision}, {processes(world_size)}"
    if fit:
        how += f", tested {tested.name if tested else 'the last weights'}"
        how += "".join(f"; {c.verdict()}" for c in callbacks if isinstance(c, LossFalls))
    line = result_line(metrics, fit, how, None if checkpoint is None else checkpoint.path, output_dir)
    if trainer.is_global_zero:
        if not (fit and resumes_in(checkpoint, output_dir)) or not has_hparams(output_dir):  # a resumed run keeps its record
            params = run_hparams(cfg, trainer, optimizer.keywords["lr"])
            params.update(cuda_graphs=fast_steps.cuda_graphs, steps_per_execution=fast_steps.steps_per_execution,
                          tested_weights=tested_weights(tested))
            log_hparams(logger, params, output_dir, trainer.global_step)
        logger.close()
        log.info(line)
    return Result(metrics, line, resumed=fit and checkpoint is not None)


def train(cfg: DictConfig) -> Result:
    return run(cfg, fit=True)


def result_line(metrics: dict[str, float], fit: bool, how: str, ckpt_path: Path | None, output_dir: Path) -> str:
    """The one line a run ends with: what a person greps for."""
    def shown(name: str) -> str:
        return f"{name}={metrics.get(name, float('nan')):.4f}"

    if fit:
        return (f"{shown('test/acc')} {shown('val/acc_best')} median epoch {metrics.get('time/epoch_s', float('nan')):.2f} s"
                f"{hardware_use(metrics)} ({how}) -> {output_dir}")
    return f"{shown('test/acc')} {shown('test/loss')} ({how}) of {ckpt_path} -> {output_dir}"


def hardware_use(metrics: dict[str, float]) -> str:
    """`, 0.52 TFLOP/s a device, MFU 13.1 %, peak memory 812 MiB`: what the run measured of these (HardwareUse)."""
    shown = []
    if "usage/tflops_per_s" in metrics:
        shown.append(f"{metrics['usage/tflops_per_s']:.3g} TFLOP/s a device")
    if "usage/mfu" in metrics:
        shown.append(f"MFU {metrics['usage/mfu']:.1%}".replace("%", " %"))
    if "usage/peak_memory_mib" in metrics:
        shown.append(f"peak memory {metrics['usage/peak_memory_mib']:.0f} MiB")
    return "".join(f", {figure}" for figure in shown)

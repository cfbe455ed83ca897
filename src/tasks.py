"""A run in each of its processes, once its config is checked: its objects built from the config (`build_run`), then
fit and tested (`train`, for `src.train`) or tested (`evaluate`, for `src.eval`). torch and Lightning are imported here,
never by the entry points themselves, so that `--help` and a refused config are answered without them."""

import inspect
import logging
import re
import statistics
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer, seed_everything
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from omegaconf import DictConfig, OmegaConf

from src.callbacks import log_at_step, logged_at_last_step
from src.callbacks.disturbance import Disturbance
from src.callbacks.hardware import HardwareUse
from src.callbacks.learning import LossFalls
from src.callbacks.model_summary import without_zero_flops
from src.callbacks.progress import progress_bar
from src.callbacks.timing import TimeToAccuracy
from src.checkpoints import (AtomicCheckpointIO, Saved, check_checkpoint, check_something_left, checkpoint_to_evaluate,
                             is_own, resolve_ckpt_path, tested_weights)
from src.errors import UsageError, build
from src.fast_path import (LIGHTNING_SPELLING, apply_fast_steps, cudnn_benchmark, float32_math,
                           keep_freed_memory, one_channel_nchw_pays, resolve_accelerator, speed_up)
from src.hparams import log_hparams, log_settings, run_hparams
from src.launch.console import processes
from src.launch.ranks import is_rank_zero
from src.launch.workers import StopOnSignal, processes_per_node
from src.loggers import close_loggers, keep_run_ids, kept_run_ids, purge_step, resuming, takes_purge_step
from src.optim import build_optimizer, build_schedule, check_optimizer
from src.records import Result, target_name
from src.strategies.sync_batchnorm import SyncBatchNormPlugin

log = logging.getLogger("src.train")  # the result line is the command's: named after it


def quiet_known_warnings() -> None:
    for message in (
        r".*isinstance\(treespec, LeafSpec\)",  # torch 2.14 against Lightning 2.6
        r"It is recommended to use `self.log\('xfer/",  # the xfer/ epoch means are rank 0's own by design
        r"The `srun` command is available on your system but is not used",  # a local run on a SLURM node is one by choice
        r"The number of training batches \(\d+\) is smaller than the logging interval",  # every scalar has epoch points
        r"Precision \S+ is not supported by the model summary",  # its size estimate; the precision is said elsewhere
        r"Checkpoint directory .* exists and is not empty",  # a folder with checkpoints is always its own resume
        r"The dirpath has changed from",  # a run from another folder's checkpoint keeps its own best (weights_to_test)
    ):
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        logging.getLogger(name).handlers.clear()  # Lightning's own console handlers: its lines go to train.log too
        logging.getLogger(name).propagate = True
    # Lightning's advertisement for a hosted logger; and its notice that `limit_train_batches=1` is one batch, which
    # debug=quick's steps_per_execution turns into several optimizer steps.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith(("💡 Tip", "`Trainer(limit_train_batches=1)`")))


quiet_known_warnings()


def check_model(model: object, target: object, sample_shape: tuple[int, ...] | None, num_classes: int | None) -> None:
    """A LightningModule whose output on one sample has a score per class."""
    if not isinstance(model, LightningModule):
        raise UsageError(f"model._target_={target} is not allowed; it must name a LightningModule, "
                         "e.g. src.models.module.Classifier with the network under model.net")
    if sample_shape is None or num_classes is None:
        return
    net = getattr(model, "net", model)
    try:
        with torch.no_grad():
            shape = tuple(net.eval()(torch.zeros(2, *sample_shape)).shape)
    except RuntimeError as error:
        raise UsageError(f"model: the network cannot take the data's images of shape {sample_shape} "
                         f"({str(error).splitlines()[0]})") from None
    finally:
        net.train()
    if shape != (2, num_classes):
        raise UsageError(f"model: the network gives outputs of shape {shape[1:]} for the data's images, not one score "
                         f"for each of its {num_classes} classes")


@contextmanager
def trainer_input_errors() -> Iterator[None]:
    """Lightning's refusal of a Trainer argument only the data can judge (`trainer.val_check_interval=500`)."""
    try:
        yield
    except (MisconfigurationException, ValueError) as error:
        arguments = inspect.signature(Trainer.__init__).parameters
        named = [name for name in re.findall(r"`(?:Trainer\()?(\w+)", str(error)) if name in arguments]
        if not named:
            raise
        raise UsageError(f"trainer.{named[0]}: {' '.join(str(error).split())}") from error


def build_run(cfg: DictConfig, checkpoint: Saved | None, fit: bool) -> dict[str, Any]:
    output_dir, accelerator = Path(cfg.output_dir), resolve_accelerator(cfg.accelerator)
    seed_everything(cfg.seed, workers=True, verbose=False)
    if accelerator == "cpu":
        keep_freed_memory()
    typed = LIGHTNING_SPELLING.get(str(cfg.precision), str(cfg.precision))
    if fit and typed not in ("auto", cfg.precision_used) and is_rank_zero():
        log.warning(f"precision={cfg.precision} needs a CUDA GPU; this CPU run uses {cfg.precision_used} instead")
    if float32_math(cfg.precision_used, accelerator) and fit and is_rank_zero():
        log.info("precision=32 on CUDA: float32 throughout, TF32 off in cuDNN convolutions and matmuls")

    datamodule = build("data", cfg.data)
    strategy = build("strategy", cfg.strategy, _convert_="all")
    optimizer = build_optimizer(cfg.optim, cfg.data.batch_size)
    schedule = build_schedule(cfg.optim)
    # A LightningModule of one's own (docs/extending.md) is handed a schedule only when one is asked for.
    model = build("model", cfg.model, optimizer=optimizer, **({} if schedule.name == "none" else {"schedule": schedule}))
    check_model(model, cfg.model.get("_target_"), getattr(datamodule, "sample_shape", None), cfg.data.get("num_classes"))
    check_optimizer(optimizer, model.parameters())
    check_checkpoint(checkpoint, cfg.ckpt_path, model, cfg.model_name)
    if fit:
        check_something_left(checkpoint, cfg.ckpt_path, output_dir, int(cfg.max_epochs), int(cfg.trainer.max_steps))
    speed_up(getattr(model, "net", model), channels_last=cfg.channels_last, compile=cfg.compile,
             one_channel_nchw=one_channel_nchw_pays(accelerator, strategy))

    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_args["benchmark"] = cudnn_benchmark(trainer_args["benchmark"], trainer_args["deterministic"])
    world_size = processes_per_node(cfg) * int(cfg.num_nodes)
    callbacks: list[Callback] = [build(f"callbacks.{name}", node) for name, node in cfg.callbacks.items()]
    fast_steps = apply_fast_steps(cfg, trainer_args, model, datamodule, accelerator=accelerator, world_size=world_size,
                                  strategy=strategy, step_batch=cfg.data.batch_size // world_size, callbacks=callbacks)
    if not any(isinstance(c, ProgressBar) for c in callbacks):
        bar = progress_bar(trainer_args.get("enable_progress_bar"))
        trainer_args["enable_progress_bar"] = bar is not None
        callbacks += [bar] if bar is not None else []
    purge = purge_step(checkpoint, output_dir) if fit else None  # scoring a checkpoint hides nothing
    run_ids = kept_run_ids(output_dir) if fit else {}  # scoring a checkpoint logs into runs of its own
    loggers = {name: build(f"logger.{name}", node, **({"purge_step": purge} if takes_purge_step(node) else {}),
                           **resuming(node, run_ids.get(name))) for name, node in cfg.logger.items()}
    if fit and is_rank_zero():
        keep_run_ids(loggers, output_dir, run_ids)
    plugins: list[Any] = [AtomicCheckpointIO()] + ([SyncBatchNormPlugin(cuda=accelerator == "gpu")] if cfg.sync_batchnorm else [])
    trainer = Trainer(accelerator=accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy=strategy,
                      precision=cfg.precision_used, max_epochs=cfg.max_epochs, logger=list(loggers.values()),
                      callbacks=[StopOnSignal(), *callbacks], plugins=plugins, default_root_dir=str(output_dir),
                      use_distributed_sampler=False, **trainer_args)
    trainer.callbacks = without_zero_flops(trainer.callbacks)
    return {"datamodule": datamodule, "model": model, "optimizer": optimizer, "callbacks": dict(zip(cfg.callbacks, callbacks)),
            "loggers": list(loggers.values()), "trainer": trainer, "fast_steps": fast_steps}


def scalar_metrics(trainer: Trainer) -> dict[str, float]:
    return {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}


def weights_to_test(test_weights: str, best: Callback | None, run_dir: Path) -> Path | None:
    """None for the weights training ended with; each process's ModelCheckpoint knows the file rank 0 wrote. A best
    file of another folder (Lightning keeps the path of a checkpoint this run started from) is not this run's."""
    if test_weights == "last":
        return None
    if isinstance(best, ModelCheckpoint) and best.best_model_path and is_own(best.best_model_path, run_dir):
        return Path(best.best_model_path)
    if is_rank_zero():
        log.info("test_weights=best: no best checkpoint was saved (validation off, or no callbacks.best_checkpoint); "
                 "testing the last weights")
    return None


def train(cfg: DictConfig) -> tuple[Result, dict[str, Any]]:
    output_dir = Path(cfg.output_dir)
    checkpoint = resolve_ckpt_path(cfg.ckpt_path, output_dir)
    objects = build_run(cfg, checkpoint, fit=True)
    trainer, model, datamodule = objects["trainer"], objects["model"], objects["datamodule"]
    objects["settings"] = settings(cfg, objects)  # as training starts: the record at the end shows the same
    if is_rank_zero():
        log_settings(objects["loggers"], objects["settings"])
    with trainer_input_errors():
        trainer.fit(model, datamodule=datamodule, ckpt_path=None if checkpoint is None else str(checkpoint.path),
                    weights_only=True)
        own = checkpoint is not None and is_own(checkpoint.path, output_dir)
        logged = checkpoint.contents.get("logged", {}) if own else {}
        metrics = {**logged, **scalar_metrics(trainer)}  # a fit resumed after its last epoch logs nothing itself
        tested = weights_to_test(cfg.test_weights, objects["callbacks"].get("best_checkpoint"), output_dir)
        # A file named here is read for its weights only (SLURM: Lightning may load hpc_ckpt_* itself).
        with logged_at_last_step(trainer):
            trainer.test(model, datamodule=datamodule, ckpt_path=str(tested) if tested else None, verbose=False,
                         weights_only=True)
    metrics.update(scalar_metrics(trainer))
    callbacks = list(objects["callbacks"].values())
    epoch_times = next((c.epoch_times for c in callbacks if hasattr(c, "epoch_times")), [])
    if epoch_times:
        metrics["time/epoch_s"] = statistics.median(epoch_times)
    metrics.update(next((c.summary() for c in callbacks if isinstance(c, HardwareUse)), {}))
    how = f"precision {cfg.precision_used}, {processes(trainer.world_size)}, tested {tested.name if tested else 'the last weights'}"
    how += "".join(f"; {c.verdict()}" for kind in (LossFalls, TimeToAccuracy, Disturbance) for c in callbacks
                   if isinstance(c, kind) and c.verdict())
    line = (f"{shown(metrics, 'test/acc')} {shown(metrics, 'val/acc_best')} median epoch "
            f"{metrics.get('time/epoch_s', float('nan')):.2f} s{hardware_use(metrics)} ({how}) -> {output_dir}")
    reached = next((c.summary() for c in callbacks if isinstance(c, TimeToAccuracy)), [])
    result = Result(metrics, line, trainer.global_step, resumed=checkpoint is not None, time_to_accuracy=reached)
    record(cfg, objects, result, tested)
    return result, objects


def record(cfg: DictConfig, objects: dict[str, Any], result: Result, tested: Path | None, training: bool = True) -> None:
    """Rank 0 ends the run's record: its settings in every logger (a training's only, so that HParams compares
    trainings), `result.json`, and the result line."""
    trainer = objects["trainer"]
    if not trainer.is_global_zero:
        return
    if training:
        params = objects["settings"] | {"tested_weights": tested_weights(tested)}
        targets = [target_name(t) for c in objects["callbacks"].values() if isinstance(c, TimeToAccuracy) for t in c.targets]
        log_hparams(objects["loggers"], params, Path(cfg.output_dir), trainer.global_step, targets)
    close_loggers(objects["loggers"])
    result.save(Path(cfg.output_dir))
    logging.getLogger("src.train" if training else "src.eval").info(result.line)


def settings(cfg: DictConfig, objects: dict[str, Any]) -> dict[str, Any]:
    """The run's settings as its loggers record them (`src.hparams`), known before it trains."""
    fast_steps = objects["fast_steps"]
    return run_hparams(cfg, objects["trainer"], objects["model"], objects["optimizer"].keywords["lr"]) | {
        "cuda_graphs": fast_steps.cuda_graphs, "steps_per_execution": fast_steps.steps_per_execution}


def shown(metrics: dict[str, float], name: str) -> str:
    return f"{name}={metrics.get(name, float('nan')):.4f}"


def hardware_use(metrics: dict[str, float]) -> str:
    """`, 0.52 TFLOP/s a device, MFU 13.1 %, peak memory 812 MiB`: those of these the run measured (HardwareUse)."""
    shapes = {"usage/tflops_per_s": "{:.3g} TFLOP/s a device", "usage/mfu": "MFU {:.1%}",
              "usage/peak_memory_mib": "peak memory {:.0f} MiB"}
    return "".join(", " + shape.format(metrics[name]).replace("%", " %") for name, shape in shapes.items()
                   if name in metrics)


def fit_and_test(cfg: DictConfig) -> Result:
    return train(cfg)[0]


def scored_step(global_step: object) -> int:
    """The step an evaluation logs its test points at: where its checkpoint's run logged the last points before the
    checkpoint (`logged_at_last_step`), so that TensorBoard shows the score beside that run's, not at step 0."""
    return max(global_step - 1, 0) if isinstance(global_step, int) and not isinstance(global_step, bool) else 0


def evaluate(cfg: DictConfig) -> Result:
    """`src.eval`'s task: the checkpoint's weights in the model its run built, tested under this command's settings."""
    checkpoint = checkpoint_to_evaluate(cfg.ckpt_path, cfg.test_weights)
    objects = build_run(cfg, checkpoint, fit=False)
    trainer, model = objects["trainer"], objects["model"]
    model.load_state_dict(checkpoint.contents["state_dict"])  # the weights alone: nothing of the training run's loops
    log_at_step(trainer, scored_step(checkpoint.contents.get("global_step")))
    with trainer_input_errors():
        trainer.test(model, datamodule=objects["datamodule"], verbose=False, weights_only=True)
    metrics = scalar_metrics(trainer)
    line = (f"{shown(metrics, 'test/acc')} {shown(metrics, 'test/loss')} (precision {cfg.precision_used}, "
            f"{processes(trainer.world_size)}) of {checkpoint.path} -> {cfg.output_dir}")
    result = Result(metrics, line, trainer.global_step)
    record(cfg, objects, result, checkpoint.path, training=False)
    return result

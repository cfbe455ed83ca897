"""The LightningModule shared by every model, strategy and precision."""

import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning import LightningModule
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from src import records
from src.callbacks import log_at_step, logged_step
from src.checkpoints import read_checkpoint
from src.fast_path import FastSteps, GraphedStep
from src.optim import Schedule, fused_under_a_scaler

log = logging.getLogger(__name__)

STAGES = ("train", "val", "test")
# Where Lightning's checkpoints count the optimizer steps taken under automatic and manual optimization.
AUTOMATIC_STEPS = "epoch_loop.automatic_optimization.optim_progress"
MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"
WARM_STEPS = 3  # eager steps before a CUDA graph's capture: cuDNN's autotuning and the optimizer's state are built
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def plain(node: Any) -> Any:
    """A config as plain values; None for an object (a network handed over as a module is not recorded)."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return dict(node) if isinstance(node, Mapping) else None


class Classifier(LightningModule):
    """Loss, accuracy and logging on the logits of the whole per-process batch: a strategy only parallelises `net`."""

    def __init__(self, net: nn.Module | Mapping[str, Any],
                 optimizer: OptimizerFactory = partial(torch.optim.SGD, lr=0.1),  # the book's LeNet rate
                 num_classes: int = 10, loss: nn.Module | Mapping[str, Any] | None = None,
                 schedule: Schedule | None = None) -> None:
        super().__init__()
        # Configs (conf/model: `_recursive_: false`) built here, recorded as plain values for `load_from_checkpoint`.
        self.save_hyperparameters({"net": plain(net), "loss": plain(loss), "num_classes": num_classes}, logger=False)
        self.net = instantiate(net) if isinstance(net, Mapping) else net
        self.optimizer = optimizer
        self.schedule = schedule or Schedule()
        self.loss = instantiate(loss) if isinstance(loss, Mapping) else loss if loss is not None else nn.CrossEntropyLoss()
        # Loss weighted by images: unpadded evaluation shards count each image once. No per-step checks (a GPU wait).
        for stage in STAGES:
            setattr(self, f"{stage}_acc", MulticlassAccuracy(num_classes, average="micro", validate_args=False))
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy="disable"))
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so that a resumed run remembers its best epoch
        self._logged: set[str] = set()  # the stages whose metric objects `self.log` has this epoch
        self.fast_steps = FastSteps()
        self.step_batch_size = 0  # with steps_per_execution > 1: the images of one optimizer step
        self.graphed: GraphedStep | None = None
        self._captured_with: tuple = ()  # what the graph holds of the fit that captured it (`_capture_key`)
        self.warm_steps = 0
        self.warmup_s = 0.0  # compiling, capturing the CUDA graph: one-off time that EpochTimer leaves out of time/epoch_s
        self._warmup_started: float | None = None
        self._compile_timed = False

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, *args: Any, **kwargs: Any) -> "Classifier":  # type: ignore[override]
        """Weights-only, building only classes the project's conf/ names: a checkpoint may come from anyone."""
        saved = read_checkpoint(checkpoint_path)
        legacy = [key for key in ("hparams", "module_arguments") if key in saved]  # Lightning would merge them in
        if legacy:
            raise records.refused(Path(checkpoint_path), legacy[0], "...", "a checkpoint of this project keeps its "
                                  "settings in hyper_parameters alone")
        recorded = saved.get("hyper_parameters", {})
        records.check_data({k: v for k, v in recorded.items() if k not in kwargs}, Path(checkpoint_path), "model")
        kwargs["weights_only"] = True
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def use_fast_steps(self, fast_steps: FastSteps, step_batch_size: int) -> None:
        """`steps_per_execution` optimizer steps a batch (CUDA graph replays with `cuda_graphs`), stepped here."""
        self.fast_steps = fast_steps
        self.step_batch_size = step_batch_size
        self.automatic_optimization = not fast_steps.manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return self.loss(logits, y), logits, y

    def stage_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        loss, logits, y = self.model_step(batch)
        self.update_metrics(stage, loss, logits, y)
        return loss

    def update_metrics(self, stage: str, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        """The image count is made on the device: a Python number would be copied from pageable memory, a wait."""
        getattr(self, f"{stage}_acc").update(logits, y)
        getattr(self, f"{stage}_loss").update(loss.detach(), weight=loss.new_full((), len(y), dtype=torch.float32))
        if stage not in self._logged:
            # Once an epoch: Lightning computes and resets the metric objects at its end, and a call costs 0.3 ms.
            self._logged.add(stage)
            self.log(f"{stage}/loss", getattr(self, f"{stage}_loss"), on_step=False, on_epoch=True, prog_bar=stage == "train")
            self.log(f"{stage}/acc", getattr(self, f"{stage}_acc"), on_step=False, on_epoch=True, prog_bar=stage != "test")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.automatic_optimization:
            return self.stage_step(batch, "train")
        x, y = batch
        size = self.step_batch_size or len(y)
        losses = [self.optimizer_step_on(xs, ys) for xs, ys in zip(x.split(size), y.split(size))]
        # Lightning logs at batches taken; count optimizer steps.
        log_at_step(self.trainer, logged_step(self.trainer) + len(losses) - 1)
        return torch.stack(losses)

    def optimizer_step_on(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer = self.optimizers()
        if self.graphed is None and self.fast_steps.cuda_graphs and len(y) == self.step_batch_size:
            if self.warm_steps >= WARM_STEPS:
                self._capture(optimizer, x, y)
            self.warm_steps += 1
        if self.graphed is not None and len(y) == self.step_batch_size:
            loss, logits = self.graphed(x, y)
        else:  # warm-up, an uneven last batch, or no graphs: eager, accumulating into zeroed gradients
            self._start_warmup()
            optimizer.zero_grad(set_to_none=self.graphed is None)
            loss, logits = self.forward_backward(x, y)
        optimizer.step()
        if (scheduler := self.lr_schedulers()) is not None:  # Lightning steps it only under automatic optimization
            scheduler.step()
        self._end_warmup()
        self.update_metrics("train", loss, logits, y)
        return loss.detach().clone()  # a replay overwrites the graph's own loss tensor

    def _capture(self, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        """Eager steps from now on where the step cannot be captured (`.item()`, a data-dependent shape)."""
        optimizer.zero_grad(set_to_none=True)  # the captured backward pass owns the gradients from now on
        try:
            self.graphed = GraphedStep(self.forward_backward, x, y, list(self.parameters()))
        except RuntimeError as error:
            cause: BaseException = error
            while cause.__context__ is not None:  # the capture's end fails too: the first error says why
                cause = cause.__context__
            optimizer.zero_grad(set_to_none=True)  # what the failed capture left in them
            self.fast_steps = replace(self.fast_steps, cuda_graphs=False)
            log.warning(f"cuda_graphs: the training step cannot be captured as a CUDA graph "
                        f"({(str(cause).strip() or type(cause).__name__).splitlines()[0]}); it runs eagerly")
            return
        self._captured_with = self._capture_key()
        self.warmup_s += self.graphed.capture_s
        log.info(f"CUDA graph of the training step captured in {self.graphed.capture_s:.2f} s "
                 f"(after {WARM_STEPS} eager steps; left out of time/epoch_s)")

    def on_train_start(self) -> None:
        """An earlier fit's CUDA graph serves this one while what it holds is the same."""
        if self.graphed is not None and self._capture_key() != self._captured_with:
            self.graphed, self.warm_steps = None, 0

    def _capture_key(self) -> tuple:
        """Parameters' memory, precision, and loss scaler (whose tensor the graph holds: the object, not its id)."""
        plugin = self.trainer.precision_plugin
        return (type(plugin), getattr(plugin, "precision", None), getattr(plugin, "scaler", None),
                tuple(param.data_ptr() for param in self.parameters()))

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits, _ = self.model_step((x, y))
        self.manual_backward(loss)
        return loss, logits

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.stage_step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.stage_step(batch, "test")

    def on_train_epoch_start(self) -> None:
        self._logged.discard("train")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.automatic_optimization:
            self._start_warmup()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.automatic_optimization:
            self._end_warmup()

    def _start_warmup(self) -> None:
        if self.fast_steps.compiled and not self._compile_timed:
            self._synchronize()
            self._warmup_started = time.perf_counter()

    def _end_warmup(self) -> None:
        if self._warmup_started is not None:
            self._synchronize()
            seconds = time.perf_counter() - self._warmup_started
            self.warmup_s += seconds
            self._warmup_started, self._compile_timed = None, True
            log.info(f"compile=true: the first training step, with compilation, took {seconds:.1f} s (left out of time/epoch_s)")

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_validation_epoch_start(self) -> None:
        self._logged.discard("val")
        self.val_acc.reset()  # a sanity check before training leaves its batches in them
        self.val_loss.reset()

    def on_test_epoch_start(self) -> None:
        self._logged.discard("test")

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_acc_best(self.val_acc.compute())
            self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The figures logged so far, and mid-epoch (`step.ckpt`) the training metrics' state: a resumed run's figures
        are the unbroken run's, also one resumed after its last epoch."""
        try:
            trainer = self.trainer
        except RuntimeError:  # no trainer attached: a checkpoint saved by hand, nothing logged
            return
        checkpoint["logged"] = {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}
        if trainer.training and not trainer.is_last_batch:
            checkpoint["epoch_metrics"] = {name: {key: value.detach().cpu() for key, value in metric.metric_state.items()}
                                           for name, metric in (("train_acc", self.train_acc), ("train_loss", self.train_loss))}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Between automatic and manual optimization (a CPU run resumed on a GPU), the steps taken move counters."""
        for name, states in checkpoint.get("epoch_metrics", {}).items():
            for key, value in states.items():
                setattr(getattr(self, name), key, value.to(self.device))
        # Lightning documents no format for its loops' state: one that reads otherwise is left as it is.
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        try:
            automatic, manual = loop[AUTOMATIC_STEPS]["optimizer"]["step"], loop[MANUAL_STEPS]
            source, target = (manual, automatic) if self.automatic_optimization else (automatic, manual)
            taken = target["total"]["completed"]
        except (KeyError, TypeError):
            return
        if taken == 0:
            target.update(copy.deepcopy(source))

    def configure_optimizers(self) -> Any:
        optimizer = fused_under_a_scaler(self.optimizer, self.trainer)(self.parameters())
        if self.schedule.name == "none":
            return optimizer
        # Lightning counts training batches; with steps_per_execution=K each batch is K optimizer steps.
        total_steps = int(self.trainer.estimated_stepping_batches) * self.fast_steps.steps_per_execution
        scheduler = self.schedule.scheduler(optimizer, total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

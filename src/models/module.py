"""The LightningModule shared by every model, strategy and precision."""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning import LightningModule
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy


STAGES = ("train", "val", "test")
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with the book's LeNet rate, for a Classifier built without a config."""
    return torch.optim.SGD(params, lr=0.1)


class Classifier(LightningModule):
    """Trains any image classifier `net` with the given loss (cross-entropy) and optimizer.

    Loss, accuracy and logging happen here, on the gathered logits of the whole
    (per-process) batch, so a strategy only has to make `net`'s forward pass parallel.
    The network, the loss and the optimizer come from the config (`conf/model/`,
    `conf/optim/`), so a new one is a config file and a class, not an edit here:
    `optimizer` is a partial (Hydra's `_partial_: true`) called with the parameters.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory = default_optimizer,
        num_classes: int = 10,
        loss: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # Objects stay out of the checkpoint's hyperparameters: a checkpoint is read with weights_only.
        self.save_hyperparameters(ignore=["net", "optimizer", "loss"], logger=False)
        self.net = net
        self.optimizer = optimizer
        self.loss = loss if loss is not None else nn.CrossEntropyLoss()
        # Per stage, the epoch's accuracy and image-weighted mean loss, updated at every step. Images
        # are weighted so that processes holding one image more or less than the others (unpadded
        # evaluation shards) count each image once. No per-step checks of the labels or of NaNs
        # (the data comes from validated files; FiniteLossCheck watches the loss): on a GPU each
        # check would wait for the device.
        for stage in STAGES:
            setattr(self, f"{stage}_acc", MulticlassAccuracy(num_classes, average="micro", validate_args=False))
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy="disable"))
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so that a resumed run remembers its best epoch
        self._logged: set[str] = set()  # the stages whose metric objects were handed to `self.log` this epoch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return self.loss(logits, y), logits, y

    def stage_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        """Loss of the batch; the stage's metrics take it in."""
        loss, logits, y = self.model_step(batch)
        getattr(self, f"{stage}_acc").update(logits, y)
        getattr(self, f"{stage}_loss").update(loss.detach(), weight=len(y))
        if stage not in self._logged:
            # Once per epoch is enough: Lightning computes and resets the metric objects at its end.
            # Every `self.log` call costs Lightning about 0.3 ms, a third of a GPU step of LeNet.
            self._logged.add(stage)
            self.log(f"{stage}/loss", getattr(self, f"{stage}_loss"), on_step=False, on_epoch=True, prog_bar=stage == "train")
            self.log(f"{stage}/acc", getattr(self, f"{stage}_acc"), on_step=False, on_epoch=True, prog_bar=stage != "test")
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.stage_step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.stage_step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.stage_step(batch, "test")

    def on_train_epoch_start(self) -> None:
        self._logged.discard("train")

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

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters())

"""The LightningModule shared by every model, strategy and precision."""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning import LightningModule
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy


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
        # No per-batch checks of the labels (the data module's come from validated files): on a GPU
        # they would wait for the device at every step.
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        # Loss means weighted by images, so that processes holding one image more or less than the
        # others (unpadded evaluation shards) count each image once.
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so that a resumed run remembers its best epoch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return self.loss(logits, y), logits, y

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, logits, y = self.model_step(batch)
        self.train_acc.update(logits, y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_acc.reset()
        self.val_loss.reset()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits, y = self.model_step(batch)
        self.val_acc.update(logits, y)
        self.val_loss.update(loss, weight=len(y))
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_acc_best(self.val_acc.compute())
            self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits, y = self.model_step(batch)
        self.test_acc.update(logits, y)
        self.test_loss.update(loss, weight=len(y))
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters())

"""No step of the default training path reads a device value on the host.

On a GPU every such read (`.item()`, `bool(tensor)`, a Python number copied to the device) makes
the host wait for the device, which then idles while the host prepares the next step. The CPU
cannot wait for itself, so here the reads are caught where they pass torch's dispatcher: a tensor
read to a Python number is `aten._local_scalar_dense`, a Python number made into a tensor is
`aten.lift_fresh`. tests/test_gpu.py runs the same steps under CUDA's own sync detector.
"""

import functools

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._python_dispatch import TorchDispatchMode

from src.callbacks.hardware import HardwareUse
from src.data.fashion_mnist import FashionMNISTDataModule
from src.fast_path import FastSteps
from src.models.lenet import LeNet
from src.models.module import Classifier
from tests.helpers import REPO

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default}
WARM = 2  # batches before recording: Lightning and the callbacks set themselves up in the first ones
BATCHES = 6


class HostReads(TorchDispatchMode):
    """Records the ops in HOST_READS while `recording` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.recording and func in HOST_READS:
            self.seen.append(str(func)); import traceback; self.stacks = getattr(self, "stacks", []) + ["".join(traceback.format_stack(limit=12))]
        return func(*args, **(kwargs or {}))


class RecordSteadySteps(Callback):
    """Records from the start of batch WARM until the epoch ends (before the other callbacks' epoch-end work)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.reads.recording = batch_idx >= WARM

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.reads.recording = False


def project_callbacks(tmp_path) -> list[Callback]:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        # A check of the loss every 1000 batches: on a GPU it reads every trainer.log_every_n_steps, not every step.
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", "+callbacks.finite_loss.every_n_steps=1000"])
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    return [c for c in callbacks if not isinstance(c, ModelCheckpoint)]


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_no_training_step_reads_the_device(tmp_path, data_root, steps_per_execution):
    reads = HostReads()
    module = Classifier(LeNet(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    data = FashionMNISTDataModule(root=str(data_root), batch_size=32, download=False)
    if steps_per_execution > 1:
        module.use_fast_steps(FastSteps(steps_per_execution=steps_per_execution), step_batch_size=32)
        data.steps_per_execution = steps_per_execution
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=BATCHES, limit_val_batches=0,
        num_sanity_val_steps=0, precision="bf16-mixed", logger=False, enable_checkpointing=False,
        callbacks=[RecordSteadySteps(reads), *project_callbacks(tmp_path)], use_distributed_sampler=False,
        enable_progress_bar=True,  # the default bar, as a run shows it
    )
    with reads:
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == BATCHES * steps_per_execution
    assert reads.seen == [], reads.stacks[0]
    # The run's hardware use was counted (FLOPs, before the first step) and measured (at the epoch's end).
    [usage] = [c for c in trainer.callbacks if isinstance(c, HardwareUse)]
    assert usage.flops_per_sample > 0 and len(usage.tflops_per_s) == 1 and usage.peak_memory > 0


def test_the_detector_sees_a_read_of_the_device(tmp_path, data_root):
    """The check above could fail: a module that passes a Python number to its metric is caught."""

    class Reading(Classifier):
        def update_metrics(self, stage, loss, logits, y):
            getattr(self, f"{stage}_loss").update(loss.detach(), weight=len(y))  # as this module once did
            float(loss)

    reads = HostReads()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=BATCHES, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        callbacks=[RecordSteadySteps(reads)], use_distributed_sampler=False, enable_model_summary=False,
    )
    with reads:
        trainer.fit(Reading(LeNet()), datamodule=FashionMNISTDataModule(root=str(data_root), batch_size=32, download=False))
    assert set(reads.seen) == {str(op) for op in HOST_READS}

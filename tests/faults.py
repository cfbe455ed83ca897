"""Faults injected into real runs through the config (`+callbacks.fault._target_=tests.faults.KillAtStep`)."""

import os
import signal

from lightning import Callback, LightningModule, Trainer


class KillAtStep(Callback):
    """SIGKILLs this process after optimizer step `step` on global rank `rank`, as a crash or `kill -9` would.

    Under torchrun only the first attempt is killed, so that a restarted group can finish.
    """

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step = step
        self.rank = rank

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.step and trainer.global_rank == self.rank and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


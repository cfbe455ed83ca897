"""Faults injected into real runs through the config (`+callbacks.fault._target_=tests.faults.KillAtStep`)."""

import os
import signal
import time
from pathlib import Path

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class KillAtStep(Callback):
    """SIGKILLs this process after optimizer step `step` on global rank `rank`, as a crash or `kill -9` would: at the
    end of the training batch that holds that step (a batch holds several with `steps_per_execution` > 1). With
    `launcher`, the process that started this one instead: a DDP rank's launcher (a sweep job's own process).

    Only a run that started afresh is killed: its resume (`ckpt_path=last`, or torchrun's restarted group with
    `ckpt_path=auto`) takes the same config, this callback included, and finishes. With a `mark` the kill comes once,
    in whichever start reaches the step first: the file says it happened (a resume killed again, by a second fault).
    """

    def __init__(self, step: int, rank: int = 0, mark: str | None = None, launcher: bool = False) -> None:
        self.step = step
        self.rank = rank
        self.mark = Path(mark) if mark else None
        self.launcher = launcher
        self._batch_start = 0  # the optimizer steps taken when the current training batch began

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._batch_start = trainer.global_step

    def reached(self, trainer: Trainer) -> bool:
        """Whether the training batch that has just ended took step `step`."""
        return self._batch_start < self.step <= trainer.global_step

    def due(self, trainer: Trainer) -> bool:
        """Whether the kill comes at the end of this batch: step `step` taken on rank `rank`, in a start not spared (a
        resume, or with a `mark`, any start after the one that was killed)."""
        spared = self.mark.exists() if self.mark is not None else trainer.ckpt_path is not None
        return self.reached(trainer) and trainer.global_rank == self.rank and not spared

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.due(trainer):
            if self.mark is not None:
                self.mark.touch()
            os.kill(os.getppid() if self.launcher else os.getpid(), signal.SIGKILL)


class KillSweepAtStep(KillAtStep):
    """SIGKILLs the whole process group (a sweep's launcher and every DDP worker) after step `step`
    of the sweep job whose folder name ends with `job`, as a reboot or `kill -9 -- -PGID` would."""

    def __init__(self, step: int, job: str, rank: int = 0) -> None:
        super().__init__(step, rank)
        self.job = job

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.due(trainer) and str(trainer.default_root_dir).endswith(self.job):
            os.killpg(os.getpgid(0), signal.SIGKILL)


class HoldAfterEpoch(Callback):
    """Holds the run once epoch `epoch` (0-based) has ended and been checkpointed, until the file `until` exists: a test
    stops it there (a signal's handler raises out of the wait), however fast the machine trains.

    A run that resumes from a checkpoint never holds; nor does a run started afresh once the test has made `until`
    (a job cancelled before its first checkpoint, run again by the sweep's resume).
    """

    def __init__(self, until: str, epoch: int = 0, holding: str | None = None) -> None:
        self.until = Path(until)
        self.epoch = epoch
        self.holding = Path(holding) if holding else None  # made once the hold began, the loggers' events written

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch + 1 and trainer.ckpt_path is None:
            if self.holding is not None:  # TensorBoard's writer thread writes nothing more while the run holds
                for logger in trainer.loggers:
                    getattr(logger.experiment, "flush", lambda: None)()
                self.holding.touch()
            while not self.until.exists():
                time.sleep(0.2)


class KillIn(Callback):
    """SIGKILLs this process in the Lightning hook `hook` of epoch `epoch` (from 0; the test runs at the last one), once:
    the file `mark` says it happened, so the resume goes through. Where a crash, a reboot or `kill -9` may come between
    a run's checkpoints, its validation and its test. Checkpoint callbacks run after every other callback, so
    `on_train_epoch_end` is after the epoch's best checkpoint and before its last.ckpt."""

    def __init__(self, hook: str, epoch: int, mark: str) -> None:
        self.epoch, self.mark = epoch, Path(mark)
        setattr(self, hook, self._kill)

    def _kill(self, trainer: Trainer, *args: object) -> None:
        if trainer.current_epoch == self.epoch and trainer.global_rank == 0 and not self.mark.exists():
            self.mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAfterCheckpoints(ModelCheckpoint):
    """Sends this process the signal `name` once, in epoch `epoch`, right after the epoch's checkpoints are written and
    before Lightning logs its `train/*` points (a checkpoint callback runs last, after the others); it saves nothing."""

    def __init__(self, epoch: int, mark: str, name: str = "SIGTERM") -> None:
        super().__init__(save_top_k=0, every_n_epochs=0)
        self.epoch, self.mark, self.signum = epoch, Path(mark), getattr(signal, name)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch and not self.mark.exists():
            self.mark.touch()
            os.kill(os.getpid(), self.signum)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass


class SignalAtStep(Callback):
    """Sends signal `name` to this process at the end of the training batch that takes optimizer step `step`, as a
    terminal's Ctrl-C in the first seconds of a run."""

    def __init__(self, step: int, name: str = "SIGINT") -> None:
        self.step, self.signum = step, getattr(signal, name)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            signal.raise_signal(self.signum)


class SweepLockProbe(Callback):
    """Writes to `mark` whether the sweep folder above this job's folder was locked as the job trained: `held` where
    another writer would be turned away."""

    def __init__(self, mark: str) -> None:
        self.mark = Path(mark)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import fcntl

        sweep_lock = Path(trainer.default_root_dir).parent / ".lock"
        try:
            fd = os.open(sweep_lock, os.O_RDONLY)
        except FileNotFoundError:
            self.mark.write_text("no lock")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.mark.write_text("free")
        except BlockingIOError:
            self.mark.write_text("held")
        finally:
            os.close(fd)

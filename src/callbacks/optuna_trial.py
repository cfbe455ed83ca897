"""A trial's side of `hydra/sweeper=optuna` in training: each epoch's val/acc reported, and pruning (a search of one
objective: Optuna reports and prunes no others)."""

from lightning import Callback, LightningModule, Trainer

from src.launch.optuna_sweeper import TrialRecord


class ReportToTrial(Callback):
    """Each epoch's val/acc to the trial; a pruned trial stops after the epoch in every process, then is tested."""

    def __init__(self, db: str, study: int, trial: int) -> None:
        """`db`: the study's storage, the sweep's file or the database URL the command typed."""
        self.where = (db, study, trial)
        self.trial: TrialRecord | None = None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value, stop = trainer.callback_metrics.get("val/acc"), False
        if trainer.is_global_zero and value is not None:
            self.trial = self.trial or TrialRecord(*self.where)
            last = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
            stop = self.trial.report(trainer.current_epoch, float(value), last=last)
        if trainer.strategy.broadcast(stop, src=0):
            trainer.should_stop = True

"""A trial's side of `hydra/sweeper=optuna`: a job reaches its trial through the study's file, in any process."""

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.types import TaskFunction
from lightning import Callback, LightningModule, Trainer
from omegaconf import DictConfig

from src.errors import UsageError
from src.launch.optuna_sweeper import CALLBACK, OBJECTIVE, PRUNED_AFTER, make_pruner, optuna_package, storage
from src.records import Result

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialResult(Result):
    pruned: bool = False


class TrialRecord:
    """One trial of a sweep's study, reached through the study's file by its number."""

    def __init__(self, db: str, study: str, number: int) -> None:
        self.storage, self.number = storage(db), number
        self.study = optuna_package().load_study(study_name=study, storage=self.storage)
        self.study.pruner = make_pruner(self.study.user_attrs.get("pruner", "none"))
        self.id = self.storage.get_trial_id_from_study_id_trial_number(self.storage.get_study_id_from_name(study), number)

    def report(self, epoch: int, value: float) -> bool:
        """True where the pruner gives the trial up."""
        self.storage.set_trial_intermediate_value(self.id, epoch, value)
        if not self.study.pruner.prune(self.study, self.storage.get_trial(self.id)):
            return False
        self.storage.set_trial_user_attr(self.id, PRUNED_AFTER, epoch + 1)
        log.info(f"trial {self.number + 1} pruned after epoch {epoch + 1}: val/acc={value:.4f} is below the median of "
                 "the trials before it at that epoch; it stops here, and is tested")
        return True

    def told(self, result: Any, folder: str) -> TrialResult:
        metrics = getattr(result, "metrics", {})
        if OBJECTIVE not in metrics:
            self.tell("FAIL")
            raise UsageError(f"trial {self.number + 1} has no {OBJECTIVE} to be judged by: {folder} ran no validation")
        for name in (OBJECTIVE, "test/acc"):
            if name in metrics:
                self.storage.set_trial_user_attr(self.id, name, metrics[name])
        pruned = PRUNED_AFTER in self.storage.get_trial(self.id).user_attrs
        self.tell("PRUNED" if pruned else "COMPLETE", None if pruned else metrics[OBJECTIVE])
        return TrialResult(**asdict(result), pruned=pruned)

    def tell(self, state: str, value: float | None = None) -> None:
        from optuna.trial import TrialState

        self.study.tell(self.number, value, state=TrialState[state], skip_if_finished=True)


@dataclass
class TrialTask:
    """Tells the study how the job ended; a stop signal (SystemExit) leaves the trial running, to resume."""

    task: TaskFunction

    def __call__(self, cfg: DictConfig) -> Any:
        where = cfg.callbacks[CALLBACK]
        trial, folder = TrialRecord(where.db, where.study, where.trial), Path(cfg.output_dir).name
        trial.storage.set_trial_user_attr(trial.id, "folder", folder)
        try:
            result = self.task(cfg)
        except Exception:
            trial.tell("FAIL")
            raise
        return trial.told(result, folder)


class ReportToTrial(Callback):
    """Each epoch's val/acc to the trial; a pruned trial stops after the epoch in every process, then is tested."""

    def __init__(self, db: str, study: str, trial: int) -> None:
        self.where = (db, study, trial)
        self.trial: TrialRecord | None = None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value, stop = trainer.callback_metrics.get("val/acc"), False
        if trainer.is_global_zero and value is not None:
            self.trial = self.trial or TrialRecord(*self.where)
            stop = self.trial.report(trainer.current_epoch, float(value))
        if trainer.strategy.broadcast(stop, src=0):
            trainer.should_stop = True

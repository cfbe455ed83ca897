"""Where Hydra finds the Optuna sweeper (`-m hydra/sweeper=optuna 'optim.lr=tag(log, interval(0.001, 0.1))'`), in
any Hydra app; Optuna (the `optuna` extra) is imported only when the sweeper is asked for."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from src.launch.optuna_sweeper import OptunaSweeper as _OptunaSweeper


class OptunaSweeper(_OptunaSweeper):
    """`src.launch.optuna_sweeper.OptunaSweeper`, under the name Hydra accepts."""


@dataclass
class OptunaSweeperConf:
    """A search for the best val/acc_best over the space typed on the command line; the study in <sweep>/optuna.db."""

    _target_: str = "hydra_plugins.project_sweepers.optuna_sweeper.OptunaSweeper"
    n_trials: int = 20  # trials in all, counting those of the command a resume continues
    n_jobs: int | None = None  # most trials at once; null: as many as the launcher runs (SLURM: batches of 1)
    sampler: str = "tpe"  # tpe | random
    seed: int = 0  # the sampler's
    direction: str = "maximize"  # maximize | minimize val/acc_best
    pruner: str = "median"  # median: stop a trial whose val/acc falls below the median of earlier trials' | none


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="project")

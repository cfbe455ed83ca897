"""Where Hydra finds the Optuna sweeper (`-m hydra/sweeper=optuna 'optim.lr=tag(log, interval(0.001, 0.1))'`), in
any Hydra app; Optuna (the `optuna` extra) is imported only when the sweeper is asked for."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from src.launch.optuna_samplers import SAMPLERS
from src.launch.optuna_sweeper import OptunaSweeper as _OptunaSweeper


class OptunaSweeper(_OptunaSweeper):
    """`src.launch.optuna_sweeper.OptunaSweeper`, under the name Hydra accepts."""


@dataclass
class OptunaSweeperConf:
    """A search for the best val/acc_best (or the Pareto front of several objectives, or another app's returned
    number) over the space typed on the command line; the study in <sweep>/optuna.db or `storage`."""

    _target_: str = "hydra_plugins.project_sweepers.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sampler's config reaches the sweeper as settings, to be checked, never built by Hydra
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}])  # hydra/sweeper/sampler=<name>
    n_trials: int = 20  # trials in all, counting those of the command a resume continues
    n_jobs: int | None = None  # most trials at once; null: as many as the launcher runs (SLURM: batches of 1)
    sampler: Any = None  # hydra/sweeper/sampler=tpe|random|grid|cmaes|nsgaii|qmc and its settings (the word tpe as before)
    seed: int = 0  # the sampler's, where hydra.sweeper.sampler.seed is null
    params: dict[str, str] | None = None  # key -> override, the space as a config types it; the command line wins
    direction: Any = "maximize"  # maximize | minimize, or a list of them, one per objective: [maximize, minimize]
    objectives: list[str] = field(default_factory=lambda: ["val/acc_best"])  # metrics of a run's result, one per direction
    storage: str | None = None  # a database URL, sqlite:///<file> | postgresql://<user>@<host>/<db>; null: <sweep>/optuna.db
    study_name: str | None = None  # null: the study of <sweep>/optuna.db, else the sweep folder's name
    pruner: str = "median"  # median: stop a trial whose val/acc falls below the median of earlier trials' | none


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="project")
for _name, _conf in SAMPLERS.items():
    ConfigStore.instance().store(group="hydra/sweeper/sampler", name=_name, node=_conf, provider="project")

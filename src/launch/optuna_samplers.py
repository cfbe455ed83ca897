"""`hydra/sweeper/sampler=<name>`: the samplers a search may use, each a typed config (Hydra's ConfigStore, group
`hydra/sweeper/sampler`) whose every setting carries its rule. A sampler is built from this config alone: what a
study's file holds never names a class or an argument."""

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.config import BOOL, NULL, SEED_MAX, Rule, fraction, one_of, shown, whole
from src.errors import UsageError, interpreter

SEED = NULL | whole(0, SEED_MAX)


def setting(default: Any, rule: Rule) -> Any:
    """A sampler's setting: its default, and its rule beside it."""
    return field(default=default, metadata={"rule": rule})


@dataclass
class TPE:
    """Optuna's TPE: `n_startup_trials` at random, then drawn from a model of the better and the worse trials."""

    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = setting(None, SEED)  # null: hydra.sweeper.seed
    n_startup_trials: int = setting(10, whole(0))
    n_ei_candidates: int = setting(24, whole(1))
    multivariate: bool = setting(True, BOOL)  # one model of all keys together, not one per key
    group: bool = setting(False, BOOL)  # with multivariate: a model per set of keys that trials share
    constant_liar: bool = setting(True, BOOL)  # trials running side by side are not drawn alike


@dataclass
class Random:
    """Every trial drawn at random."""

    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = setting(None, SEED)


@dataclass
class Grid:
    """Every point of a grid, in an order drawn from `seed`; the grid is the space's choices and ranges."""

    _target_: str = "optuna.samplers.GridSampler"
    seed: int | None = setting(None, SEED)


@dataclass
class CmaEs:
    """CMA-ES over the numbers of the space (a choice is drawn at random), after `n_startup_trials` at random."""

    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = setting(None, SEED)
    n_startup_trials: int = setting(1, whole(0))
    popsize: int | None = setting(None, NULL | whole(1))
    use_separable_cma: bool = setting(False, BOOL)
    with_margin: bool = setting(False, BOOL)
    lr_adapt: bool = setting(False, BOOL)
    consider_pruned_trials: bool = setting(False, BOOL)


@dataclass
class NSGAII:
    """NSGA-II, a genetic algorithm: generations of `population_size` trials."""

    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = setting(None, SEED)
    population_size: int = setting(50, whole(2))
    mutation_prob: float | None = setting(None, NULL | fraction(lo_open=False))  # null: 1 / the number of keys
    crossover_prob: float = setting(0.9, fraction(lo_open=False))
    swapping_prob: float = setting(0.5, fraction(lo_open=False))


@dataclass
class QMC:
    """A quasi-Monte Carlo sequence: points that cover the space evenly."""

    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = setting(None, SEED)
    qmc_type: str = setting("sobol", one_of("sobol", "halton"))
    scramble: bool = setting(False, BOOL)


SAMPLERS: dict[str, type] = {"tpe": TPE, "random": Random, "grid": Grid, "cmaes": CmaEs, "nsgaii": NSGAII, "qmc": QMC}
NAMES = ", ".join(sorted(SAMPLERS))


@dataclass(frozen=True)
class Sampler:
    """A checked sampler config: its name (`hydra/sweeper/sampler=<name>`), seed and other arguments."""

    name: str
    seed: int | None
    arguments: dict[str, Any]


def checked(node: Any) -> Sampler:
    """`hydra.sweeper.sampler` checked: a name of the group (the plain word `tpe` of earlier versions), or a config of
    it, whose `_target_` (as Hydra's plugin writes it) must be the one of its sampler; each setting held to its rule."""
    if isinstance(node, str):
        if node not in SAMPLERS:
            raise UsageError(f"hydra.sweeper.sampler={node} is not allowed; choose the sampler with "
                             f"hydra/sweeper/sampler=<name>, one of: {NAMES}")
        return Sampler(node, None, {})
    values = OmegaConf.to_container(node) if isinstance(node, DictConfig) else node
    if not isinstance(values, dict):
        raise UsageError(f"hydra.sweeper.sampler={shown(values)} is not allowed; choose the sampler with "
                         f"hydra/sweeper/sampler=<name>, one of: {NAMES}")
    target = values.get("_target_")
    name = next((name for name, conf in SAMPLERS.items() if conf._target_ == target), None)
    if name is None:
        raise UsageError(f"hydra.sweeper.sampler._target_={shown(target)} is not allowed; it must be one of: "
                         f"{', '.join(conf._target_ for conf in SAMPLERS.values())} (hydra/sweeper/sampler=<name>: {NAMES})")
    rules = {f.name: f.metadata["rule"] for f in fields(SAMPLERS[name]) if "rule" in f.metadata}
    for key, value in values.items():
        if key == "_target_":
            continue
        if key not in rules:
            raise UsageError(f"hydra.sweeper.sampler.{key} is not a setting of hydra/sweeper/sampler={name}; its "
                             f"settings: {', '.join(rules)} (another sampler: hydra/sweeper/sampler=<name>, one of: {NAMES})")
        if not rules[key].test(value):
            raise UsageError(f"hydra.sweeper.sampler.{key}={shown(value)} is not allowed; it must be {rules[key].allowed}")
    if values.get("group") and not values.get("multivariate", True):
        raise UsageError("hydra.sweeper.sampler.group=true is not allowed with hydra.sweeper.sampler.multivariate=false; "
                         "a group is a multivariate model")
    if name == "cmaes" and importlib.util.find_spec("cmaes") is None:
        raise UsageError(f"hydra/sweeper/sampler=cmaes needs the cmaes package, which is not installed; install it "
                         f"with: {interpreter()} -m pip install cmaes")
    arguments = {key: value for key, value in values.items() if key not in ("_target_", "seed")}
    return Sampler(name, values.get("seed"), arguments)


def build(sampler: Sampler, seed: int, grid: Any) -> Any:
    """The Optuna sampler of `sampler`, drawing from `seed`; `grid()` gives a grid sampler its points."""
    import optuna

    cls = getattr(optuna.samplers, SAMPLERS[sampler.name]._target_.rpartition(".")[2])
    if sampler.name == "grid":
        return cls(grid(), seed=seed)
    return cls(**sampler.arguments, seed=seed)

"""`hydra/sweeper=optuna`: a search of the space typed on the command line, with Optuna, for the best `val/acc_best` of
this project's runs (or several objectives: the Pareto front of accuracy against a cost), or in any Hydra app for the
best number its task returns. Each trial is a job of the sweep's launcher; the study, `<sweep>/optuna.db` or the
database `hydra.sweeper.storage` names, outlives the command (a resume goes on to `n_trials`; several sweeps may share
one study), and a job reaches its trial through that storage (`TrialRecord`) to report and be pruned."""

import logging
import math
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.errors import OverrideParseException
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from src.config import NULL, TEXT, Rule, grammar, must_be, not_allowed, one_of, rule_for, shown, whole
from src import records
from src.errors import ResumeRefused, UsageError, interpreter, missing_package
from src.folders import open_file, write_file
from src.launch import progress
from src.launch import optuna_samplers
from src.launch.console import print_line
from src.launch.sequential_launcher import ProjectLauncher
from src.records import Result

log = logging.getLogger(__name__)

OBJECTIVE = "val/acc_best"
DB = "optuna.db"
RESULTS = "optimization_results.yaml"  # what Hydra's Optuna plugin writes at the end of a search, in its format
FRONT = "pareto_front.png"  # several objectives: the front, accuracy against the cost
SWEEP = "sweep"  # a trial's user attribute: host and sweep folder that asked for it, in a study several sweeps share
RETURNED = "returned"  # a trial's user attribute: its values are what another app's task returned, not metrics
NOT_RUN = "not run"  # a trial's user attribute: asked for after the study had n_trials, so never launched
SCHEMES = ("sqlite", "postgresql")  # a storage URL's
# A driver SQLAlchemy reaches a database through, and the package that installs it (`postgresql://` is psycopg 3's
# in SQLAlchemy 2.1, `postgresql+psycopg2://` psycopg2's)
DRIVERS = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary"}
CALLBACK = "optuna_trial"  # the job's callbacks.optuna_trial
PRUNED_AFTER = "pruned after epoch"  # a trial's user attribute, set by its job's callback
DIRECTION = one_of("maximize", "minimize")


def listing(value: Any, rule: Rule) -> bool:
    return isinstance(value, list) and bool(value) and all(map(rule.test, value))


OBJECTIVE_NAME = Rule(lambda v: isinstance(v, str) and bool(re.fullmatch(r"(?!test/)[A-Za-z]\w*(/[\w.]+)+", v)),
                      "a list of metrics of the run's result, e.g. [val/acc_best, time/s_to_val_acc_0.85] (never a "
                      "test/ figure)")
SETTINGS = {"n_trials": whole(1), "n_jobs": NULL | whole(1), "seed": whole(0),
            "direction": DIRECTION | Rule(lambda v: listing(v, DIRECTION), "a list of them"),
            "objectives": Rule(lambda v: listing(v, OBJECTIVE_NAME), OBJECTIVE_NAME.allowed),
            "storage": NULL | Rule(lambda v: isinstance(v, str) and v != "", "a database URL"),
            "study_name": NULL | TEXT, "pruner": one_of("median", "none")}


def optuna_package() -> Any:
    """Optuna, quiet but for its warnings; its absence is one line naming what installs it."""
    try:
        import optuna
    except ImportError:
        raise missing_package("hydra/sweeper=optuna", "optuna") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def is_url(where: Path | str) -> bool:
    return bool(re.match(r"[a-z][a-z0-9+]*://", str(where)))


def storage(where: Path | str) -> Any:
    """The study's storage: a sweep's file (what optuna-dashboard reads), waiting its turn while a job writes, or the
    database URL the command typed (`checked_url`)."""
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    url = str(where) if is_url(where) else f"sqlite:///{where}"
    timeout = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    for attempt in range(3):
        try:
            return optuna_package().storages.RDBStorage(url, engine_kwargs=timeout)
        except (IntegrityError, ProgrammingError):  # two sweeps made a new database's tables at once: now they exist
            if attempt == 2:
                raise


def masked(url: str) -> str:
    """A URL as lines show it: its password hidden."""
    from sqlalchemy.engine import make_url

    try:
        return records.shown(make_url(url).render_as_string(hide_password=True))
    except Exception:  # not a URL SQLAlchemy reads: shown as the scheme alone
        return records.shown(url.split("://")[0] + "://...")


def checked_url(url: str) -> str:
    """`hydra.sweeper.storage`, typed by the user (never taken from a record): sqlite:/// or postgresql://, with the
    driver that reaches it installed."""
    from sqlalchemy.engine import make_url

    scheme = url.split("://")[0] if is_url(url) else ""
    line = f"hydra.sweeper.storage={masked(url)} is not allowed; "
    if scheme.split("+")[0] not in SCHEMES or scheme == "sqlite" and not url.startswith("sqlite:///"):
        raise UsageError(line + "it must be a database URL: sqlite:///<file> or postgresql://<user>@<host>/<database> "
                                "(null: <sweep>/optuna.db)")
    try:
        dialect = make_url(url).get_dialect()
        dialect.import_dbapi()
    except ImportError:
        package = DRIVERS.get(dialect.driver, dialect.driver)
        raise UsageError(f"hydra.sweeper.storage={scheme}://... needs the {package} package, which is not installed; "
                         f"install it with: {interpreter()} -m pip install '{package}'") from None
    except Exception as error:  # SQLAlchemy's: a driver it does not know
        raise UsageError(line + " ".join(str(error).split())[:160]) from None
    return url


@dataclass(frozen=True)
class TrialResult(Result):
    pruned: bool = False


class TrialRecord:
    """One trial of a sweep's study, reached through the study's storage (its file, or the URL the command typed) by
    the study's id and the trial's number (never by the study's name: a name is text from the storage, and a job's
    overrides pass through Hydra's grammar)."""

    def __init__(self, db: str, study: int, number: int) -> None:
        optuna, store, self.number = optuna_package(), storage(db), number
        self.study = optuna.load_study(study_name=store.get_study_name_from_id(study), storage=store)
        median = self.study.user_attrs.get("pruner") == "median"
        self.study.pruner = optuna.pruners.MedianPruner() if median else optuna.pruners.NopPruner()
        self.reported = set(self.study.trials[number].intermediate_values)  # epochs a stopped attempt reported
        # The id Optuna's `Trial` is made by, which only the storage tells from the trial's number
        trial_id = store.get_trial_id_from_study_id_trial_number(study, number)
        # Trial's documented constructor: Optuna has no other way to report to, or ask the pruner about, a trial
        # asked for in another process (ask-and-tell's `tell` takes final values only).
        self.trial = optuna.trial.Trial(self.study, trial_id)

    def report(self, epoch: int, value: float, last: bool = False) -> bool:
        """True where the pruner gives the trial up; never after the `last` epoch, where nothing is left to save and
        the trial is complete (one-epoch trials were all marked pruned)."""
        if len(self.study.directions) > 1:  # Optuna reports and prunes single-objective trials only
            return False
        if epoch not in self.reported:
            self.trial.report(value, epoch)
            self.reported.add(epoch)
        if last or not self.trial.should_prune():
            return False
        self.trial.set_user_attr(PRUNED_AFTER, epoch + 1)
        # a warning: the one line of the job's log that its end line on the sweep's terminal says (why it stopped early)
        log.warning(f"trial {self.number + 1} pruned after epoch {epoch + 1}: val/acc={value:.4f} is below the median of "
                 "the trials before it at that epoch; it stops here, and is tested")
        return True

    def told(self, result: Any, folder: str) -> Any:
        """The study told the trial's values: this project's `Result` by its metrics (`hydra.sweeper.objectives`),
        any other app's by the number (or a list of numbers, one per direction) its task returned; anything else
        fails the trial in one line."""
        directions = [d.name.lower() for d in self.study.directions]
        if not isinstance(result, Result):
            values = returned(result, len(directions))
            if values is None:
                self.tell("FAIL")
                wanted = "a number" if len(directions) == 1 else f"a list of {len(directions)} numbers, one per direction"
                raise UsageError(f"trial {self.number + 1} cannot be judged: its task returned {returned_kind(result)}; "
                                 f"hydra/sweeper=optuna takes {wanted} (hydra.sweeper.direction={shown_list(directions)}) "
                                 "from the task of a Hydra app")
            self.trial.set_user_attr(RETURNED, True)
            self.tell("COMPLETE", values)
            return result
        names, values = objective_names(self.study), []
        for name, direction in zip(names, directions):
            value = objective(result, name, direction)
            if value is None:
                self.tell("FAIL")
                why = ("ran no validation" if name.startswith("val/") else "timed no such target: add it to "
                       "callbacks.time_to_accuracy.targets" if name.startswith(records.HPARAMS_TO_TARGET)
                       else "recorded no such figure in its result")
                raise UsageError(f"trial {self.number + 1} has no {name} to be judged by: {folder} {why}")
            values.append(value)
        for name, value in [*zip(names, values), ("test/acc", result.metrics.get("test/acc"))]:
            if value is not None:
                self.trial.set_user_attr(name, value)
        pruned = PRUNED_AFTER in self.study.trials[self.number].user_attrs
        self.tell("PRUNED" if pruned else "COMPLETE", None if pruned else values)
        return TrialResult(**asdict(result), pruned=pruned)

    def tell(self, state: str, values: list[float] | None = None) -> None:
        from optuna.trial import TrialState

        self.study.tell(self.number, values, state=TrialState[state], skip_if_finished=True)


def returned(value: Any, count: int) -> list[float] | None:
    """A task's return as the study's values: a number, or a list or tuple of `count` numbers; None for anything else
    (NaN too, which Optuna cannot rank)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in values)
    return [float(v) for v in values] if numbers and len(values) == count else None


def returned_kind(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}: {records.bounded(value)}"
    if isinstance(value, str):
        return f"the text {records.bounded(repr(value))}"
    return records.bounded(value) if isinstance(value, (int, float)) else type(value).__name__


def shown_list(values: list[str]) -> str:
    return values[0] if len(values) == 1 else f"[{', '.join(values)}]"


def objective(result: Result, name: str, direction: str) -> float | None:
    """A run's figure by its name: a metric of its result, or the training seconds to a target val/acc
    (`time/s_to_val_acc_<t>`), which count as the worst value there is (inf, minimized) where the run did not reach
    it; None where the result has no such figure."""
    value = result.metrics.get(name)
    if not name.startswith(records.HPARAMS_TO_TARGET):
        return value
    target = name[len(records.HPARAMS_TO_TARGET):]
    entries = [entry for entry in result.time_to_accuracy if records.target_name(entry["target"]) == target]
    if not entries and value is None:
        return None
    seconds = entries[0]["seconds"] if entries else value
    if seconds is None or seconds == records.NOT_REACHED:
        return math.inf if direction == "minimize" else -math.inf
    return float(seconds)


def objective_names(study: Any) -> list[str]:
    """The metrics the study's values are (as the sweeper set them: typed names), one per direction."""
    names = study.user_attrs.get("objectives")
    if isinstance(names, list) and len(names) == len(study.directions) and all(map(OBJECTIVE_NAME.test, names)):
        return names
    return [OBJECTIVE] * len(study.directions)


@dataclass
class TrialTask:
    """Tells the study how the job ended; a stop signal (SystemExit) leaves the trial running, to resume."""

    task: TaskFunction

    def __call__(self, cfg: DictConfig) -> Any:
        from hydra.core.hydra_config import HydraConfig

        where, output_dir = cfg.callbacks[CALLBACK], OmegaConf.select(cfg, "output_dir")  # another app has none
        trial = TrialRecord(where.db, where.study, where.trial)
        folder = Path(output_dir or HydraConfig.get().runtime.output_dir).name
        trial.trial.set_user_attr("folder", folder)
        try:
            result = self.task(cfg)
        except ResumeRefused:
            raise  # nothing ran: the trial stays as it was
        except Exception:
            trial.tell("FAIL")
            raise
        return trial.told(result, folder)


@dataclass
class Space:
    """A distribution per swept key, each categorical key's choices as typed, and the overrides every trial takes."""

    distributions: dict[str, Any] = field(default_factory=dict)
    typed: dict[str, list[str]] = field(default_factory=dict)
    fixed: list[str] = field(default_factory=list)
    typed_as: dict[str, str] = field(default_factory=dict)  # each swept key's value as typed, for a line naming it

    def overrides(self, params: dict[str, Any]) -> list[str]:
        return [*self.fixed, *(f"{key}={self.typed[key][int(dist.to_internal_repr(params[key]))]}" if key in self.typed
                               else f"{key}={params[key]}" for key, dist in self.distributions.items())]

    def holds(self, params: dict[str, Any]) -> bool:
        """Whether a stored trial's point lies in this space: its keys, each a choice as typed, or a number of its
        distribution's type (a whole number for an int one), in range and on its step."""
        def inside(value: Any, dist: Any) -> bool:
            if hasattr(dist, "choices"):
                return any(type(value) is type(choice) and value == choice for choice in dist.choices)
            kind = int if isinstance(dist, optuna_package().distributions.IntDistribution) else float
            if type(value) is not kind or not dist.low <= value <= dist.high:
                return False
            steps = (value - dist.low) / (dist.step or 1)
            return dist.step is None or math.isclose(steps, round(steps), abs_tol=1e-8)

        return params.keys() == self.distributions.keys() and all(
            inside(value, self.distributions[key]) for key, value in params.items())

    def corners(self) -> list[dict[str, Any]]:
        """The space's lowest point, then each other end or choice of one key at a time."""
        ends = {key: list(getattr(dist, "choices", None) or (dist.low, dist.high)) for key, dist in self.distributions.items()}
        low = {key: values[0] for key, values in ends.items()}
        return [low, *({**low, key: value} for key, values in ends.items() for value in values[1:])]

    def grid(self) -> dict[str, list[Any]]:
        """Each key's points for `hydra/sweeper/sampler=grid`: its choices, or every step from low to high."""
        points: dict[str, list[Any]] = {}
        for key, dist in self.distributions.items():
            if hasattr(dist, "choices"):
                points[key] = list(dist.choices)
            elif dist.step is None:
                raise UsageError(f"hydra/sweeper/sampler=grid is not allowed with {key}={self.typed_as[key]}: a grid takes "
                                 "choice(), a,b,c, range() and int(interval()), never a continuous interval()")
            else:
                count = round((dist.high - dist.low) / dist.step) + 1
                points[key] = [dist.low + i * dist.step for i in range(count)]
        return points


PLAIN = (str, int, float, bool, type(None))  # what a categorical's choice may be (Optuna's and the plugin's)


def search_space(arguments: Sequence[str]) -> Space:
    """Hydra's Optuna plugin's grammar and meaning: `interval(a, b)` a float, `int(interval(a, b))` an int (or
    `tag(int, interval(a, b))`), `tag(log, ...)` either on a log scale; `range(a, b[, step=s])` an int (a float where a
    bound or the step is one) from a to b inclusive, in steps; `choice(...)`, `a,b,c` and `shuffle(...)` a categorical
    of plain values. Anything else is one line."""
    distributions, space = optuna_package().distributions, Space()
    for override in parsed(arguments):
        key, value, line = override.get_key_element(), override.value(), f"{override.input_line} is not allowed; "
        if not override.is_sweep_override():
            space.fixed.append(str(override.input_line))
            continue
        if not isinstance(value, (IntervalSweep, ChoiceSweep, RangeSweep)):  # glob() names config files, not a space
            raise UsageError(line + "hydra/sweeper=optuna searches interval(), choice(), range() and a,b,c")
        tags = set(getattr(value, "tags", ()))
        if tags - {"log", "int"} or tags and not override.is_interval_sweep():
            raise UsageError(line + "the tags it knows are log and int, on an interval(): tag(log, interval(0.001, 0.1))")
        shuffled = getattr(value, "shuffle", False)
        if shuffled:  # a categorical: the order of its choices is the sampler's to draw, never the parser's
            value.shuffle = False
        space.typed_as[key] = str(override.input_line).partition("=")[2]
        try:
            if override.is_interval_sweep():
                integral = "int" in tags or isinstance(value.start, int) and isinstance(value.end, int)
                kind, cast = (distributions.IntDistribution, int) if integral else (distributions.FloatDistribution, float)
                space.distributions[key] = kind(cast(value.start), cast(value.end), log="log" in tags)
            elif override.is_range_sweep() and not shuffled:
                integral = all(isinstance(bound, int) for bound in (value.start, value.stop, value.step))
                kind, cast = (distributions.IntDistribution, int) if integral else (distributions.FloatDistribution, float)
                space.distributions[key] = kind(cast(value.start), cast(value.stop), step=cast(value.step))
            else:
                choices = list(override.sweep_iterator())
                if not all(isinstance(choice, PLAIN) for choice in choices):
                    raise UsageError(line + "a choice of hydra/sweeper=optuna is a plain value (text, a number, true, "
                                            "false or null), not a list or a mapping")
                space.distributions[key] = distributions.CategoricalDistribution(choices)
                space.typed[key] = list(override.sweep_string_iterator())
        except ValueError as error:
            raise UsageError(line + " ".join(str(error).split())) from None
    if not space.distributions:
        raise UsageError("hydra/sweeper=optuna needs a space to search: a key typed with interval(), choice() or "
                         "range(), e.g. 'optim.lr=tag(log, interval(0.001, 0.1))'")
    return space


def parsed(arguments: Sequence[str]) -> list[Any]:
    """Each argument in Hydra's override grammar, or the line that says which is not."""
    overrides = []
    for argument in arguments:
        try:
            overrides += OverridesParser.create().parse_overrides([argument])
        except OverrideParseException as error:
            raise grammar(argument, error) from None
    return overrides


def with_params(params: Any, arguments: Sequence[str]) -> list[str]:
    """A config's space (`hydra.sweeper.params`, key -> override as Hydra's plugin takes it), less the keys the command
    line types again, then the command line's overrides: the command line wins."""
    if params is None:
        params = {}
    if not isinstance(params, dict) or not all(isinstance(v, (str, int, float, bool)) for v in params.values()):
        raise UsageError(f"hydra.sweeper.params={shown(params)} is not allowed; it must be a mapping of keys to "
                         "overrides, e.g. {optim.lr: 'tag(log, interval(0.001, 0.1))', data.batch_size: 'choice(64, 128)'}")
    typed = {override.key_or_group for override in parsed(arguments)}
    lines = [f"{key}={shown(value)}" for key, value in params.items()]
    return [line for line, override in zip(lines, parsed(lines)) if override.key_or_group not in typed] + list(arguments)


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        optuna_package()
        settings = {name: OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
                    for name, value in settings.items()}  # plain values: the study keeps them (set_user_attr)
        for name, rule in SETTINGS.items():
            if not rule.test(settings[name]):
                raise UsageError(f"hydra.sweeper.{name}={shown(settings[name])} is not allowed; it must be {rule.allowed}")
        directions = settings["direction"] if isinstance(settings["direction"], list) else [settings["direction"]]
        if len(settings["objectives"]) != len(directions):
            raise UsageError(f"hydra.sweeper.objectives={shown_list(settings['objectives'])} is not allowed with "
                             f"hydra.sweeper.direction={shown_list(directions)}: it must name one metric per direction, "
                             "e.g. objectives=[val/acc_best,time/s_to_val_acc_0.85] direction=[maximize,minimize]")
        if settings["storage"] is not None:
            checked_url(settings["storage"])
        self.sampler, self.space = optuna_samplers.checked(settings.get("sampler", "tpe")), Space()
        with_params(settings.get("params"), [])  # a config's space, in Hydra's grammar, checked before anything runs
        self.settings, self.config, self.hydra_context, self.launcher = settings, None, None, None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context, config=config,
                                                                task_function=TrialTask(task_function))

    def sweep(self, arguments: list[str]) -> list[JobReturn]:
        from optuna.trial import TrialState

        assert self.config is not None and self.launcher is not None
        space = self.space = search_space(with_params(self.settings.get("params"), arguments))
        self.check(space)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        study, n_trials = self.open_study(sweep_dir), self.settings["n_trials"]
        if self.sampler.name == "grid":  # beyond its points a grid would ask them again
            n_trials = min(n_trials, math.prod(len(points) for points in space.grid().values()))
        for trial in study.trials:  # a study is a file of the folder: its stored points are values of this space alone
            if trial.params and not space.holds(trial.params):
                raise UsageError(f"{self.where(sweep_dir)}: trial {trial.number + 1} holds "
                                 f"{records.shown(settings(trial))}, outside the space of this command (the command line's and hydra.sweeper.params); continue the search "
                                 "with the space it was started with, or start a new one in another folder")
        write_file(sweep_dir / "multirun.yaml", OmegaConf.to_yaml(self.config))  # what job folders are named by, and a resume takes
        url, tag = self.settings["storage"], self.tag(sweep_dir)
        if len(self.directions()) > 1 and self.settings["pruner"] != "none":
            print_line(f"hydra.sweeper.pruner={self.settings['pruner']} is off: Optuna prunes single-objective searches only")

        def counted() -> int:  # the study's trials, from every sweep that shares it, less those asked past n_trials
            return sum(NOT_RUN not in trial.user_attrs for trial in study.get_trials(deepcopy=False))

        # An earlier command's, stopped: in a study several sweeps share, this folder's alone (another's may be running)
        left = [trial for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if url is None or trial.user_attrs.get(SWEEP) == tag]
        ended = counted() - len(left)
        progress.tally = progress.Tally(total=max(n_trials, counted()), before=ended, sweep_dir=sweep_dir,
                                        noun="trial", note=lambda: best(study, sweep_dir, note=True))
        new = max(0, n_trials - counted())
        db, node = quoted(url or str(sweep_dir.absolute() / DB)), f"+callbacks.{CALLBACK}"
        study_id = storage(url or sweep_dir / DB).get_study_id_from_name(study.study_name)

        def reaching(number: int) -> list[str]:  # the callback through which a job reaches its trial
            return [f"{node}._target_=src.callbacks.optuna_trial.ReportToTrial", f"{node}.db={db}",
                    f"{node}.study={study_id}", f"{node}.trial={number}"]

        def next_trial() -> tuple[int, list[str]] | None:
            """The next trial left running by an earlier command, else a new one while the search asks for more."""
            nonlocal new
            if left:
                trial = left.pop(0)
            elif new and counted() < n_trials:  # another sweep of the study may have asked meanwhile
                trial, new = study.ask(space.distributions), new - 1
                trial.set_user_attr(SWEEP, tag)
                if sum(NOT_RUN not in t.user_attrs for t in study.get_trials(deepcopy=False) if t.number < trial.number
                       ) >= n_trials:  # another sweep asked for the last one first: Optuna numbers trials in turn
                    trial.set_user_attr(NOT_RUN, f"asked for after the study had its n_trials={n_trials}")
                    study.tell(trial, state=TrialState.FAIL)
                    return None
            else:
                return None
            return trial.number, [*space.overrides(trial.params), *reaching(trial.number)]

        def failed_unless_told(number: int, job: JobReturn) -> None:
            """A job that ended without telling its trial (killed, say) failed it; a refused resume leaves it to resume."""
            if not isinstance(progress.value(job), ResumeRefused):
                study.tell(number, state=TrialState.FAIL, skip_if_finished=True)

        if isinstance(self.launcher, ProjectLauncher):  # a search already at n_trials launches nothing
            returns = self.launcher.launch_each(next_trial, len(left) + new, ended, self.settings["n_jobs"],
                                                failed_unless_told) if left or new else []
        else:  # a launcher that takes batches (SLURM's): each after the last has ended, numbered one after another
            returns, at_once, held = [], self.settings["n_jobs"] or 1, None
            while (first := held or next_trial()) is not None:
                batch, held = [first], None
                while len(batch) < at_once and (held := next_trial()) is not None and held[0] == batch[-1][0] + 1:
                    batch.append(held)
                    held = None
                launched = self.launcher.launch([overrides for _, overrides in batch], initial_job_idx=first[0])
                for (number, _), job in zip(batch, launched):
                    failed_unless_told(number, job)
                returns += launched
        write_results(study, sweep_dir)
        progress.tally.appendix = trials_table(study, sweep_dir, url)
        print_line(best(study, sweep_dir, url=url))
        for job in returns:  # a failed trial fails the sweep, as Hydra's own sweepers raise its error (said as it ended)
            if isinstance(error := progress.value(job), Exception):
                raise error
        return returns

    def where(self, sweep_dir: Path) -> str:
        """The study's storage, as lines name it (a URL's password hidden)."""
        url = self.settings["storage"]
        return str(sweep_dir / DB) if url is None else masked(url)

    def check(self, space: Space) -> None:
        """The space's ends and choices composed and held to their keys' rules before any trial exists (the rules across
        keys are the job's to check)."""
        assert self.hydra_context is not None and self.config is not None
        for point in space.corners():
            self.hydra_context.config_loader.load_sweep_config(self.config, space.overrides(point))
            for key, value in point.items():
                rule = rule_for(key.lstrip("+"))
                if rule is not None and not rule.test(value):
                    raise not_allowed(key, value, must_be(key, value, rule))

    def new_sampler(self, asked: int) -> Any:
        """The sampler `hydra/sweeper/sampler` names, seeded with its seed (or `hydra.sweeper.seed`) plus the trials
        asked for so far, so that a resume does not ask again what the first command asked."""
        seed = self.settings["seed"] if self.sampler.seed is None else self.sampler.seed
        return optuna_samplers.build(self.sampler, (seed + asked) % 2**32, self.space.grid)

    def open_study(self, sweep_dir: Path) -> Any:
        """The sweep folder's study, made or resumed, its sampler seeded anew so that a resume does not ask again what
        the first command asked."""
        optuna, db, directions, url = optuna_package(), sweep_dir / DB, self.directions(), self.settings["storage"]
        if url is None and db.exists() and OmegaConf.select(self.config, "ckpt_path") != "auto":
            raise UsageError(f"hydra.sweep.dir={sweep_dir} holds the study of an earlier search ({db}); continue it with "
                             "ckpt_path=auto, or give another folder")
        if url is None and os.path.lexists(db):  # the study is a file of the sweep's own: never a link, a FIFO or a hard link
            os.close(open_file(db, os.O_RDWR, root=sweep_dir))
        try:
            existed, name = url is None and db.exists(), self.settings["study_name"]
            store = storage(url or db)
            if name is None:  # the one study of the folder's file, or one named by the folder
                name = optuna.get_all_study_names(store)[0] if existed else sweep_dir.name
            study = optuna.create_study(storage=store, study_name=name, directions=directions, load_if_exists=True)
            _ = study.trials, study.directions  # read now: a damaged file fails here, not halfway through the search
        except Exception as error:  # sqlite's, SQLAlchemy's and a server's, or a study without a name
            reason = " ".join(str(error).split())[:160] or type(error).__name__
            if url is not None:
                raise UsageError(f"hydra.sweeper.storage={masked(url)}: cannot be reached or read as an Optuna study "
                                 f"({records.shown(reason)})") from None
            raise UsageError(f"{db}: cannot be read as an Optuna study ({reason}); move it away to start the search "
                             "over, or give another hydra.sweep.dir") from None
        held = [d.name.lower() for d in study.directions]
        if held != directions:
            raise UsageError(f"hydra.sweeper.direction={shown_list(directions)} is not allowed in a resume of "
                             f"{sweep_dir}: its study's direction is {shown_list(held)}")
        objectives = objective_names(study) if "objectives" in study.user_attrs else self.settings["objectives"]
        if objectives != self.settings["objectives"]:
            raise UsageError(f"hydra.sweeper.objectives={shown_list(self.settings['objectives'])} is not allowed in a "
                             f"resume of {sweep_dir}: its study's objectives are {shown_list(objectives)}")
        if url is not None and OmegaConf.select(self.config, "ckpt_path") != "auto" and any(
                trial.user_attrs.get(SWEEP) == self.tag(sweep_dir) for trial in study.trials):
            raise UsageError(f"hydra.sweep.dir={sweep_dir} ran trials of the study {records.shown(study.study_name)} "
                             "before; continue them with ckpt_path=auto, or give another folder")
        study.sampler = self.new_sampler(len(study.trials))
        for name, value in {**self.settings, "objective": objectives[0], "storage": None if url is None else "typed",
                            "pruner": "none" if len(directions) > 1 else self.settings["pruner"]}.items():
            if study.user_attrs.get(name) != value:  # a study several sweeps share: each writes what differs
                study.set_user_attr(name, value)
        return study

    def directions(self) -> list[str]:
        direction = self.settings["direction"]
        return direction if isinstance(direction, list) else [direction]

    @staticmethod
    def tag(sweep_dir: Path) -> str:
        """Who asked for a trial, in a study several sweeps (on several machines) share: only the sweep that asked
        for a trial may run it again."""
        return f"{socket.gethostname()}:{sweep_dir.absolute()}"


def quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def settings(trial: Any) -> str:
    return " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in trial.params.items())


def labels(study: Any) -> list[str]:
    """What the study's values are called: this project's metrics (`objective_names`), or another app's number
    `value` (several: the names `hydra.sweeper.objectives` gave them)."""
    names = objective_names(study)
    if len(names) == 1 and any(RETURNED in trial.user_attrs for trial in study.get_trials(deepcopy=False)):
        return ["value"]
    return names


def place(trial: Any, sweep_dir: Path) -> str:
    """A trial's folder: under this sweep's, or (a study several sweeps share) under the one that ran it."""
    folder, asked = trial.user_attrs.get("folder"), trial.user_attrs.get(SWEEP)
    if not folder:
        return ""
    mine = asked is None or asked == OptunaSweeper.tag(sweep_dir)
    return records.shown(sweep_dir / folder if mine else f"{asked}/{folder}")


def opened_by(url: str | None, sweep_dir: Path) -> str:
    return f"the study: optuna-dashboard {masked(url) if url else f'sqlite:///{sweep_dir.absolute() / DB}'}"


def valued(trial: Any, names: list[str]) -> str:
    return " ".join(f"{name}={figure(value)}" for name, value in zip(names, trial.values or []))


def best(study: Any, sweep_dir: Path, note: bool = False, url: str | None = None) -> str:
    """The best trial's settings, objective, test accuracy and folder (several objectives: the trials of the Pareto
    front), and the study's storage, as a terminal shows them (the storage may have been written by anyone); as a
    progress line's `note`, the objective and the trial alone."""
    names, front = labels(study), list(study.best_trials)
    if len(names) > 1:
        if note:
            return "" if not front else f"{len(front)} on the Pareto front"
        listed = ", ".join(f"trial {t.number + 1} ({settings(t)}: {valued(t, names)}"
                           + (f" -> {place(t, sweep_dir)}" if place(t, sweep_dir) else "") + ")" for t in front)
        return records.shown(f"Pareto front of {len(study.trials)} trials: {listed or 'none completed'}; "
                             f"{opened_by(url, sweep_dir)}")
    top = next(iter(front), None)
    if note:
        return "" if top is None else f"best {names[0]}={top.value:.4f} (trial {top.number + 1})"
    if top is None:
        return records.shown(f"no trial of {len(study.trials)} completed; {opened_by(url, sweep_dir)}")
    test, folder = top.user_attrs.get("test/acc"), place(top, sweep_dir)
    return records.shown(
        f"best of {len(study.trials)} trials: trial {top.number + 1}, {settings(top)}: {names[0]}={top.value:.4f}"
        + (f" test/acc={figure(test)}" if test is not None else "") + (f" -> {folder}" if folder else "")
        + f"; {opened_by(url, sweep_dir)}")


def figure(value: Any) -> str:
    """A trial's accuracy as four decimals (a target not reached: inf); anything else the storage holds there, as
    text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4f}" if math.isfinite(value) else f"{value}"
    return records.shown(value)


def trials_table(study: Any, sweep_dir: Path, url: str | None = None) -> str:
    """The trials, for the sweep's report, and with several objectives the Pareto front (its plot, `FRONT`); what the
    study's storage says, in Markdown that shows it as written."""
    from src.report import markdown_cell

    names, directions = labels(study), [d.name.lower() for d in study.directions]
    states = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "stopped", "WAITING": "waiting"}

    def cells(t: Any) -> str:
        values = dict(zip(names, t.values or []))
        return "".join(f" | {markdown_cell(figure(t.user_attrs.get(name, values.get(name))))}"
                       if name in t.user_attrs or name in values else " | " for name in (*names, "test/acc"))

    rows = [f"| {t.number + 1} | {'not run' if NOT_RUN in t.user_attrs else states[t.state.name]}"
            + (f" after epoch {markdown_cell(t.user_attrs[PRUNED_AFTER])}" if PRUNED_AFTER in t.user_attrs else "")
            + cells(t) + f" | {markdown_cell(settings(t))} | {markdown_cell(place(t, sweep_dir))} |"
            for t in study.trials]
    judged = ", ".join(f"{name} {direction}d" for name, direction in zip(names, directions))
    columns = ["trial", "state", *names, "test/acc", "settings", "folder"]
    table = [f"| {' | '.join(columns)} |", "| " + " | ".join(["---"] * len(columns)) + " |"]
    lines = ["", f"## Trials (hydra/sweeper=optuna, {judged})", "", markdown_cell(best(study, sweep_dir, url=url)), "",
             *table, *rows, ""]
    if len(names) > 1:
        front = [t for t in study.best_trials]
        lines += [f"### Pareto front: {len(front)} of {len(study.trials)} trials", "",
                  f"No other trial is better in one of {', '.join(names)} without being worse in another.", "",
                  *([f"![the front: {names[0]} against {names[1]}]({FRONT})", ""] if (sweep_dir / FRONT).is_file() else []),
                  *table, *(f"| {t.number + 1} | complete{cells(t)} | {markdown_cell(settings(t))} | "
                            f"{markdown_cell(place(t, sweep_dir))} |" for t in front), ""]
    return "\n".join(lines)


def write_results(study: Any, sweep_dir: Path) -> None:
    """`<sweep>/optimization_results.yaml` as Hydra's Optuna plugin writes it (`name: optuna`, then `best_params` and
    `best_value`, or with several objectives `solutions`: each trial of the Pareto front's `params` and `values`), and
    with several objectives the plot of the front (`FRONT`); nothing where no trial completed."""
    import yaml

    front = list(study.best_trials)
    if not front:
        return
    if len(study.directions) == 1:
        data = {"name": "optuna", "best_params": dict(front[0].params), "best_value": front[0].value}
    else:
        data = {"name": "optuna", "solutions": [{"params": dict(t.params), "values": list(t.values)} for t in front]}
        plot_front(study, sweep_dir / FRONT)
    write_file(sweep_dir / RESULTS, yaml.safe_dump(data, sort_keys=False))


def plot_front(study: Any, path: Path) -> None:
    """The first objective against the second: every completed trial, the front's joined and numbered (trials whose
    cost is infinite, a target not reached, are left out and counted in the title)."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figure state

    from src.folders import figure_bytes

    names, front = labels(study), {t.number for t in study.best_trials}
    done = [t for t in study.get_trials(deepcopy=False) if t.values and len(t.values) >= 2]
    drawn = [t for t in done if all(math.isfinite(v) for v in t.values[:2])]
    figure = Figure(figsize=(8, 5))
    axes = figure.add_subplot()
    axes.scatter([t.values[1] for t in drawn], [t.values[0] for t in drawn], color="0.7", label="a trial")
    line = sorted((t.values[1], t.values[0], t.number) for t in drawn if t.number in front)
    axes.plot([x for x, _, _ in line], [y for _, y, _ in line], "o-", color="tab:blue",
              label="the Pareto front")
    for x, y, number in line:
        axes.annotate(f"trial {number + 1}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
    left_out = len(done) - len(drawn)
    axes.set(xlabel=names[1], ylabel=names[0], title=f"{names[0]} against {names[1]}"
             + (f" ({left_out} trials with an infinite value left out)" if left_out else ""))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    write_file(path, figure_bytes(figure, dpi=120))

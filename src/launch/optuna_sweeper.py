"""`hydra/sweeper=optuna`: a search of the space typed on the command line for the best `val/acc_best`, with Optuna.
Each trial is a job of the sweep's launcher; the study, `<sweep>/optuna.db`, outlives the command (a resume goes on to
`n_trials`), and a job reaches its trial through that file (`TrialRecord`) to report and be pruned."""

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from src.config import NULL, must_be, not_allowed, one_of, rule_for, shown, whole
from src import records
from src.errors import ResumeRefused, UsageError, missing_package
from src.folders import open_file, write_file
from src.launch import progress
from src.launch.console import print_line
from src.launch.sequential_launcher import ProjectLauncher
from src.records import Result

log = logging.getLogger(__name__)

OBJECTIVE = "val/acc_best"
DB = "optuna.db"
CALLBACK = "optuna_trial"  # the job's callbacks.optuna_trial
PRUNED_AFTER = "pruned after epoch"  # a trial's user attribute, set by its job's callback
SETTINGS = {"n_trials": whole(1), "n_jobs": NULL | whole(1), "seed": whole(0), "sampler": one_of("tpe", "random"),
            "direction": one_of("maximize", "minimize"), "pruner": one_of("median", "none")}


def optuna_package() -> Any:
    """Optuna, quiet but for its warnings; its absence is one line naming what installs it."""
    try:
        import optuna
    except ImportError:
        raise missing_package("hydra/sweeper=optuna", "optuna") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage(db: Path | str) -> Any:
    """The study's file (what optuna-dashboard reads), waiting its turn while a job writes."""
    return optuna_package().storages.RDBStorage(f"sqlite:///{db}", engine_kwargs={"connect_args": {"timeout": 60}})


@dataclass(frozen=True)
class TrialResult(Result):
    pruned: bool = False


class TrialRecord:
    """One trial of a sweep's study, reached through the study's file by the study's id and the trial's number (never
    by the study's name: a name is text from the file, and a job's overrides pass through Hydra's grammar)."""

    def __init__(self, db: str, study: int, number: int) -> None:
        optuna, store, self.number = optuna_package(), storage(db), number
        self.study = optuna.load_study(study_name=store.get_study_name_from_id(study), storage=store)
        median = self.study.user_attrs.get("pruner") == "median"
        self.study.pruner = optuna.pruners.MedianPruner() if median else optuna.pruners.NopPruner()
        self.reported = set(self.study.trials[number].intermediate_values)  # epochs a stopped attempt reported
        # The id Optuna's `Trial` is made by, which only the storage tells from the trial's number
        trial_id = store.get_trial_id_from_study_id_trial_number(study, number)
        self.trial = optuna.trial.Trial(self.study, trial_id)

    def report(self, epoch: int, value: float, last: bool = False) -> bool:
        """True where the pruner gives the trial up; never after the `last` epoch, where nothing is left to save and
        the trial is complete (one-epoch trials were all marked pruned)."""
        if epoch not in self.reported:
            self.trial.report(value, epoch)
            self.reported.add(epoch)
        if last or not self.trial.should_prune():
            return False
        self.trial.set_user_attr(PRUNED_AFTER, epoch + 1)
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
                self.trial.set_user_attr(name, metrics[name])
        pruned = PRUNED_AFTER in self.study.trials[self.number].user_attrs
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

    def overrides(self, params: dict[str, Any]) -> list[str]:
        return [*self.fixed, *(f"{key}={self.typed[key][int(dist.to_internal_repr(params[key]))]}" if key in self.typed
                               else f"{key}={params[key]}" for key, dist in self.distributions.items())]

    def holds(self, params: dict[str, Any]) -> bool:
        """Whether a stored trial's point lies in this space: its keys, each a choice as typed or a number in range."""
        def inside(value: Any, dist: Any) -> bool:
            if hasattr(dist, "choices"):
                return any(type(value) is type(choice) and value == choice for choice in dist.choices)
            return type(value) in (int, float) and dist.low <= value <= dist.high

        return params.keys() == self.distributions.keys() and all(
            inside(value, self.distributions[key]) for key, value in params.items())

    def corners(self) -> list[dict[str, Any]]:
        """The space's lowest point, then each other end or choice of one key at a time."""
        ends = {key: list(getattr(dist, "choices", None) or (dist.low, dist.high)) for key, dist in self.distributions.items()}
        low = {key: values[0] for key, values in ends.items()}
        return [low, *({**low, key: value} for key, values in ends.items() for value in values[1:])]


def search_space(arguments: Sequence[str]) -> Space:
    """`interval(a, b)` a float (`tag(int, ...)` an int, `tag(log, ...)` on a log scale), `choice(...)`, `a,b,c` and
    `range(...)` a categorical; anything else is one line."""
    distributions, space = optuna_package().distributions, Space()
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        key, value, line = override.get_key_element(), override.value(), f"{override.input_line} is not allowed; "
        if not override.is_sweep_override():
            space.fixed.append(str(override.input_line))
            continue
        if not isinstance(value, (IntervalSweep, ChoiceSweep, RangeSweep)):  # glob() names config files, not a space
            raise UsageError(line + "hydra/sweeper=optuna searches interval(), choice(), range() and a,b,c")
        tags = set(value.tags)
        if tags - {"log", "int"} or tags and not override.is_interval_sweep():
            raise UsageError(line + "the tags it knows are log and int, on an interval(): tag(log, interval(0.001, 0.1))")
        try:
            if override.is_interval_sweep():
                kind, cast = (distributions.IntDistribution, int) if "int" in tags else (distributions.FloatDistribution, float)
                space.distributions[key] = kind(cast(value.start), cast(value.end), log="log" in tags)
            else:
                space.distributions[key] = distributions.CategoricalDistribution(list(override.sweep_iterator()))
                space.typed[key] = list(override.sweep_string_iterator())
        except ValueError as error:
            raise UsageError(line + " ".join(str(error).split())) from None
    if not space.distributions:
        raise UsageError("hydra/sweeper=optuna needs a space to search: a key typed with interval(), choice() or "
                         "range(), e.g. 'optim.lr=tag(log, interval(0.001, 0.1))'")
    return space


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        optuna_package()
        for name, rule in SETTINGS.items():
            if not rule.test(settings[name]):
                raise UsageError(f"hydra.sweeper.{name}={shown(settings[name])} is not allowed; it must be {rule.allowed}")
        self.settings, self.config, self.hydra_context, self.launcher = settings, None, None, None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context, config=config,
                                                                task_function=TrialTask(task_function))

    def sweep(self, arguments: list[str]) -> list[JobReturn]:
        from optuna.trial import TrialState

        assert self.config is not None and self.launcher is not None
        space = search_space(arguments)
        self.check(space)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        study, n_trials = self.open_study(sweep_dir), self.settings["n_trials"]
        for trial in study.trials:  # a study is a file of the folder: its stored points are values of this space alone
            if trial.params and not space.holds(trial.params):
                raise UsageError(f"{sweep_dir / DB}: trial {trial.number + 1} holds "
                                 f"{records.shown(settings(trial))}, outside the space typed; continue the search "
                                 "with the space it was started with, or start a new one in another folder")
        write_file(sweep_dir / "multirun.yaml", OmegaConf.to_yaml(self.config))  # what job folders are named by, and a resume takes
        left = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))  # an earlier command's, stopped
        ended = len(study.trials) - len(left)
        progress.tally = progress.Tally(total=max(n_trials, len(study.trials)), before=ended, sweep_dir=sweep_dir,
                                        noun="trial", note=lambda: best(study, sweep_dir, note=True))
        new = max(0, n_trials - len(study.trials))
        db, node = quoted(str(sweep_dir.absolute() / DB)), f"+callbacks.{CALLBACK}"
        study_id = storage(sweep_dir / DB).get_study_id_from_name(study.study_name)

        def reaching(number: int) -> list[str]:  # the callback through which a job reaches its trial
            return [f"{node}._target_=src.callbacks.optuna_trial.ReportToTrial", f"{node}.db={db}",
                    f"{node}.study={study_id}", f"{node}.trial={number}"]

        def next_trial() -> tuple[int, list[str]] | None:
            """The next trial left running by an earlier command, else a new one while the search asks for more."""
            nonlocal new
            if left:
                trial = left.pop(0)
            elif new:
                trial, new = study.ask(space.distributions), new - 1
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
        progress.tally.appendix = trials_table(study, sweep_dir)
        print_line(best(study, sweep_dir))
        return returns

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

    def open_study(self, sweep_dir: Path) -> Any:
        """The sweep folder's study, made or resumed, its sampler seeded anew so that a resume does not ask again what
        the first command asked."""
        optuna, db, direction = optuna_package(), sweep_dir / DB, self.settings["direction"]
        if db.exists() and OmegaConf.select(self.config, "ckpt_path") != "auto":
            raise UsageError(f"hydra.sweep.dir={sweep_dir} holds the study of an earlier search ({db}); continue it with "
                             "ckpt_path=auto, or give another folder")
        if os.path.lexists(db):  # the study is a file of the sweep's own: never a link, a FIFO or a hard link
            os.close(open_file(db, os.O_RDWR, root=sweep_dir))
        try:
            names = optuna.get_all_study_names(storage(db)) if db.exists() else [sweep_dir.name]
            study = optuna.create_study(storage=storage(db), study_name=names[0], direction=direction, load_if_exists=True)
            _ = study.trials, study.direction  # read now: a damaged file fails here, not halfway through the search
        except Exception as error:  # sqlite's and SQLAlchemy's, or a study without a name
            reason = " ".join(str(error).split())[:160] or type(error).__name__
            raise UsageError(f"{db}: cannot be read as an Optuna study ({reason}); move it away to start the search "
                             "over, or give another hydra.sweep.dir") from None
        if study.direction.name.lower() != direction:
            raise UsageError(f"hydra.sweeper.direction={direction} is not allowed in a resume of {sweep_dir}: its study's "
                             f"direction is {study.direction.name.lower()}")
        sampler = optuna.samplers.TPESampler if self.settings["sampler"] == "tpe" else optuna.samplers.RandomSampler
        study.sampler = sampler(seed=self.settings["seed"] + len(study.trials))
        for name, value in {**self.settings, "objective": OBJECTIVE}.items():
            study.set_user_attr(name, value)
        return study


def quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def settings(trial: Any) -> str:
    return " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in trial.params.items())


def best(study: Any, sweep_dir: Path, note: bool = False) -> str:
    """The best trial's settings, objective, test accuracy and folder, and the study's file, as a terminal shows
    them (the study's file may have been written by anyone); as a progress line's `note`, the objective and the trial
    alone."""
    top = next(iter(study.best_trials), None)
    if note:
        return "" if top is None else f"best {OBJECTIVE}={top.value:.4f} (trial {top.number + 1})"
    dashboard = f"the study: optuna-dashboard sqlite:///{sweep_dir.absolute() / DB}"
    if top is None:
        return records.shown(f"no trial of {len(study.trials)} completed; {dashboard}")
    test, folder = top.user_attrs.get("test/acc"), top.user_attrs.get("folder")
    return records.shown(
        f"best of {len(study.trials)} trials: trial {top.number + 1}, {settings(top)}: {OBJECTIVE}={top.value:.4f}"
        + (f" test/acc={figure(test)}" if test is not None else "") + (f" -> {sweep_dir / folder}" if folder else "")
        + f"; {dashboard}")


def figure(value: Any) -> str:
    """A trial's accuracy as four decimals; anything else the study's file holds there, as text."""
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else records.shown(value)


def trials_table(study: Any, sweep_dir: Path) -> str:
    """The trials, for the sweep's report; what the study's file says, in Markdown that shows it as written."""
    from src.report import markdown_cell

    states = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "stopped", "WAITING": "waiting"}
    rows = [f"| {t.number + 1} | {states[t.state.name]}"
            + (f" after epoch {markdown_cell(t.user_attrs[PRUNED_AFTER])}" if PRUNED_AFTER in t.user_attrs else "")
            + "".join(f" | {markdown_cell(figure(t.user_attrs[name]))}" if name in t.user_attrs else " | "
                      for name in (OBJECTIVE, "test/acc"))
            + f" | {markdown_cell(settings(t))} | {markdown_cell(t.user_attrs.get('folder', ''))} |"
            for t in study.trials]
    return "\n".join(["", f"## Trials (hydra/sweeper=optuna, {OBJECTIVE} {study.direction.name.lower()}d)", "",
                      markdown_cell(best(study, sweep_dir)), "",
                      f"| trial | state | {OBJECTIVE} | test/acc | settings | folder |",
                      "| --- | --- | --- | --- | --- | --- |", *rows, ""])

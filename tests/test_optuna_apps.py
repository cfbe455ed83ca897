"""`hydra/sweeper=optuna` in a Hydra app that is not this project's: the objective is the number the app's task
returns (a list of numbers for several directions), as Hydra's own Optuna sweeper takes it; anything else fails its
trial, and the sweep, in one line. The app runs in this process through Hydra's own sweep runner."""

import math

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from src.errors import UsageError
from src.launch.optuna_sweeper import DB, storage

SWEEP = ["hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "+x=interval(-5, 5)", "hydra.sweeper.n_trials=6"]


@pytest.fixture(autouse=True)
def hydras_default_version_base():
    """An app at Hydra's default version base, which the first composition in a process settles for the process."""
    from hydra.version import _UNSPECIFIED_, VersionBase

    saved = VersionBase.instance().getbase()
    VersionBase.instance().version_base = _UNSPECIFIED_
    yield
    VersionBase.instance().version_base = saved


def search(hydra_sweep_runner, tmp_path, task, *overrides: str):
    """The app's sweep, its jobs one after another in this process (`hydra/launcher=sequential`, as under Hydra's
    basic launcher)."""
    runner = hydra_sweep_runner(calling_file=None, calling_module="tests.test_optuna_apps", task_function=task,
                                config_path=None, config_name=None, overrides=[*SWEEP, *overrides],
                                temp_dir=str(tmp_path / "sweep"))
    runner.__enter__()  # the runner's exit removes the sweep folder, whose study the test reads
    return runner


def study_in(tmp_path) -> optuna.Study:
    return optuna.load_study(study_name=None, storage=storage(tmp_path / "sweep" / DB))


@pytest.mark.parametrize("launcher", ["basic", "sequential"])
def test_an_app_returning_a_number_is_judged_by_it(hydra_sweep_runner, tmp_path, launcher, capsys):
    search(hydra_sweep_runner, tmp_path, lambda cfg: (cfg.x - 2) ** 2, "hydra.sweeper.direction=minimize",
           f"hydra/launcher={launcher}")
    study = study_in(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    assert all(t.value == pytest.approx((t.params["+x"] - 2) ** 2) for t in study.trials)
    assert study.best_value == min(t.value for t in study.trials)
    written = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert written == {"name": "optuna", "best_params": study.best_params, "best_value": study.best_value}
    said = f"best of 6 trials: trial {study.best_trial.number + 1}, +x={study.best_params['+x']:.4g}: value={study.best_value:.4f}"
    assert said in capsys.readouterr().out


def test_an_app_returning_two_numbers_has_a_pareto_front(hydra_sweep_runner, tmp_path, capsys):
    search(hydra_sweep_runner, tmp_path, lambda cfg: [(cfg.x - 2) ** 2, (cfg.x + 2) ** 2],
           "hydra.sweeper.direction=[minimize,minimize]", "hydra.sweeper.objectives=[a/first,a/second]")
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Pareto front of 6 trials: trial ")]
    assert len(said) == 1 and " a/first=" in said[0] and " a/second=" in said[0]
    study = study_in(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    front = study.best_trials

    def dominated(t: optuna.trial.FrozenTrial) -> bool:  # another trial no worse in both, better in one
        return any(all(a <= b for a, b in zip(u.values, t.values)) and u.values != t.values for u in study.trials)

    assert {t.number for t in front} == {t.number for t in study.trials if not dominated(t)}
    assert all(t.values == [(t.params["+x"] - 2) ** 2, (t.params["+x"] + 2) ** 2] for t in study.trials)
    written = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert written["solutions"] == [{"params": t.params, "values": t.values} for t in front]


@pytest.mark.parametrize("returned, said", [
    (None, "its task returned NoneType; hydra/sweeper=optuna takes a number (hydra.sweeper.direction=maximize)"),
    ("0.5", "its task returned the text '0.5'; hydra/sweeper=optuna takes a number (hydra.sweeper.direction=maximize)"),
    (math.nan, "its task returned nan; hydra/sweeper=optuna takes a number (hydra.sweeper.direction=maximize)"),
])
def test_an_app_returning_anything_else_fails_its_trial_and_the_sweep_in_one_line(hydra_sweep_runner, tmp_path,
                                                                                  returned, said):
    with pytest.raises(UsageError) as refused:
        search(hydra_sweep_runner, tmp_path, lambda cfg: returned, "hydra/launcher=sequential")
    assert str(refused.value) == f"trial 1 cannot be judged: {said} from the task of a Hydra app"
    assert [t.state for t in study_in(tmp_path).trials] == [TrialState.FAIL] * 6

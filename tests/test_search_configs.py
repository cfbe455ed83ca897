"""Searches as configs: `hydra.sweeper.params` and `conf/hparams_search/`, merged with the command line; the grammar and
meaning of Hydra's Optuna plugin; the samplers by name (`hydra/sweeper/sampler=<name>`), each built from its typed
settings and refused in one line where a setting is out of range."""

import pytest
import yaml
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import CmaEsSampler, GridSampler, NSGAIISampler, QMCSampler, RandomSampler, TPESampler
from optuna.trial import TrialState

import hydra_plugins.project_sweepers.optuna_sweeper  # noqa: F401  (the sampler group in Hydra's ConfigStore)
import optuna
from src import config
from src.errors import UsageError
from src.launch import optuna_samplers
from src.launch.optuna_samplers import Sampler, build, checked
from src.launch.optuna_sweeper import DB, Space, search_space, storage, with_params
from tests.helpers import QUICK, composed, train_here

# ---------------------------------------------------------------- the plugin's grammar and meaning

# Hydra's Optuna plugin's own cases (its test_create_optuna_distribution_from_override), with the distributions it
# makes in Optuna's current names: IntUniform is IntDistribution, (Log)Uniform FloatDistribution(log=...), DiscreteUniform
# a FloatDistribution with a step.
PLUGIN_CASES = [
    ("key=choice(1,2)", CategoricalDistribution([1, 2])),
    ("key=choice(true, false)", CategoricalDistribution([True, False])),
    ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"])),
    ("key=shuffle(range(1,3))", CategoricalDistribution((1, 2))),
    ("key=range(1,3)", IntDistribution(1, 3)),
    ("key=interval(1, 5)", FloatDistribution(1, 5)),
    ("key=int(interval(1, 5))", IntDistribution(1, 5)),
    ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True)),
    ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True)),
    ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1)),
]


@pytest.mark.parametrize("typed, expected", PLUGIN_CASES)
def test_the_plugins_grammar_gives_the_plugins_distributions(typed, expected):
    [(key, made)] = search_space([typed]).distributions.items()
    assert key == "key" and made == expected


def test_a_choice_of_any_plain_values_keeps_its_typed_text_and_a_shuffle_is_the_same_choice():
    space = search_space(["model=lenet,resnet18", "trainer.deterministic=true,null,warn",
                          "seed=shuffle(range(1, 4))"])
    assert space.distributions["trainer.deterministic"] == CategoricalDistribution([True, None, "warn"])
    assert space.distributions["seed"] == CategoricalDistribution([1, 2, 3])  # the order typed, not a shuffled one
    assert space.overrides({"model": "resnet18", "trainer.deterministic": None, "seed": 2}) == [
        "model=resnet18", "trainer.deterministic=null", "seed=2"]


def test_a_whole_number_reaches_the_job_as_a_whole_number(tmp_path):
    space = search_space(["data.batch_size=range(32, 96, step=32)", "optim.lr=range(0.05, 0.15, step=0.05)"])
    study = optuna.create_study(sampler=RandomSampler(seed=0))
    params = study.ask(space.distributions).params
    assert type(params["data.batch_size"]) is int and params["data.batch_size"] in (32, 64, 96)
    job = composed(*space.overrides(params), run_dir=tmp_path)
    assert job.data.batch_size == params["data.batch_size"] and type(job.data.batch_size) is int
    assert space.overrides({"data.batch_size": 32, "optim.lr": 0.1}) == ["data.batch_size=32", "optim.lr=0.1"]


@pytest.mark.parametrize("typed, said", [
    ("optim.lr=tag(exp, interval(0.001, 1))", "the tags it knows are log and int"),
    ("model=tag(log, choice(lenet, resnet18))", "the tags it knows are log and int, on an interval()"),
    ("seed=choice([1, 2], [3])", "a choice of hydra/sweeper=optuna is a plain value"),
    ("seed=range(5, 1)", "seed=range(5, 1) is not allowed; `low <= high` must hold"),
    ("model=glob(*)", "hydra/sweeper=optuna searches interval(), choice(), range() and a,b,c"),
    ("optim.lr=interval(0.1", "optim.lr=interval(0.1 is not allowed; it must follow Hydra's override grammar"),
])
def test_what_the_plugin_searches_and_this_sweeper_cannot_is_one_line(typed, said):
    with pytest.raises(UsageError) as refused:
        search_space([typed])
    assert said in str(refused.value) and "\n" not in str(refused.value)


# ---------------------------------------------------------------- a search's space from its config


def test_the_config_space_and_the_command_line_merge_and_the_command_line_wins():
    params = {"optim.lr": "tag(log, interval(0.001, 0.1))", "data.batch_size": "choice(64, 128)", "max_epochs": 3}
    merged = with_params(params, ["optim.lr=choice(0.01, 0.1)", "seed=1,2"])
    assert merged == ["data.batch_size=choice(64, 128)", "max_epochs=3", "optim.lr=choice(0.01, 0.1)", "seed=1,2"]
    space = search_space(merged)
    assert space.distributions == {"data.batch_size": CategoricalDistribution([64, 128]),
                                   "optim.lr": CategoricalDistribution([0.01, 0.1]), "seed": CategoricalDistribution([1, 2])}
    assert space.fixed == ["max_epochs=3"]


@pytest.mark.parametrize("params, said", [
    ({"optim.lr": "interval(0.1"}, "optim.lr=interval(0.1 is not allowed; it must follow Hydra's override grammar"),
    ({"optim.lr": [1, 2]}, "hydra.sweeper.params={'optim.lr': [1, 2]} is not allowed; it must be a mapping of keys to overrides"),
])
def test_a_config_space_hydra_cannot_read_is_one_line(params, said):
    with pytest.raises(UsageError) as refused:
        with_params(params, [])
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


@pytest.mark.parametrize("search, model", [("lenet_optuna", "lenet"), ("resnet18_optuna", "resnet18")])
def test_each_search_of_conf_composes_with_the_optuna_sweeper_and_a_space_the_jobs_take(search, model, tmp_path):
    cfg = composed(f"hparams_search={search}")
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("project_sweepers.optuna_sweeper.OptunaSweeper")
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed == 1234
    space = search_space(with_params(OmegaConf.to_container(sweeper.params), []))
    for point in space.corners():
        job = composed(f"hparams_search={search}", *space.overrides(point), run_dir=tmp_path)
        config.check(job, named=False)
        assert job.model_name == model


def search(folder, *args):
    return train_here("-m", *QUICK, f"hydra.sweep.dir={folder}", "hydra.sweeper.n_trials=2", *args)


def test_a_search_from_its_config_merges_the_command_line_and_a_resume_with_another_space_is_refused(tmp_path, data_root):
    """conf/hparams_search/lenet_optuna.yaml as a user's own copy, whose space is then narrowed before a resume."""
    mine = tmp_path / "conf" / "hparams_search" / "mine.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text((config.CONF_DIR / "hparams_search" / "lenet_optuna.yaml").read_text())
    folder, typed = tmp_path / "search", [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "hparams_search=mine",
                                          "optim.lr=choice(0.05, 0.1)"]
    result = search(folder, *typed)
    assert result.returncode == 0, result.stderr[-3000:]
    study = optuna.load_study(study_name=None, storage=storage(folder / DB))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    folders = set()
    for trial in study.trials:
        params = trial.params
        assert params.keys() == {"optim.lr", "optim.momentum", "data.batch_size"}
        assert params["optim.lr"] in (0.05, 0.1) and 0 <= params["optim.momentum"] <= 0.95  # typed; the config's
        job = yaml.safe_load((folder / trial.user_attrs["folder"] / "config.yaml").read_text())
        assert job["data"]["batch_size"] == params["data.batch_size"] and type(job["data"]["batch_size"]) is int
        assert job["optim"]["lr"] == params["optim.lr"] and job["model_name"] == "lenet"
        folders.add(trial.user_attrs["folder"])
    assert len(folders) == 2 and all("optim.momentum=" in name for name in folders)  # the config's keys name them too

    mine.write_text(mine.read_text().replace("interval(0.0, 0.95)", "interval(0.96, 0.99)"))
    refused = search(folder, *typed, "hydra.sweeper.n_trials=3", "ckpt_path=auto")
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {folder / DB}: trial 1 holds ") and "outside the space" in last, refused.stderr[-3000:]
    assert len(optuna.load_study(study_name=None, storage=storage(folder / DB)).trials) == 2


# ---------------------------------------------------------------- the samplers


def sampler_of(*overrides: str) -> Sampler:
    return checked(composed("hydra/sweeper=optuna", *overrides).hydra.sweeper.sampler)


def grid_space() -> Space:
    return search_space(["data.batch_size=range(32, 96, step=32)", "model=lenet,resnet18"])


@pytest.mark.parametrize("name, settings, cls, held", [
    ("tpe", ["n_startup_trials=3", "multivariate=false", "n_ei_candidates=8"], TPESampler,
     {"_n_startup_trials": 3, "_multivariate": False, "_n_ei_candidates": 8}),
    ("random", [], RandomSampler, {}),
    ("grid", [], GridSampler, {"_all_grids": [(32, "lenet"), (32, "resnet18"), (64, "lenet"), (64, "resnet18"),
                                              (96, "lenet"), (96, "resnet18")]}),
    ("cmaes", ["n_startup_trials=2", "popsize=6", "use_separable_cma=true"], CmaEsSampler,
     {"_n_startup_trials": 2, "_popsize": 6, "_use_separable_cma": True}),
    ("nsgaii", ["population_size=4", "mutation_prob=0.1", "crossover_prob=0.8", "swapping_prob=0.4"], NSGAIISampler,
     {"_population_size": 4}),
    ("qmc", ["qmc_type=halton", "scramble=true"], QMCSampler, {"_qmc_type": "halton", "_scramble": True}),
])
def test_each_sampler_is_built_by_name_with_its_typed_settings(name, settings, cls, held):
    sampler = sampler_of(f"hydra/sweeper/sampler={name}", *(f"hydra.sweeper.sampler.{s}" for s in settings))
    built = build(sampler, 7, grid_space().grid)
    assert type(built) is cls and sampler.name == name
    for attribute, value in held.items():
        assert (sorted(built._all_grids) if attribute == "_all_grids" else getattr(built, attribute)) == value
    if name == "nsgaii":
        strategy = built._child_generation_strategy
        assert (strategy._mutation_prob, strategy._crossover_prob, strategy._swapping_prob) == (0.1, 0.8, 0.4)


def test_a_sampler_draws_from_its_seed_plus_the_trials_asked_so_that_a_resume_asks_anew():
    from src.launch.optuna_sweeper import OptunaSweeper

    space = search_space(["optim.lr=interval(0.001, 1)"])

    def first(sampler) -> float:
        return optuna.create_study(sampler=sampler).ask(space.distributions).params["optim.lr"]

    sweeper = OptunaSweeper.__new__(OptunaSweeper)  # the settings alone: new_sampler reads nothing else
    sweeper.space, sweeper.settings = space, {"seed": 5}
    sweeper.sampler = checked(composed("hydra/sweeper=optuna", "hydra/sweeper/sampler=random").hydra.sweeper.sampler)
    assert first(sweeper.new_sampler(0)) == first(RandomSampler(seed=5))  # hydra.sweeper.seed, the sampler's being null
    assert first(sweeper.new_sampler(3)) == first(RandomSampler(seed=8)) != first(RandomSampler(seed=5))
    sweeper.sampler = sampler_of("hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=123")
    assert first(sweeper.new_sampler(0)) == first(RandomSampler(seed=123))


def test_the_plain_word_of_earlier_versions_still_names_a_sampler():
    assert sampler_of("hydra.sweeper.sampler=random") == Sampler("random", None, {})
    assert sampler_of("hydra.sweeper.sampler=tpe").name == "tpe"


def test_an_hparams_search_config_may_choose_the_sampler_and_the_command_line_another():
    assert sampler_of("hparams_search=lenet_optuna", "hydra/sweeper/sampler=qmc").name == "qmc"
    assert sampler_of("hparams_search=lenet_optuna").seed == 1234


@pytest.mark.parametrize("node, said", [
    ("sobol", "hydra.sweeper.sampler=sobol is not allowed; choose the sampler with hydra/sweeper/sampler=<name>, one of: "
              "cmaes, grid, nsgaii, qmc, random, tpe"),
    ({"_target_": "optuna.samplers.TPESampler", "n_startup_trials": -1},
     "hydra.sweeper.sampler.n_startup_trials=-1 is not allowed; it must be a whole number of at least 0"),
    ({"_target_": "optuna.samplers.TPESampler", "group": True, "multivariate": False},
     "hydra.sweeper.sampler.group=true is not allowed with hydra.sweeper.sampler.multivariate=false"),
    ({"_target_": "optuna.samplers.RandomSampler", "seed": -1},
     "hydra.sweeper.sampler.seed=-1 is not allowed; it must be null, or a whole number from 0 to 4294967295"),
    ({"_target_": "optuna.samplers.RandomSampler", "n_startup_trials": 10},
     "hydra.sweeper.sampler.n_startup_trials is not a setting of hydra/sweeper/sampler=random; its settings: seed"),
    ({"_target_": "optuna.samplers.GridSampler", "seed": 1.5},
     "hydra.sweeper.sampler.seed=1.5 is not allowed; it must be null, or a whole number"),
    ({"_target_": "optuna.samplers.CmaEsSampler", "popsize": 0},
     "hydra.sweeper.sampler.popsize=0 is not allowed; it must be null, or a whole number of at least 1"),
    ({"_target_": "optuna.samplers.NSGAIISampler", "population_size": 1},
     "hydra.sweeper.sampler.population_size=1 is not allowed; it must be a whole number of at least 2"),
    ({"_target_": "optuna.samplers.NSGAIISampler", "mutation_prob": 1.5},
     "hydra.sweeper.sampler.mutation_prob=1.5 is not allowed; it must be null, or a fraction in [0, 1]"),
    ({"_target_": "optuna.samplers.NSGAIISampler", "crossover_prob": 2.0},
     "hydra.sweeper.sampler.crossover_prob=2.0 is not allowed; it must be a fraction in [0, 1]"),
    ({"_target_": "optuna.samplers.NSGAIISampler", "swapping_prob": -0.5},
     "hydra.sweeper.sampler.swapping_prob=-0.5 is not allowed; it must be a fraction in [0, 1]"),
    ({"_target_": "optuna.samplers.QMCSampler", "qmc_type": "lhs"},
     "hydra.sweeper.sampler.qmc_type=lhs is not allowed; it must be one of: sobol, halton"),
    ({"_target_": "optuna.samplers.QMCSampler", "scramble": "yes"},
     "hydra.sweeper.sampler.scramble=yes is not allowed; it must be one of: true, false"),
    ({"_target_": "optuna.samplers.BruteForceSampler"},
     "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler is not allowed; it must be one of: "
     "optuna.samplers.TPESampler, "),
])
def test_a_sampler_setting_out_of_range_is_one_line_naming_it_and_what_is_allowed(node, said):
    with pytest.raises(UsageError) as refused:
        checked(node)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_a_sampler_setting_hydra_cannot_type_or_does_not_know_is_one_line():
    from tests.test_bad_input import hydra_refusal

    assert hydra_refusal("hydra/sweeper=optuna", "hydra.sweeper.sampler.n_startup_trials=many").startswith(
        "hydra.sweeper.sampler.n_startup_trials=many is not allowed; ")
    assert hydra_refusal("hydra/sweeper=optuna", "hydra/sweeper/sampler=motpe").startswith(
        "hydra/sweeper/sampler=motpe is not an option; did you mean hydra/sweeper/sampler=tpe? choose one of: cmaes, grid, "
        "nsgaii, qmc, random, tpe")


def test_a_grid_is_the_spaces_choices_and_steps_and_a_continuous_interval_is_refused():
    assert grid_space().grid() == {"data.batch_size": [32, 64, 96], "model": ["lenet", "resnet18"]}
    assert search_space(["optim.lr=range(0.5, 1.5, step=0.5)", "seed=int(interval(1, 3))"]).grid() == {
        "optim.lr": [0.5, 1.0, 1.5], "seed": [1, 2, 3]}
    with pytest.raises(UsageError, match=r"^hydra/sweeper/sampler=grid is not allowed with optim\.lr=tag\(log, "
                                         r"interval\(0\.001, 1\)\): a grid takes choice\(\), a,b,c, range\(\)"):
        search_space(["optim.lr=tag(log, interval(0.001, 1))", "model=lenet,resnet18"]).grid()


def test_cmaes_without_its_package_is_one_line_naming_what_installs_it(monkeypatch):
    monkeypatch.setattr(optuna_samplers.importlib.util, "find_spec", lambda package: None)
    with pytest.raises(UsageError, match=r"^hydra/sweeper/sampler=cmaes needs the cmaes package, which is not installed; "
                                         r"install it with: .* -m pip install cmaes$"):
        sampler_of("hydra/sweeper/sampler=cmaes")


def sweeper_of(*overrides: str):
    """The sweeper Hydra builds for `-m <overrides>`, with its settings as composed."""
    from src.launch.optuna_sweeper import OptunaSweeper

    settings = OmegaConf.to_container(composed("hydra/sweeper=optuna", *overrides).hydra.sweeper)
    return OptunaSweeper(**{key: value for key, value in settings.items() if not key.startswith("_")})


def test_a_grid_asks_each_point_once_and_no_more_trials_than_it_has(tmp_path):
    from src.launch.sequential_launcher import ProjectLauncher

    asked = []

    class Told(ProjectLauncher):
        def launch_each(self, next_job, count, first, at_once, ended):
            while (job := next_job()) is not None:
                study = optuna.load_study(study_name=None, storage=storage(tmp_path / DB))
                asked.append(study.trials[job[0]].params)
                study.tell(job[0], 0.5)
            return []

    sweeper = sweeper_of("hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=10")
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "ckpt_path": None})
    sweeper.launcher, sweeper.check = Told(), lambda space: None
    sweeper.sweep(["model=lenet,resnet18", "data.batch_size=range(64, 128, step=64)"])
    assert sorted((p["model"], p["data.batch_size"]) for p in asked) == [
        ("lenet", 64), ("lenet", 128), ("resnet18", 64), ("resnet18", 128)]


def test_what_the_plugins_config_takes_and_this_sweeper_does_not_is_one_line():
    from tests.test_bad_input import hydra_refusal

    for key in ("search_space", "custom_search_space", "max_failure_rate"):
        assert hydra_refusal("hydra/sweeper=optuna", f"hydra.sweeper.{key}=1").startswith(
            f"hydra.sweeper.{key} is not a known key")


def test_a_sampler_node_as_lightning_hydra_templates_searches_write_it_is_that_sampler():
    node = {"_target_": "optuna.samplers.TPESampler", "seed": 1234, "n_startup_trials": 10}
    assert checked(node) == Sampler("tpe", 1234, {"n_startup_trials": 10})
    assert type(build(checked(node), 1234, dict)) is TPESampler


def test_a_stored_point_lies_in_the_space_only_with_its_type_in_range_and_on_its_step():
    space = search_space(["seed=range(1, 4)", "optim.lr=range(0.5, 2.5, step=1)"])
    assert space.holds({"seed": 2, "optim.lr": 1.5})
    for seed, lr in ((2.0, 1.5), ("lenet", 1.5), (5, 1.5), (2, 1.0), (2, 3.5)):
        assert not space.holds({"seed": seed, "optim.lr": lr}), (seed, lr)
    assert not space.holds({"seed": 2})

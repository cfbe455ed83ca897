"""`hydra/sweeper=optuna`: the search space from the command line, the seeded sampler, what a job tells its trial,
the progress lines of a search, and searches on the real command line: one trial after another and side by side, a
killed search continued, a trial pruned, and the line for a machine without Optuna."""

import json
import re
import sys
import shutil
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from wsgiref.util import setup_testing_defaults

import optuna
import pytest
import torch
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from src.callbacks.optuna_trial import ReportToTrial
from src.launch.optuna_sweeper import TrialRecord, TrialResult, TrialTask
from src.errors import ResumeRefused, UsageError
from src.launch import progress
from src.launch.optuna_sweeper import DB, OptunaSweeper, place, search_space, storage
from src.launch.progress import Progress, Tally
from src.records import Result
from tests.helpers import INTERPRETER, QUICK, cpu_precision, run_cli, scalars, train, train_here, user_env

LR = "optim.lr=tag(log, interval(0.001, 1))"
OPTUNA = "hydra/sweeper=optuna"
SETTINGS = dict(n_trials=2, n_jobs=None, sampler="tpe", seed=0, direction="maximize", pruner="median",
                objectives=["val/acc_best"], storage=None, study_name=None)


def search(folder: Path, *args: str, here: bool = False) -> subprocess.CompletedProcess:
    """The search as a user types it: in a new process, or with `here` in this one (the sequential launcher runs its
    trials in the command's process)."""
    command = [OPTUNA, LR, *QUICK, "max_epochs=2", f"hydra.sweep.dir={folder}", *args]
    return train_here("-m", *command) if here else train("-m", *command, timeout=900)


def study_of(folder: Path) -> optuna.Study:
    return optuna.load_study(study_name=None, storage=storage(folder / DB))


# ---------------------------------------------------------------- the search space, the sampler, a job's trial


def test_the_space_typed_on_the_command_line_becomes_optunas_distributions():
    space = search_space([LR, "model=choice(lenet, resnet18)", "data.batch_size=choice(64,128,256)", "seed=range(1,4)",
                          "trainer.limit_train_batches=tag(int, interval(2, 8))", "max_epochs=3", "tags=[a,b]"])
    assert space.distributions == {
        "optim.lr": FloatDistribution(0.001, 1.0, log=True), "model": CategoricalDistribution(["lenet", "resnet18"]),
        "data.batch_size": CategoricalDistribution([64, 128, 256]), "seed": IntDistribution(1, 4),  # the plugin's range
        "trainer.limit_train_batches": IntDistribution(2, 8)}
    assert space.fixed == ["max_epochs=3", "tags=[a,b]"]
    params = {"optim.lr": 0.0123, "model": "resnet18", "data.batch_size": 128, "seed": 2, "trainer.limit_train_batches": 5}
    assert space.overrides(params) == ["max_epochs=3", "tags=[a,b]", "optim.lr=0.0123", "model=resnet18",
                                       "data.batch_size=128", "seed=2", "trainer.limit_train_batches=5"]
    corners = space.corners()  # the lowest point, then each other end or choice alone
    assert corners[0] == {"optim.lr": 0.001, "model": "lenet", "data.batch_size": 64, "seed": 1, "trainer.limit_train_batches": 2}
    assert len(corners) == 1 + 1 + 1 + 2 + 1 + 1 and {**corners[0], "optim.lr": 1.0} in corners


@pytest.mark.parametrize("typed, said", [
    ("optim.lr=tag(exp, interval(0.001, 1))", "the tags it knows are log and int"),
    ("model=tag(log, choice(lenet, resnet18))", "the tags it knows are log and int, on an interval()"),
    ("optim.lr=tag(log, interval(0, 1))", "`low > 0` must hold for `log=True`"),
    ("model=glob(*)", "hydra/sweeper=optuna searches interval(), choice(), range() and a,b,c"),
    ("max_epochs=3", "hydra/sweeper=optuna needs a space to search"),
])
def test_a_space_optuna_cannot_search_is_refused_in_one_line(typed, said):
    with pytest.raises(UsageError) as refused:
        search_space([typed])
    assert said in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name, value", [("pruner", "hyperband"), ("n_trials", 0),
                                         ("direction", "up"), ("n_jobs", 0)])
def test_a_sweeper_setting_out_of_range_is_one_line(name, value):
    with pytest.raises(UsageError, match=rf"^hydra\.sweeper\.{name}={value} is not allowed; it must be "):
        OptunaSweeper(**{**SETTINGS, name: value})


def trial_of_job(tmp_path: Path) -> tuple[optuna.Study, object]:
    """A study with one trial asked for, and the config its job gets (`callbacks.optuna_trial` names the trial)."""
    study = optuna.create_study(storage=storage(tmp_path / DB), study_name="s", direction="maximize")
    number = study.ask({"optim.lr": FloatDistribution(0.001, 1.0, log=True)}).number
    cfg = OmegaConf.create({"output_dir": str(tmp_path / "run"), "callbacks": {
        "optuna_trial": {"db": str(tmp_path / DB), "study": storage(tmp_path / DB).get_study_id_from_name("s"),
                         "trial": number}}})
    return study, cfg


def job_trial(cfg: DictConfig) -> tuple[str, int, int]:
    """The study's file, the study's id and the trial's number, as the job's callback gets them."""
    where = cfg.callbacks.optuna_trial
    return where.db, where.study, where.trial


def test_a_job_tells_its_trial_its_best_validation_accuracy_never_a_test_figure(tmp_path):
    study, cfg = trial_of_job(tmp_path)
    metrics = {"val/acc_best": 0.81, "val/acc": 0.79, "test/acc": 0.9, "train/acc": 0.95}
    returned = TrialTask(lambda cfg: Result(metrics, "test/acc=0.9000 ..."))(cfg)
    [trial] = study.trials
    assert (trial.state, trial.value) == (TrialState.COMPLETE, 0.81)
    assert trial.user_attrs == {"folder": "run", "val/acc_best": 0.81, "test/acc": 0.9}
    assert isinstance(returned, TrialResult) and returned.metrics == metrics and not returned.pruned


def test_a_job_that_fails_fails_its_trial_and_one_without_validation_too(tmp_path):
    study, cfg = trial_of_job(tmp_path)
    with pytest.raises(ValueError, match="boom"):
        TrialTask(lambda cfg: (_ for _ in ()).throw(ValueError("boom")))(cfg)
    assert study.trials[0].state == TrialState.FAIL
    (tmp_path / "again").mkdir()
    study, cfg = trial_of_job(tmp_path / "again")
    with pytest.raises(UsageError, match=r"trial 1 has no val/acc_best to be judged by: run ran no validation"):
        TrialTask(lambda cfg: Result({"test/acc": 0.9}, "..."))(cfg)
    assert study.trials[0].state == TrialState.FAIL


def with_better_trials(study: optuna.Study) -> None:
    """The median pruner on, and five earlier trials far better after their first epoch."""
    study.set_user_attr("pruner", "median")
    for value in (0.9, 0.88, 0.91, 0.9, 0.92):
        study.add_trial(create_trial(params={"optim.lr": 0.01}, distributions={"optim.lr": FloatDistribution(0.001, 1.0, log=True)},
                                     value=value, intermediate_values={0: value}))


def test_a_trial_the_pruner_gives_up_is_recorded_and_told_as_pruned(tmp_path):
    study, cfg = trial_of_job(tmp_path)
    with_better_trials(study)
    record = TrialRecord(*job_trial(cfg))
    assert record.report(0, 0.3) is True
    returned = record.told(Result({"val/acc_best": 0.3, "test/acc": 0.29}, "line"), "run")
    assert study.trials[0].state == TrialState.PRUNED and study.trials[0].user_attrs["pruned after epoch"] == 1
    assert returned.pruned and returned.line == "line"


def test_a_trial_below_the_median_after_its_last_epoch_is_complete_not_pruned(tmp_path):
    """With max_epochs=1 every trial below the median was marked pruned after its only epoch."""
    study, cfg = trial_of_job(tmp_path)
    with_better_trials(study)
    callback = ReportToTrial(*job_trial(cfg))
    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={"val/acc": torch.tensor(0.3)}, is_global_zero=True,
                              current_epoch=0, max_epochs=1, should_stop=False,
                              strategy=SimpleNamespace(broadcast=lambda value, src: value))
    callback.on_validation_end(trainer, None)
    returned = TrialRecord(*job_trial(cfg)).told(Result({"val/acc_best": 0.3}, "line"), "run")
    assert not trainer.should_stop and not returned.pruned
    assert (study.trials[0].state, study.trials[0].value) == (TrialState.COMPLETE, 0.3)
    assert study.trials[0].intermediate_values == {0: pytest.approx(0.3)}


# ---------------------------------------------------------------- the progress lines of a search


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_search_numbers_its_trials_across_batches_and_says_a_pruned_one_and_the_best_so_far():
    """Trial 1 ended in an earlier command; this one launches trials 2 and 3 one batch each, out of 4."""
    clock, said = Clock(), []
    progress.tally = Tally(total=4, before=1, noun="trial", note=lambda: "best val/acc_best=0.8100 (trial 1)")
    first = Progress(1, 1, clock=clock, say=said.append)
    first.started(1, "t2")
    clock.now += 30
    first.ended(1, "t2", JobReturn(status=JobStatus.COMPLETED, _return_value=TrialResult({}, "test/acc=0.5", pruned=True)))
    Progress(1, 2, clock=clock, say=said.append).started(2, "t3")
    best = "; best val/acc_best=0.8100 (trial 1))"
    assert said == ["trial 2/4 started: t2 (elapsed 0:00, time left not known yet" + best,
                    "trial 2/4 pruned: t2: test/acc=0.5 (elapsed 0:30, about 1:00 left" + best,  # two trials of 30 s
                    "trial 3/4 started: t3 (elapsed 0:30, about 1:00 left" + best]
    assert progress.tally.summary(None) == ("sweep of 4 trials: 0 done, 0 resumed, 0 skipped, 1 pruned, 0 failed, "
                                            "2 not run, 1 ended before; report: none written")
    assert progress.tally.failures == []


# ---------------------------------------------------------------- searches on the command line


def two_trials(tmp_path_factory: pytest.TempPathFactory, launcher: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The same search of two trials, by `launcher`, from this process: one after another here, side by side in processes."""
    folder = tmp_path_factory.mktemp(launcher) / "search"
    result = search(folder, f"hydra/launcher={launcher}", "hydra.sweeper.n_trials=2", here=True)
    return result, folder


@pytest.fixture(scope="module")
def sequential_search(tmp_path_factory, data_root) -> tuple[subprocess.CompletedProcess, Path]:
    return two_trials(tmp_path_factory, "sequential")


@pytest.fixture(scope="module")
def parallel_search(tmp_path_factory, data_root) -> tuple[subprocess.CompletedProcess, Path]:
    return two_trials(tmp_path_factory, "parallel")


def dashboard_studies(db: Path) -> list[str]:
    """The study names optuna-dashboard's server lists for the file (`optuna-dashboard sqlite:///<file>`)."""
    from optuna_dashboard import wsgi

    environ, answer = {"PATH_INFO": "/api/studies", "REQUEST_METHOD": "GET"}, []
    setup_testing_defaults(environ)
    body = b"".join(wsgi(f"sqlite:///{db}")(environ, lambda status, *headers: answer.append(status)))
    assert answer == ["200 OK"], environ["wsgi.errors"].getvalue()[-3000:]
    return [study["study_name"] for study in json.loads(body)["study_summaries"]]


@pytest.mark.slow  # a search of two trials; the parallel one's trials are processes
def test_two_trials_that_draw_the_same_settings_run_in_folders_of_their_own(tmp_path):
    """A sampler may draw settings it drew before (TPE over a few choices does): a trial's folder is named by its
    number too, so the second is a run of its own, not a refused resume of the first's folder."""
    folder = tmp_path / "search"
    result = train_here("-m", OPTUNA, "seed=choice(1)", *QUICK, f"hydra.sweep.dir={folder}", "hydra.sweeper.n_trials=2")
    assert result.returncode == 0, result.stderr[-3000:]
    study = study_of(folder)
    assert [(t.state, t.params) for t in study.trials] == [(TrialState.COMPLETE, {"seed": 1})] * 2
    assert [t.user_attrs["folder"] for t in study.trials] == [
        f"lenet_auto_1dev_{cpu_precision()}_trial{number}_seed=1" for number in (1, 2)]


@pytest.mark.parametrize("launcher", ["sequential", pytest.param("parallel", marks=pytest.mark.slow)])  # jobs: processes
def test_a_search_judges_each_trial_by_its_best_validation_accuracy_and_names_the_best(request, launcher):
    result, folder = request.getfixturevalue(f"{launcher}_search")
    assert result.returncode == 0, result.stderr[-3000:]
    study = study_of(folder)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2 and dashboard_studies(folder / DB) == ["search"]
    for trial in study.trials:
        run = folder / trial.user_attrs["folder"]
        recorded = json.loads((run / "result.json").read_text())["metrics"]
        assert trial.value == recorded["val/acc_best"] and trial.user_attrs["test/acc"] == recorded["test/acc"]
        assert list(trial.intermediate_values.values()) == scalars(run)["val/acc"]  # each epoch's, told as it ended
        assert 0.001 <= trial.params["optim.lr"] <= 1 and f"_trial{trial.number + 1}_optim.lr={trial.params['optim.lr']}" in run.name
    lines = [line for line in result.stdout.splitlines() if line.startswith(("trial ", "best of", "sweep of"))]
    said = [line.split(":")[0] for line in lines if line.startswith("trial ")]
    if launcher == "sequential":
        assert said == ["trial 1/2 started", "trial 1/2 done", "trial 2/2 started", "trial 2/2 done"]
    else:  # side by side: both began before either ended
        assert said[:2] == ["trial 1/2 started", "trial 2/2 started"] and sorted(said[2:]) == ["trial 1/2 done", "trial 2/2 done"]
    assert re.search(r"\(elapsed \d+:\d\d, about \d+:\d\d left; best val/acc_best=\d\.\d{4} \(trial [12]\)\)$", lines[-3])
    top = study.best_trial
    assert lines[-2] == (f"best of 2 trials: trial {top.number + 1}, optim.lr={top.params['optim.lr']:.4g}: val/acc_best="
                         f"{top.value:.4f} test/acc={top.user_attrs['test/acc']:.4f} -> {folder / top.user_attrs['folder']}; "
                         f"the study: optuna-dashboard sqlite:///{folder / DB}")
    assert lines[-1] == f"sweep of 2 trials: 2 done, 0 resumed, 0 skipped, 0 failed; report: {folder / 'report.md'}"
    report = (folder / "report.md").read_text()
    assert "## Trials (hydra/sweeper=optuna, val/acc_best maximized)" in report
    assert all(f"| {n} | complete | {t.value:.4f} |" in report for n, t in enumerate(study.trials, 1))


@pytest.mark.slow
def test_the_same_seed_asks_for_the_same_trials_one_after_another_and_side_by_side(sequential_search, parallel_search):
    two_searches = {"sequential": sequential_search, "parallel": parallel_search}
    assert [[t.params for t in study_of(folder).trials] for _, folder in two_searches.values()] == [
        [t.params for t in study_of(two_searches["sequential"][1]).trials]] * 2


@pytest.mark.slow
def test_a_killed_search_continues_to_n_trials_keeping_its_trials_and_training_on_the_one_it_left(tmp_path, data_root):
    folder, mark = tmp_path / "search", tmp_path / "killed"
    # Trial 1 ends; trial 2 is killed with the whole search (SIGKILL) as its second epoch begins, after its first epoch's
    # checkpoint; the same command then continues the search to 3 trials.
    assert search(folder, "hydra.sweeper.n_trials=1", here=True).returncode == 0
    finished = study_of(folder).trials[0]
    kill = ["+callbacks.fault._target_=tests.faults.KillIn", "+callbacks.fault.hook=on_train_epoch_start",
            "+callbacks.fault.epoch=1", f"+callbacks.fault.mark={mark}", "hydra.sweeper.n_trials=3", "ckpt_path=auto"]
    killed = search(folder, *kill)
    assert killed.returncode == -signal.SIGKILL and mark.exists(), killed.stderr[-3000:]
    left = study_of(folder).trials[1]
    assert left.state == TrialState.RUNNING and list(left.intermediate_values) == [0]
    result = search(folder, *kill, here=True)  # only the killed search needs a process of its own
    assert result.returncode == 0, result.stderr[-3000:]
    trials = study_of(folder).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert (trials[0].value, trials[0].datetime_complete) == (finished.value, finished.datetime_complete)
    assert trials[1].params == left.params and list(trials[1].intermediate_values) == [0, 1]
    assert result.stdout.splitlines()[-1].startswith("sweep of 3 trials: 1 done, 1 resumed, 0 skipped, 0 failed, 1 ended before")
    assert len(scalars(folder / trials[1].user_attrs["folder"])["val/acc"]) == 2  # one epoch before the kill, one after


def test_a_hopeless_trial_is_pruned_in_one_line_and_the_search_ends_well(tmp_path, data_root):
    folder = tmp_path / "search"
    folder.mkdir()
    earlier = optuna.create_study(storage=storage(folder / DB), study_name="earlier", direction="maximize")
    for lr in (0.01, 0.02, 0.03, 0.04, 0.05):  # five trials that were far better after their first epoch
        earlier.add_trial(create_trial(params={"optim.lr": lr}, distributions={"optim.lr": FloatDistribution(0.001, 1, log=True)},
                                       value=0.95, intermediate_values={0: 0.95, 1: 0.95}))
    result = search(folder, "hydra.sweeper.n_trials=6", "ckpt_path=auto", here=True)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    pruned = [line for line in result.stdout.splitlines() if "pruned after epoch" in line]
    assert len(pruned) == 1 and re.search(r"trial 6 pruned after epoch 1: val/acc=\d\.\d{4} is below the median", pruned[0])
    assert re.search(r"^trial 6/6 pruned: \S+: test/acc=", result.stdout, re.M)
    assert result.stdout.splitlines()[-1].startswith("sweep of 6 trials: 0 done, 0 resumed, 0 skipped, 1 pruned, 0 failed, 5 ended before")
    trial = study_of(folder).trials[5]
    assert trial.state == TrialState.PRUNED and list(trial.intermediate_values) == [0]
    run = folder / trial.user_attrs["folder"]
    assert len(scalars(run)["val/acc"]) == 1 and (run / "result.json").is_file()  # stopped after epoch 1 of 2, tested
    assert "| 6 | pruned after epoch 1 |" in (folder / "report.md").read_text()


@pytest.mark.slow
def test_without_optuna_the_search_is_one_line_naming_the_extra_to_install(tmp_path, data_root):
    missing = tmp_path / "site" / "optuna"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('No module named optuna')\n")
    folder = tmp_path / "search"
    result = run_cli("src.train", "-m", OPTUNA, LR, *QUICK, f"hydra.sweep.dir={folder}",
                     env={**user_env(), "PYTHONPATH": str(missing.parent)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: hydra/sweeper=optuna needs the optuna package, which is not "
                                                  f"installed; install it with: {INTERPRETER} -m pip install -e '.[optuna]'"]
    assert not folder.exists()


def test_a_resume_of_a_search_takes_the_same_space_and_refuses_another_in_one_line(tmp_path):
    from src.resume import with_record

    (tmp_path / "multirun.yaml").write_text(f"hydra:\n  overrides:\n    task:\n    - '{LR}'\n    - max_epochs=2\n")
    resume = ["-m", OPTUNA, f"hydra.sweep.dir={tmp_path}", "ckpt_path=auto"]
    assert with_record([*resume, LR]) == ["max_epochs=2", *resume, LR]
    other = "optim.lr=tag(log, interval(0.01, 1))"
    swept = "optim.lr=tag(log, interval(0.001, 1.0))"  # the record's value, written out from the value it was read as
    with pytest.raises(UsageError, match=re.escape(f"{other} is not allowed in a resume of the sweep {tmp_path}: it swept {swept}")):
        with_record([*resume, other])


def test_a_refused_resume_leaves_its_trial_to_a_resume_that_goes_through(tmp_path):
    study, cfg = trial_of_job(tmp_path)
    with pytest.raises(ResumeRefused):
        TrialTask(lambda cfg: (_ for _ in ()).throw(ResumeRefused("seed=1 is not allowed in a resume of run")))(cfg)
    assert study.trials[0].state == TrialState.RUNNING


@pytest.mark.slow  # a search stopped, and its resume
def test_a_stopped_search_whose_folder_moved_goes_on_there_and_a_job_refused_keeps_its_trial(tmp_path, data_root):
    """The study's file was named by the old folder: the resume was refused, and the refusal failed the trial."""
    folder, moved = tmp_path / "search", tmp_path / "moved"
    stop = ["+callbacks.term._target_=tests.faults.SignalAfterCheckpoints", "+callbacks.term.epoch=0",
            f"+callbacks.term.mark={tmp_path / 'stopped'}", "hydra.sweeper.n_trials=1"]
    assert search(folder, *stop, here=True).returncode == 143  # stopped after the first of two epochs
    shutil.move(folder, moved)
    [job] = [path for path in moved.iterdir() if (path / "config.yaml").is_file()]
    recorded = (job / "config.yaml").read_text()
    (job / "config.yaml").write_text(recorded.replace("\nseed: 42\n", "\nseed: 7\n"))  # a run that really differs
    refused = search(moved, *stop, "ckpt_path=auto", here=True)
    assert "seed=42 is not allowed in a resume of" in refused.stderr, refused.stderr[-3000:]
    assert study_of(moved).trials[0].state == TrialState.RUNNING

    (job / "config.yaml").write_text(recorded)
    result = search(moved, *stop, "ckpt_path=auto", here=True)
    assert result.returncode == 0, result.stderr[-3000:]
    [trial] = study_of(moved).trials
    assert trial.state == TrialState.COMPLETE and list(trial.intermediate_values) == [0, 1]
    assert result.stdout.splitlines()[-1].startswith("sweep of 1 trial: 0 done, 1 resumed")


class Batches:
    """A launcher that takes batches, as SLURM's does: it runs nothing, tells each trial a value, and keeps what it
    was given."""

    def __init__(self, study: optuna.Study) -> None:
        self.study, self.launched = study, []

    def launch(self, job_overrides, initial_job_idx):
        numbers = [int(next(o for o in overrides if o.startswith("+callbacks.optuna_trial.trial=")).split("=")[1])
                   for overrides in job_overrides]
        self.launched.append(numbers)
        assert numbers == list(range(initial_job_idx, initial_job_idx + len(numbers))), "a launch numbers jobs in a row"
        for number in numbers[:-1]:  # the last ends without telling (killed, say)
            self.study.tell(number, 0.5)
        return [JobReturn(status=JobStatus.COMPLETED, _return_value=Result({}, "")) for _ in numbers]


def test_a_batch_launcher_gets_trials_left_running_then_new_ones_in_numbered_runs_and_a_silent_job_fails(tmp_path):
    """Trials 2, 3 and 5 of 5 were left running by a stopped command; 7 trials in all, 2 at once."""
    study = optuna.create_study(storage=storage(tmp_path / DB), study_name="s", direction="maximize")
    space = {"optim.lr": FloatDistribution(0.001, 1.0, log=True)}
    for number in range(5):
        trial = study.ask(space)
        if number in (0, 3):
            study.tell(trial, 0.4)
    sweeper = OptunaSweeper(**{**SETTINGS, "n_trials": 7, "n_jobs": 2})
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "ckpt_path": "auto"})
    sweeper.launcher, sweeper.check = Batches(study), lambda space: None
    sweeper.sweep([LR])
    assert sweeper.launcher.launched == [[1, 2], [4, 5], [6]]
    states = [trial.state for trial in study_of(tmp_path).trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE,
                      TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL]


def test_a_project_launcher_is_given_each_trial_only_as_it_takes_it_left_ones_first(tmp_path):
    """Under the sequential and parallel launchers a new trial exists only once the launcher has a place for it, so
    the sampler knows how every trial before it ended."""
    from src.launch.sequential_launcher import ProjectLauncher

    study = optuna.create_study(storage=storage(tmp_path / DB), study_name="s", direction="maximize")
    study.ask({"optim.lr": FloatDistribution(0.001, 1.0, log=True)})  # left running by a stopped command
    taken, sizes = [], []

    class OneByOne(ProjectLauncher):
        def launch_each(self, next_job, count, first, at_once, ended):
            assert (count, first, at_once) == (3, 0, None)
            while (job := next_job()) is not None:
                sizes.append(len(study.trials))
                taken.append(job[0])
                if job[0] != 1:
                    study.tell(job[0], 0.5)
                ended(job[0], JobReturn(status=JobStatus.COMPLETED, _return_value=Result({}, "")))
            return []

    sweeper = OptunaSweeper(**{**SETTINGS, "n_trials": 3})
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "ckpt_path": "auto"})
    sweeper.launcher, sweeper.check = OneByOne(), lambda space: None
    sweeper.sweep([LR])
    assert taken == [0, 1, 2] and sizes == [1, 2, 3]
    assert [t.state for t in study_of(tmp_path).trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]

    class Never(ProjectLauncher):
        def launch_each(self, *args):
            raise AssertionError("a search at n_trials has nothing to launch")

    sweeper.launcher = Never()
    sweeper.sweep([LR])


# ---------------------------------------------------------------- several objectives, the results file, a shared study


TWO = ["hydra.sweeper.direction=[maximize,minimize]", "hydra.sweeper.objectives=[val/acc_best,time/epoch_s]"]


def test_a_search_of_two_objectives_writes_its_pareto_front_its_plot_and_its_results(tmp_path, data_root):
    """Two strategies and two learning rates (their grid: no point twice), accuracy against epoch time: the front in
    the report, drawn, and in optimization_results.yaml as Hydra's Optuna plugin writes it."""
    import yaml

    folder = tmp_path / "search"
    result = train_here("-m", OPTUNA, "hydra/sweeper/sampler=grid", "strategy=choice(auto,dp)", "optim.lr=choice(0.01,0.1)", *QUICK,
                        f"hydra.sweep.dir={folder}", "hydra.sweeper.n_trials=4", *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hydra.sweeper.pruner=median is off: Optuna prunes single-objective searches only" in result.stdout
    study = study_of(folder)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    for trial in study.trials:  # each value the run's own figure
        recorded = json.loads((folder / trial.user_attrs["folder"] / "result.json").read_text())["metrics"]
        assert trial.values == [recorded["val/acc_best"], recorded["time/epoch_s"]]
    front = study.best_trials
    assert yaml.safe_load((folder / "optimization_results.yaml").read_text()) == {
        "name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in front]}
    assert (folder / "pareto_front.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (folder / "report.md").read_text()
    assert "## Trials (hydra/sweeper=optuna, val/acc_best maximized, time/epoch_s minimized)" in report
    assert f"### Pareto front: {len(front)} of 4 trials" in report and "![the front: val/acc_best against time/epoch_s](pareto_front.png)" in report
    listed = report.split("### Pareto front")[1]
    assert all(f"| {t.number + 1} | complete | {t.values[0]:.4f} | {t.values[1]:.4f} |" in listed for t in front)
    assert result.stdout.splitlines()[-2].startswith("Pareto front of 4 trials: trial ")


def told_values(study: optuna.Study, values: dict[int, object]):
    """A project launcher that runs nothing: it tells each trial its value from `values` by number."""
    from src.launch.sequential_launcher import ProjectLauncher

    class Telling(ProjectLauncher):
        def launch_each(self, next_job, count, first, at_once, ended):
            while (job := next_job()) is not None:
                study.tell(job[0], values[job[0]])
                ended(job[0], JobReturn(status=JobStatus.COMPLETED, _return_value=Result({}, "")))
            return []

    return Telling()


def sweeper_in(folder: Path, ckpt: str | None = None, **settings) -> OptunaSweeper:
    """The sweeper as Hydra makes it for a sweep of `folder`, its space's check left out (no config to compose)."""
    sweeper = OptunaSweeper(**{**SETTINGS, **settings})
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}}, "ckpt_path": ckpt})
    sweeper.check, sweeper.launcher = (lambda space: None), "a launcher never reached"
    return sweeper


def test_a_search_of_one_objective_writes_its_best_in_optimization_results_as_hydras_plugin_does(tmp_path):
    import yaml

    study = optuna.create_study(storage=storage(tmp_path / DB), study_name="s", direction="maximize")
    sweeper = sweeper_in(tmp_path, n_trials=3, ckpt="auto")
    sweeper.launcher = told_values(study, {0: 0.5, 1: 0.9, 2: 0.7})
    sweeper.sweep([LR])
    top = study_of(tmp_path).trials[1]
    assert yaml.safe_load((tmp_path / "optimization_results.yaml").read_text()) == {
        "name": "optuna", "best_params": top.params, "best_value": 0.9}
    assert not (tmp_path / "pareto_front.png").exists()


def test_a_cost_not_reached_counts_as_the_worst_and_another_apps_return_is_its_value(tmp_path):
    from src.launch.optuna_sweeper import objective, returned

    run = Result({"val/acc_best": 0.86}, "", time_to_accuracy=[{"target": 0.85, "seconds": 12.5, "step": 40},
                                                              {"target": 0.9, "seconds": None, "step": None}])
    assert objective(run, "time/s_to_val_acc_0.85", "minimize") == 12.5
    assert objective(run, "time/s_to_val_acc_0.90", "minimize") == float("inf")
    assert objective(run, "time/s_to_val_acc_0.90", "maximize") == float("-inf")
    assert objective(run, "time/s_to_val_acc_0.95", "minimize") is None  # no such target: the trial fails
    assert returned(0.5, 1) == [0.5] and returned((1, 2.5), 2) == [1.0, 2.5]
    assert returned("0.5", 1) is None and returned([1.0], 2) is None and returned(float("nan"), 1) is None
    assert returned(True, 1) is None


@pytest.mark.parametrize("settings, said", [
    (dict(direction=["maximize", "minimize"]), r"^hydra\.sweeper\.objectives=val/acc_best is not allowed with "
                                               r"hydra\.sweeper\.direction=\[maximize, minimize\]: it must name one metric"),
    (dict(objectives=["test/acc"]), r"^hydra\.sweeper\.objectives=\['test/acc'\] is not allowed; it must be a list of metrics"),
    (dict(direction=["up"]), r"^hydra\.sweeper\.direction=\['up'\] is not allowed; it must be one of: maximize, minimize"),
    (dict(storage="mysql://u@h/db"), r"^hydra\.sweeper\.storage=mysql://u@h/db is not allowed; it must be a database URL: "
                                     r"sqlite:///<file> or postgresql://"),
    (dict(storage="postgresql://u:secret@h/db"), r"^hydra\.sweeper\.storage=postgresql://\.\.\. needs the psycopg\[binary\] "
                                                 r"package, which is not installed; install it with: .* -m pip install 'psycopg\[binary\]'$"),
    (dict(storage="postgresql+psycopg2://u:secret@h/db"), r"^hydra\.sweeper\.storage=postgresql\+psycopg2://\.\.\. needs the "
                                                          r"psycopg2-binary package"),
])
def test_objectives_directions_and_a_storage_url_out_of_range_are_one_line(monkeypatch, settings, said):
    for driver in ("psycopg", "psycopg2"):
        monkeypatch.setitem(sys.modules, driver, None)  # as where it is not installed
    with pytest.raises(UsageError, match=said) as refused:
        OptunaSweeper(**{**SETTINGS, **settings})
    assert "\n" not in str(refused.value) and "secret" not in str(refused.value)


def test_a_resume_with_other_directions_or_objectives_is_refused_in_one_line(tmp_path):
    study = optuna.create_study(storage=storage(tmp_path / DB), study_name="s", directions=["maximize", "minimize"])
    study.set_user_attr("objectives", ["val/acc_best", "time/epoch_s"])
    sweeper = sweeper_in(tmp_path, ckpt="auto")
    with pytest.raises(UsageError, match=re.escape(f"hydra.sweeper.direction=maximize is not allowed in a resume of "
                                                   f"{tmp_path}: its study's direction is [maximize, minimize]")):
        sweeper.sweep([LR])
    sweeper = sweeper_in(tmp_path, ckpt="auto", direction=["maximize", "minimize"],
                         objectives=["val/acc_best", "time/s_to_val_acc_0.85"])
    with pytest.raises(UsageError, match=re.escape(
            f"hydra.sweeper.objectives=[val/acc_best, time/s_to_val_acc_0.85] is not allowed in a resume of {tmp_path}: "
            "its study's objectives are [val/acc_best, time/epoch_s]")):
        sweeper.sweep([LR])


def test_the_fastest_setting_to_090_search_of_the_docs_composes_each_corner_of_its_space():
    import shlex

    from src.config import check
    from src.launch.optuna_sweeper import search_space
    from tests.helpers import REPO, composed

    [line, again] = [line for page in (REPO / "docs" / "sweeps.md", REPO / "README.md")
                     for line in page.read_text().splitlines()
                     if "time/s_to_val_acc_0.90]" in line and line.startswith(".venv/bin/python")]
    assert again == line  # the README's is the same search
    args = shlex.split(line)[4:]
    typed = dict(arg.split("=", 1) for arg in args if arg.startswith("hydra.sweeper."))
    OptunaSweeper(**{**SETTINGS, "n_trials": int(typed["hydra.sweeper.n_trials"]),
                     "direction": ["maximize", "minimize"], "objectives": ["val/acc_best", "time/s_to_val_acc_0.90"]})
    assert typed["hydra.sweeper.objectives"] == "[val/acc_best,time/s_to_val_acc_0.90]"
    space = search_space([arg for arg in args if not arg.startswith("hydra")])
    assert set(space.distributions) == {"strategy", "precision", "data.batch_size", "optim.lr"}
    for point in space.corners():
        cfg = composed(*space.overrides(point))
        assert 0.9 in cfg.callbacks.time_to_accuracy.targets  # the target is timed


def test_a_resume_never_takes_a_storage_url_from_the_sweeps_record(tmp_path):
    from src.records import launch_settings

    lines = ["hydra/sweeper=optuna", "hydra.sweeper.storage=postgresql://me@db/search", "hydra.sweeper.study_name=lr",
             "hydra.sweeper.storage='sqlite:///elsewhere.db'"]
    assert launch_settings(lines, tmp_path / "multirun.yaml") == ["hydra/sweeper=optuna", "hydra.sweeper.study_name=lr"]


def test_two_sweep_folders_share_one_study_and_each_resumes_only_the_trials_it_left(tmp_path):
    """Sweep a left trial 1 running (stopped); sweep b, beside it, must not take it over: it asks new trials until the
    study has n_trials, counting a's. Then a's resume runs its own trial 1 and asks nothing more."""
    url, shared = f"sqlite:///{tmp_path / 'shared.db'}", dict(storage=f"sqlite:///{tmp_path / 'shared.db'}", study_name="lr")
    first = sweeper_in(tmp_path / "a", n_trials=1, **shared)
    study = optuna.create_study(storage=storage(url), study_name="lr", direction="maximize")
    first.launcher = told_values(study, {0: 0.6})
    first.sweep([LR])
    left = study.ask({"optim.lr": FloatDistribution(0.001, 1.0, log=True)})  # as a's next command asked, then stopped
    left.set_user_attr("sweep", OptunaSweeper.tag(tmp_path / "a"))
    left.set_user_attr("folder", "run1")
    beside = sweeper_in(tmp_path / "b", n_trials=4, **shared)
    beside.launcher = told_values(study, {2: 0.7, 3: 0.8})
    beside.sweep([LR])
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.COMPLETE, TrialState.COMPLETE]
    assert [t.user_attrs["sweep"].rsplit("/", 1)[1] for t in study.trials] == ["a", "a", "b", "b"]
    with pytest.raises(UsageError, match=f"hydra.sweep.dir={tmp_path / 'a'} ran trials of the study lr before; continue "
                                         "them with ckpt_path=auto"):
        sweeper_in(tmp_path / "a", n_trials=4, **shared).sweep([LR])
    again = sweeper_in(tmp_path / "a", n_trials=4, ckpt="auto", **shared)
    again.launcher = told_values(study, {1: 0.9})
    again.sweep([LR])
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4 and study.best_trial.number == 1
    assert not (tmp_path / "a" / DB).exists() and not (tmp_path / "b" / DB).exists()
    assert place(study.trials[1], tmp_path / "a") == str(tmp_path / "a" / "run1")  # b's report names a's folder so
    assert place(study.trials[1], tmp_path / "b") == f"{OptunaSweeper.tag(tmp_path / 'a')}/run1"


def test_a_trial_another_sweep_asked_for_first_past_n_trials_is_never_run(tmp_path, monkeypatch):
    """Two sweeps of one study ask at the same moment for its last trial: Optuna numbers them in turn, and the one
    numbered past n_trials is marked not run, failed, and launches nothing."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(storage=storage(url), study_name="lr", direction="maximize")
    ask = optuna.Study.ask

    def raced(self, *args, **kwargs):  # the other sweep's ask lands first
        monkeypatch.setattr(optuna.Study, "ask", ask)
        ask(self, *args, **kwargs).set_user_attr("sweep", "elsewhere:/other")
        return ask(self, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "ask", raced)
    sweeper = sweeper_in(tmp_path / "a", n_trials=1, storage=url, study_name="lr")
    sweeper.launcher = told_values(study, {})
    sweeper.sweep([LR])
    mine = study.trials[1]
    assert mine.state == TrialState.FAIL and mine.user_attrs["not run"] == "asked for after the study had its n_trials=1"
    assert study.trials[0].state == TrialState.RUNNING  # the other sweep's, running there

"""Crafted folders: whoever can write a run folder, a sweep folder or a study cannot run code, read secrets or write
outside the folder in the account of whoever resumes, scores, reports or searches from it (docs/security.md).

Every case calls the entry point's own function in this process with a harmless payload that would leave a mark if
it acted (a folder made, a file written, an environment variable read), and checks the one line it is refused with and
that the mark never appears. tests/test_records.py keeps one command line per entry point."""

import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from src import config, records, resume
from src.checkpoints import AtomicCheckpointIO, clean_partial
from src.errors import UsageError
from src.folders import write_file
from src.launch import lock, naming
from src.launch.optuna_sweeper import DB, OptunaSweeper, search_space
from src.launch.slurm_launcher import check_private
from src.models.module import Classifier
from src.report import main as report_main
from tests.helpers import QUICK, call_main, train_here
from tests.test_scaling import write_ddp_run

SECRET = "CRAFTED_FOLDER_SECRET"


def run_folder(tmp_path: Path, *lines: str) -> Path:
    """A run folder as a resume reads it: its overrides (the run's own, then `lines`) and a checkpoint."""
    folder = tmp_path / "run"
    (folder / ".hydra").mkdir(parents=True)
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"")
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["model=lenet", "optim.lr=0.05", *lines]))
    return folder


def resume_run(folder: Path, *typed: str, word: str = "last") -> list[str]:
    return resume.with_record([f"ckpt_path={word}", f"hydra.run.dir={folder}", *typed])


def refused_line(path: Path, key: str) -> str:
    return rf"^{re.escape(f'{path}: {key}=')}.* is not allowed in a run's records; "


# ------------------------------------------------------------------ a run's recorded overrides


@pytest.mark.parametrize("line, key", [
    (f"tags=[$\\{{oc.env:{SECRET}\\}}]", "tags"),  # an escaped interpolation: Hydra would unescape it
    ("data.root=$\\{claim_dir:{made}\\}", "data.root"),
    ("data.root=${claim_dir:{made}}", "data.root"),
    ("+strategy@hydra.callbacks.x=auto", "strategy@hydra.callbacks.x"),  # a package: a config node placed anywhere
    ("model=../{made}/evil", "model"),  # a config choice written as a path
    ("strategy.hook=os.system", "strategy.hook"),  # a function named by import path
    ("+callbacks.evil._target_=builtins.open", "callbacks.evil._target_"),
    ("model.loss._target_=builtins.open", "model.loss._target_"),
    ("output_dir={made}", "output_dir"),  # where the run writes
    ("hydra.job.name={made}", "hydra.job.name"),
    ("hydra.callbacks.evil._target_=builtins.open", "hydra.callbacks.evil._target_"),
    ("tags=[one\nline]", "tags"),
    ("tags=[\x1b]0;title\x07]", "tags"),  # a terminal escape
    ("+optim.evil=1", "optim.evil"),  # a key added that no schema knows
])
@pytest.mark.parametrize("word", ["last", "auto"])
def test_a_recorded_override_that_is_not_a_plain_value_is_refused_in_one_line(tmp_path, monkeypatch, line, key, word):
    made = tmp_path / "made"
    monkeypatch.setenv(SECRET, "leaked")
    folder = run_folder(tmp_path, line.replace("{made}", str(made)))
    with pytest.raises(UsageError) as refused:
        resume_run(folder, word=word)
    said = str(refused.value)
    assert re.match(refused_line(folder / ".hydra" / "overrides.yaml", key), said), said
    assert "\n" not in said and "\x1b" not in said and "leaked" not in said
    assert not made.exists()


def test_a_runs_plain_settings_are_taken_as_recorded_and_the_typed_ones_win(tmp_path):
    """Each value taken is written out again from the value it was read as (`0.10` is the number 0.1, `'x'` is text
    that needs no quotes); where the run read its data is the command's, never the record's."""
    folder = run_folder(tmp_path, "tags=['a',b]", "precision=bf16-mixed", "data.root='/data/a b'",
                        "+trainer.overfit_batches=2", "~callbacks.step_checkpoint", "strategy.hook=powersgd",
                        "trainer.max_time=00:01:00:00", "optim.momentum=0.90", "ckpt_path=/elsewhere/x.ckpt")
    args = resume_run(folder, "optim.lr=0.1")
    assert args == ["model=lenet", "tags=[a,b]", "precision=bf16-mixed", "+trainer.overfit_batches=2",
                    "~callbacks.step_checkpoint", "strategy.hook=powersgd", "trainer.max_time=00:01:00:00",
                    "optim.momentum=0.9", "ckpt_path=last", f"hydra.run.dir={folder}", "optim.lr=0.1"]


WHERE_AND_WHO = ["data.download=true", "logger.tensorboard.version=../../x",
                 "logger.tensorboard.name=x", "logger.csv.name=x", "logger.mlflow.artifact_location=/elsewhere",
                 "logger.wandb.offline=false", "logger.mlflow.tracking_uri=sqlite:////elsewhere/x.db",
                 "callbacks.last_checkpoint.dirpath=/elsewhere", "callbacks.best_checkpoint.filename=x",
                 "strategy.hook_state.x=1", "trainer.default_root_dir=/elsewhere", "+trainer.weights_save_path=x"]


@pytest.mark.parametrize("word", ["last", "auto"])
def test_where_a_run_reads_writes_and_logs_is_never_taken_from_its_record(tmp_path, word):
    """A logger's `version` in a record moved the resumed run's events two folders up; `data.download=true` beside
    a recorded `data.root` downloaded into it; `offline=false` would upload: a record carries only what the run
    computes, and where it reads, writes and logs come from conf/ and the command."""
    folder = run_folder(tmp_path, "data.root=/elsewhere", *WHERE_AND_WHO)
    assert resume_run(folder, word=word) == ["model=lenet", "optim.lr=0.05", f"ckpt_path={word}",
                                             f"hydra.run.dir={folder}"]
    sweep = sweep_folder(tmp_path, ["seed=1,2", "data.root=/elsewhere", *WHERE_AND_WHO])
    assert resume.with_record(["-m", f"hydra.sweep.dir={sweep}", "ckpt_path=auto"]) == [
        "seed=1,2", "-m", f"hydra.sweep.dir={sweep}", "ckpt_path=auto"]


KEYS = st.one_of(st.sampled_from(sorted({*config.RULES, *(line.partition("=")[0].lstrip("+") for line in WHERE_AND_WHO)})),
                 st.from_regex(r"[a-z]{1,8}(\.[a-z_]{1,12}){0,3}", fullmatch=True))
VALUES = st.one_of(st.sampled_from(["1", "0.5", "true", "null", "x", "/elsewhere", "../..", "'a b'", "[a,b]"]),
                   st.text(max_size=12))


@settings(max_examples=400, deadline=None)
@given(lines=st.lists(st.tuples(st.sampled_from(["", "+", "~", "++"]), KEYS, VALUES), max_size=6))
def test_a_record_yields_only_carried_keys_with_plain_values_or_a_one_line_refusal(tmp_path_factory, lines):
    """Whatever a run's record holds, what a resume takes from it is a key `records.carried` names (or a group's
    option, or a callback left out) with a plain value; anything else is skipped or refused in one line."""
    path = tmp_path_factory.mktemp("record") / "overrides.yaml"
    recorded = [f"{prefix}{key}={value}" for prefix, key, value in lines]
    try:
        taken = records.settings(recorded, path)
    except UsageError as refused:
        assert str(refused).startswith(f"{path}: ") and "\n" not in str(refused)
        return
    for line in taken:
        prefix = re.match(r"\+\+|\+|~|", line).group()
        key, _, value = line[len(prefix):].partition("=")
        assert key in config.GROUPS or records.carried(key) or prefix == "~" and key.startswith("callbacks.")
        assert records.plain(value, sweep=False) or key in config.GROUPS


def test_a_recorded_hook_of_ones_own_is_refused_but_typed_again_it_is_the_commands(tmp_path):
    folder = run_folder(tmp_path, "strategy.hook=tests.faults.hook")
    with pytest.raises(UsageError, match="a hook of one's own"):
        resume_run(folder)
    assert resume_run(folder, "strategy.hook=tests.faults.hook")[-1] == "strategy.hook=tests.faults.hook"


# ------------------------------------------------------------------ a sweep's record


def sweep_folder(tmp_path: Path, task: list[str], hydra: list[str] = ()) -> Path:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task, "hydra": list(hydra)}}}))
    return sweep


def test_a_sweeps_record_reaches_its_jobs_only_as_plain_values(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET, "leaked")
    sweep = sweep_folder(tmp_path, ["seed=1,2", f"tags=[$\\{{oc.env:{SECRET}\\}}]"])
    with pytest.raises(UsageError, match=refused_line(sweep / "multirun.yaml", "tags")):
        resume.with_record(["-m", "seed=1,2", f"hydra.sweep.dir={sweep}", "ckpt_path=auto"])


def test_a_sweeps_launcher_and_sweeper_come_back_by_name_with_their_plain_settings_alone(tmp_path):
    hydra = ["hydra/launcher=slurm", "hydra.launcher.timeout_min=30", "hydra.launcher.partition=gpu",
             "hydra.launcher.setup=[touch /tmp/x]", "hydra.launcher.setup='touch /tmp/x'",
             "hydra.launcher.submitit_folder=/tmp/x", "hydra.launcher._target_=os.system", "hydra/launcher=../x",
             "hydra.launcher.comment=${oc.env:HOME}", "hydra/sweeper=optuna", "hydra.sweep.dir=/tmp/x",
             "hydra.callbacks.evil._target_=os.system"]
    sweep = sweep_folder(tmp_path, ["seed=1,2", "optim.lr=tag(log, interval(0.001, 1))"], hydra)
    args = resume.with_record(["-m", f"hydra.sweep.dir={sweep}", "ckpt_path=auto"])
    assert args == ["hydra/launcher=slurm", "hydra.launcher.timeout_min=30", "hydra.launcher.partition=gpu",
                    "hydra/sweeper=optuna", "seed=1,2", "optim.lr=tag(log, interval(0.001, 1.0))", "-m",
                    f"hydra.sweep.dir={sweep}", "ckpt_path=auto"]


# ------------------------------------------------------------------ checkpoints, studies, submitit's folder


def saved_checkpoint(path: Path, **extra) -> Path:
    net = {"_target_": "src.models.lenet.LeNet", "in_channels": 1, "num_classes": 10}
    torch.save({"state_dict": {}, "hyper_parameters": {"net": net, "num_classes": 10}, **extra}, path)
    return path


@pytest.mark.parametrize("change, key", [
    (lambda c: c["hyper_parameters"]["net"].update(_target_="src.loggers.MLflowRunLogger"), "net._target_"),
    (lambda c: c.update(hparams={"net": {"_target_": "builtins.open"}}), "hparams"),
    (lambda c: c.update(module_arguments={"loss": {"_target_": "builtins.open"}}), "module_arguments"),
])
def test_a_checkpoint_builds_only_what_conf_names_for_each_slot_and_no_legacy_keys(tmp_path, change, key):
    path = saved_checkpoint(tmp_path / "x.ckpt")
    contents = torch.load(path, weights_only=True)
    change(contents)
    torch.save(contents, path)
    with pytest.raises(UsageError, match=re.escape(f"{path}: ")):
        Classifier.load_from_checkpoint(path)
    assert not (tmp_path / "mlruns").exists()


def test_a_study_point_outside_the_space_typed_is_never_run(tmp_path):
    space = search_space(["optim.lr=tag(log, interval(0.001, 1))", "model=choice(lenet,resnet18)"])
    assert space.holds({"optim.lr": 0.01, "model": "lenet"})
    assert not space.holds({"optim.lr": f"${{oc.env:{SECRET}}}", "model": "lenet"})
    assert not space.holds({"optim.lr": 0.01, "model": "${oc.env:HOME}"})
    assert not space.holds({"optim.lr": 5.0, "model": "lenet"})
    assert not space.holds({"optim.lr": 0.01})


@pytest.mark.parametrize("contents", [b"", os.urandom(4096), b"SQLite format 3\x00" + b"\x00" * 200],
                         ids=["empty", "random bytes", "half written"])
def test_a_damaged_study_is_one_line_naming_the_file_and_how_to_start_over(tmp_path, contents):
    from tests.test_optuna_sweeper import SETTINGS
    (tmp_path / DB).write_bytes(contents)
    sweeper = OptunaSweeper(**SETTINGS)
    sweeper.config = OmegaConf.create({"ckpt_path": "auto"})
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / DB}: cannot be read as an Optuna study (")):
        sweeper.open_study(tmp_path)


def test_submitits_folder_must_be_the_users_alone(tmp_path):
    base = tmp_path / "sweep" / ".submitit"
    (base / "1_0").mkdir(parents=True, mode=0o700)
    (tmp_path / "sweep").chmod(0o755)
    check_private(base)
    (base / "1_0").chmod(0o777)
    with pytest.raises(UsageError, match=re.escape(f"{base / '1_0'} is not private to this user")):
        check_private(base)
    (base / "1_0").chmod(0o700)
    (tmp_path / "sweep").chmod(0o775)
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'sweep'} is not private")):
        check_private(base)


# ------------------------------------------------------------------ links, aliases, sizes, control characters


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "start-up file"
    path.write_text("as it was\n")
    return path


def test_a_record_written_through_a_link_is_refused_and_the_target_is_untouched(tmp_path):
    target, folder = victim(tmp_path), tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").symlink_to(target)
    with pytest.raises(UsageError, match=re.escape(f"{folder / 'config.yaml'} is a symbolic link")):
        write_file(folder / "config.yaml", "seed: 1\n")
    write_file(folder / "result.json", "{}")  # a file of the folder's own is written as before
    assert target.read_text() == "as it was\n" and (folder / "result.json").read_text() == "{}"
    assert not list(folder.glob(".*.partial"))


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_in_one_line(tmp_path, kind):
    target, folder = victim(tmp_path), tmp_path / "run"
    folder.mkdir()
    if kind == "link":
        (folder / lock.LOCK).symlink_to(target)
    else:
        os.mkfifo(folder / lock.LOCK)
    with pytest.raises(UsageError, match=re.escape(str(folder / lock.LOCK))):
        with lock.held(folder):
            pass
    assert target.read_text() == "as it was\n"


def test_a_log_that_is_a_link_is_closed_unwritten_and_refused(tmp_path):
    import logging

    target, folder = victim(tmp_path), tmp_path / "run"
    folder.mkdir()
    (folder / "train.log").symlink_to(target)
    handler = logging.FileHandler(folder / "train.log", delay=True)  # as conf/hydra/default.yaml has Hydra open it
    logging.root.addHandler(handler)
    try:
        with pytest.raises(UsageError, match="train.log is a symbolic link"):
            naming.check_own_logs(folder)
        logging.getLogger("src.train").warning("a line after the refusal")
    finally:
        logging.root.removeHandler(handler)
        handler.close()
    assert target.read_text() == "as it was\n"


def test_a_checkpoint_never_writes_through_a_link_planted_at_its_partial_name(tmp_path):
    target, folder = victim(tmp_path), tmp_path / "checkpoints"
    folder.mkdir()
    (folder / f".last.ckpt.{os.getpid()}.partial").symlink_to(target)
    AtomicCheckpointIO().save_checkpoint({"epoch": 0}, folder / "last.ckpt")
    assert target.read_text() == "as it was\n"
    assert torch.load(folder / "last.ckpt", weights_only=True) == {"epoch": 0}


def test_a_linked_checkpoints_folder_keeps_working_and_only_its_own_partial_files_go(tmp_path):
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch, target_is_directory=True)
    (scratch / ".notes.partial").write_text("someone's")
    (scratch / ".last.ckpt.123.partial").write_text("cut short")
    clean_partial(run)
    assert (scratch / ".notes.partial").exists() and not (scratch / ".last.ckpt.123.partial").exists()
    AtomicCheckpointIO().save_checkpoint({"epoch": 1}, run / "checkpoints" / "last.ckpt")
    assert (scratch / "last.ckpt").is_file()


def test_a_report_is_never_written_through_a_link(tmp_path):
    root = tmp_path / "outputs"
    write_ddp_run(root / "run")
    target = victim(tmp_path)
    (root / "report.md").symlink_to(target)
    result = call_main(report_main, str(root))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {root / 'report.md'} is a symbolic link")
    assert target.read_text() == "as it was\n"


@pytest.mark.parametrize("text, why", [
    ("a: &a [x, x]\nb: [*a, *a]\n", "anchor or alias"),  # nine levels of these are a gigabyte
    ("a: &a [*a]\n", "anchor or alias"),  # one that refers to itself
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "recursion"),
    ("a: " + "x" * (records.LIMIT + 1) + "\n", "larger than"),
])
def test_a_record_that_would_hang_or_crash_is_refused_in_one_line(tmp_path, text, why):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(f"{path}: cannot be read as a record (")) as refused:
        records.load(path)
    assert "\n" not in str(refused.value)


def test_a_record_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "overrides.yaml")
    with pytest.raises(UsageError, match="not a regular file"):
        records.load(tmp_path / "overrides.yaml")


def test_a_results_line_is_read_with_its_control_characters_escaped(tmp_path):
    (tmp_path / records.RESULT).write_text(
        '{"metrics": {"test/acc": 0.5}, "line": "done\\necho owned >> ~/.bashrc\\u001b]0;t\\u0007", "step": 3}')
    line = records.result(tmp_path).line
    assert line == "done\\necho owned >> ~/.bashrc\\x1b]0;t\\x07" and line.isprintable()


def test_eval_builds_nothing_a_runs_config_would_build_otherwise(tmp_path):
    """`data: {_partial_: true}` in a run's config.yaml: src.eval would build a function instead of the data."""
    from src.eval import as_trained
    from tests.helpers import composed

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = composed("ckpt_path=" + str(run / "checkpoints" / "last.ckpt"), run_dir=tmp_path / "eval",
                   config_name="eval")
    saved = OmegaConf.to_container(cfg.data, resolve=True)  # as a run's config.yaml holds it
    saved["_partial_"] = True
    (run / "config.yaml").write_text(yaml.safe_dump({"model_name": "lenet", "data": saved}))
    with pytest.raises(UsageError, match=re.escape("builds the data with data._partial_=True")):
        as_trained(cfg, [], "data")


def test_a_report_leaves_out_a_run_whose_hydra_record_would_hang_it(tmp_path):
    root = tmp_path / "outputs"
    write_ddp_run(root / "good")
    bomb = write_ddp_run(root / "bomb")
    (bomb / ".hydra").mkdir()
    (bomb / ".hydra" / "hydra.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a]\n"
                                                "hydra: {job: {name: train}, c: [*b, *b, *b, *b, *b, *b]}\n")
    result = call_main(report_main, str(root))
    assert result.returncode == 0, result.stderr
    assert f"warning: {bomb}: left out ({bomb / '.hydra' / 'hydra.yaml'}: cannot be read as a record (" in result.stderr
    assert "| good |" in (root / "report.md").read_text()


def test_a_runs_hydra_folder_that_is_a_link_is_refused(tmp_path, capsys, data_root):
    from tests.helpers import QUICK
    from tests.test_data_kept import run_job_here

    elsewhere, folder = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    folder.mkdir()
    (folder / ".hydra").symlink_to(elsewhere, target_is_directory=True)
    status, line = run_job_here(*QUICK, run_dir=folder, capsys=capsys)
    assert status == 2 and line == (f"error: {folder / '.hydra'} is a symbolic link; a run reads and writes only files of "
                                    "its own folder, never through a link: remove the link, or use another folder")
    assert not list(elsewhere.iterdir())


# ------------------------------------------------------------------ a sweep job's folder, named by its swept values


@pytest.mark.parametrize("label", ["", "lenet_auto_1dev_32-true"])
def test_a_swept_value_with_a_path_names_one_folder_inside_the_sweep(tmp_path, label):
    """`data.root=<root>,/../../../<elsewhere>` in multirun.yaml put a resumed job's whole run in <elsewhere>."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    escape = "/../../../elsewhere"
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": [f"data.root=a,{escape}"]}}}))
    name = naming.sweep_job_dirname([f"data.root={escape}"], 1, str(sweep), label)
    assert (sweep / name).resolve().parent == sweep.resolve(), name
    assert name != naming.sweep_job_dirname(["data.root=a"], 0, str(sweep), label)


@settings(max_examples=500, deadline=None)
@given(texts=st.lists(st.text(max_size=300), min_size=2, max_size=2, unique=True))
def test_every_text_names_one_folder_of_its_own(texts):
    """Any swept value (a path, `..`, control characters, a long text) is one folder below the sweep, never above it
    or hidden, at most 255 bytes, and two values never share a folder."""
    names = [naming.folder_name(text, "job0") for text in texts]
    for name in names:
        assert name and "/" not in name and "\0" not in name and not name.startswith(".")
        assert all(char.isprintable() for char in name) and len(name.encode()) <= 255
    assert names[0] != names[1] or "" in texts


def test_a_study_named_like_a_resolver_reaches_no_job_as_text(tmp_path, monkeypatch):
    """A study renamed in optuna.db to `${oc.env:...}` was passed to each job as a quoted override, which Hydra's
    grammar still interpolates: the job printed the variable's value. Jobs get the study's id, a number."""
    import optuna
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from src.launch.optuna_sweeper import TrialRecord, storage
    from tests.test_optuna_sweeper import LR, SETTINGS, Batches

    monkeypatch.setenv(SECRET, "leaked")
    study = optuna.create_study(storage=storage(tmp_path / DB), study_name=f"${{oc.env:{SECRET}}}",
                                direction="maximize")
    sweeper = OptunaSweeper(**{**SETTINGS, "n_trials": 1})
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "ckpt_path": "auto"})
    launcher = sweeper.launcher = Batches(study)
    given = []
    launcher.launch = lambda job_overrides, initial_job_idx: given.extend(job_overrides) or []
    sweeper.check = lambda space: None
    sweeper.sweep([LR])
    [overrides] = given
    job = OmegaConf.create()
    for override in OverridesParser.create().parse_overrides(overrides):
        OmegaConf.update(job, override.key_or_group.lstrip("+"), override.value(), force_add=True)
    resolved = OmegaConf.to_container(job, resolve=True)
    assert "leaked" not in str(resolved)
    reached = resolved["callbacks"]["optuna_trial"]
    assert TrialRecord(reached["db"], reached["study"], reached["trial"]).study.study_name == study.study_name


def test_a_loggers_version_in_a_record_never_moves_where_a_resume_writes(tmp_path, quick_run):
    """`logger.tensorboard.version=../../x` in overrides.yaml and config.yaml: the resume wrote its events two folders
    above the run. The record does not carry it, and the run's config holds it: one line that says to type it."""
    run_dir = quick_run.copy(tmp_path)
    overrides = run_dir / ".hydra" / "overrides.yaml"
    overrides.write_text(yaml.safe_dump([*yaml.safe_load(overrides.read_text()), "logger.tensorboard.version=../../x"]))
    recorded = run_dir / "config.yaml"
    recorded.write_text(recorded.read_text().replace("    version: ''", "    version: ../../x", 1))
    before = sorted(p for p in tmp_path.rglob("*") if p.name != ".lock")
    result = train_here(*QUICK, "ckpt_path=last", "max_epochs=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: logger.tensorboard.version= is not allowed in a resume of {run_dir}: the run used "
        "logger.tensorboard.version=../../x, which a record never sets (where a run reads its data, writes and logs "
        "come from the command); type logger.tensorboard.version=../../x to go on with it, or start a new run (without ckpt_path)"]
    assert sorted(p for p in tmp_path.rglob("*") if p.name != ".lock") == before


def test_a_sweep_record_naming_millions_of_jobs_is_one_line(tmp_path):
    """`seed=range(0,300000000)` in multirun.yaml: a resume hung building the jobs."""
    sweep = sweep_folder(tmp_path, ["seed=range(0,300000000)"])
    with pytest.raises(UsageError) as refused:
        resume.with_record(["-m", f"hydra.sweep.dir={sweep}", "ckpt_path=auto"])
    assert re.match(refused_line(sweep / "multirun.yaml", "seed"), str(refused.value))
    assert "at most 10,000 values of a key" in str(refused.value) and "\n" not in str(refused.value)
    (tmp_path / "small").mkdir()
    small = sweep_folder(tmp_path / "small", ["seed=range(0,3)"])
    assert resume.with_record(["-m", f"hydra.sweep.dir={small}", "ckpt_path=auto"])[0] == "seed=range(0, 3)"


# ------------------------------------------------------------------ what used to end in a traceback


def test_a_yaml_date_in_a_runs_config_is_one_line(tmp_path):
    """`seed: 2026-12-07` in config.yaml is a date to YAML: src.eval ended in a traceback."""
    (tmp_path / "config.yaml").write_text("seed: 2026-12-07\nmodel_name: lenet\n")
    with pytest.raises(UsageError, match=r"config\.yaml: seed=2026-12-07 is not allowed in a run's records; it is a "
                                         r"date, where a record holds text"):
        records.config(tmp_path / "config.yaml")


@pytest.mark.parametrize("value", ["\uff04{oc.env:X}", "caf\u00e9", "\u0455eed"])
def test_a_look_alike_character_in_a_record_is_refused_naming_its_key(tmp_path, value):
    """A fullwidth `$` or `{` passed the pattern, and Hydra's lexer then blamed the first typed argument."""
    path = tmp_path / "overrides.yaml"
    with pytest.raises(UsageError, match=refused_line(path, "tags")):
        records.settings([f"tags=[{value}]"], path)
    with pytest.raises(UsageError):
        records.settings([f"{value}=1"], path)
    assert records.settings([f"tags=['{value}']"], path) == [f"tags=['{value}']"]  # quoted, Hydra reads any text


def test_a_trial_attribute_that_is_text_is_shown_as_text(tmp_path):
    """A non-numeric `test/acc` in a study's trial ended the search's summary in a traceback."""
    import optuna

    from src.launch.optuna_sweeper import best, storage, trials_table

    study = optuna.create_study(storage=storage(tmp_path / DB), study_name="s", direction="maximize")
    trial = study.ask()
    trial.suggest_float("optim.lr", 0.01, 0.1)
    trial.set_user_attr("test/acc", "\x1b[2Jhigh")
    trial.set_user_attr("val/acc_best", [1])
    study.tell(trial, 0.5)
    assert "test/acc=\\x1b[2Jhigh" in best(study, tmp_path)
    row = trials_table(study, tmp_path).splitlines()[-1]
    assert "\\x1b\\[2Jhigh" in row and "\\[1\\]" in row and "\x1b" not in row


def test_a_full_disk_while_reporting_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    import src.report

    write_ddp_run(tmp_path / "sweep" / "run")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "sweep" / "report" / "report.md"))

    monkeypatch.setattr(src.report, "write_file", full)
    with pytest.raises(SystemExit) as ended:
        report_main([str(tmp_path / "sweep")])
    assert ended.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'sweep' / 'report' / 'report.md'}: No space left on device")


@pytest.mark.parametrize("kind", ["flood", "fifo"])
def test_a_run_whose_event_files_would_flood_or_block_a_reader_is_left_out_in_one_line(tmp_path, kind, capsys):
    """A 135 MB event file of repeated records, or a FIFO in its place, made src.report hang."""
    run = write_ddp_run(tmp_path / "sweep" / "run")
    events = run / "events.out.tfevents.1.host.1.1"
    if kind == "flood":
        with open(events, "wb") as file:
            file.truncate(65 * 2**20)  # sparse: no disk taken
    else:
        os.mkfifo(events)
    result = call_main(report_main, str(tmp_path / "sweep"))
    assert result.returncode == 2
    why = "its event files hold more than 64 MiB" if kind == "flood" else "one of its event files"
    assert result.stderr.strip().splitlines() == [line for line in result.stderr.strip().splitlines()
                                                  if line.startswith(f"error: {run}: left out ({why}")] != []


@pytest.mark.parametrize("name", ["metrics.csv", "hparams.yaml"])
@pytest.mark.parametrize("kind", ["fifo", "link", "hard link"])
def test_a_csv_loggers_file_that_is_not_its_own_is_refused_before_lightning_opens_it(tmp_path, name, kind):
    """Lightning's CSV writer opens `csv/metrics.csv` and `csv/hparams.yaml` by their names: a FIFO there kept a resume
    waiting for ever; a link or a second name would carry its rows elsewhere. The logger refuses them as it is made."""
    from src.loggers import CSVRunLogger

    outside = tmp_path / "outside.txt"
    outside.write_text("the user's own file\n")
    (tmp_path / "run" / "csv").mkdir(parents=True)
    planted = tmp_path / "run" / "csv" / name
    os.mkfifo(planted) if kind == "fifo" else planted.symlink_to(outside) if kind == "link" else os.link(outside, planted)
    with pytest.raises(UsageError) as refused:
        CSVRunLogger(save_dir=str(tmp_path / "run"), name="csv", version="", purge_step=4)
    assert str(refused.value).startswith(f"{planted} is ")
    assert outside.read_text() == "the user's own file\n"


def test_a_resume_that_trains_on_of_a_run_whose_event_file_is_a_fifo_is_refused_without_waiting(tmp_path, data_root):
    """A run's end reads its event files (a resumed run keeps the HParams record it began with): a FIFO in one's
    place kept the resume waiting for ever, deaf to SIGTERM. It is one line, and the checkpoints stay."""
    run = tmp_path / "run"
    assert train_here(*QUICK, f"hydra.run.dir={run}").returncode == 0
    [events] = run.glob("events.out.tfevents.*")
    events.unlink()
    os.mkfifo(events)
    result = train_here(QUICK[0], "ckpt_path=last", "max_epochs=2", f"hydra.run.dir={run}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {run}: one of its event files (events.out.tfevents.*) is a link or not a regular file; the readers "
        "read only files of the run's own")
    assert (run / "checkpoints" / "last.ckpt").is_file()


@settings(max_examples=400, deadline=None)
@given(key=KEYS, value=st.one_of(VALUES, st.from_regex(r"[ -~]{1,12}", fullmatch=True),
                                 st.lists(st.sampled_from(["1", "x", "0.5", "'a b'", "true"]), min_size=1, max_size=3)
                                 .map(lambda items: "[" + ",".join(items) + "]")))
def test_what_a_record_hands_to_hydra_reads_back_as_the_value_it_was_checked_as(tmp_path_factory, key, value):
    """A kept record line reaches Hydra only where Hydra reads it as exactly the typed value the record's own reader
    read: a number, a boolean, null, a word, quoted text or a list of them, never an interpolation or a function."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = tmp_path_factory.mktemp("typed") / "overrides.yaml"
    try:
        [line] = records.settings([f"{key}={value}"], path) or [None]
    except (UsageError, ValueError):
        return
    if line is None or line.partition("=")[0] in config.GROUPS:
        return
    [override] = OverridesParser.create().parse_overrides([line])
    text = line.partition("=")[2]
    typed = records.items(text[1:-1]) if text.startswith("[") else records.scalar(text)
    read = override.value()
    assert repr(read) == repr(typed) and type(read) is type(typed)  # repr: nan is nan, -0.0 is not 0.0
    assert "${" not in str(read)


@settings(max_examples=300, deadline=None)
@given(key=KEYS, swept=st.lists(st.one_of(VALUES, st.from_regex(r"[ -~]{1,8}", fullmatch=True)), min_size=2,
                                 max_size=4))
def test_a_sweeps_recorded_values_read_back_as_the_values_they_were_checked_as(tmp_path_factory, key, swept):
    """The same for a sweep's record: each swept value Hydra reads is the typed value the record's reader read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = tmp_path_factory.mktemp("swept") / "multirun.yaml"
    try:
        [line] = records.settings([f"{key}={','.join(swept)}"], path, sweep=True) or [None]
    except (UsageError, ValueError):
        return
    if line is None or line.partition("=")[0] in config.GROUPS:
        return
    [override] = OverridesParser.create().parse_overrides([line])
    if not override.is_sweep_override():  # `','`: one quoted text, to Hydra as to the records' reader
        assert repr(override.value()) == repr(records.value_of(line.partition("=")[2], sweep=True))
        return
    typed = records.items(line.partition("=")[2])
    read = [getattr(v, "text", v) for v in override.sweep_iterator()]  # a QuotedString is its text in a job
    assert [repr(v) for v in read] == [repr(v) for v in typed]

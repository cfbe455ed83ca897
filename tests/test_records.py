"""A run folder's records are data: whoever can write a folder cannot run code in the account of whoever resumes,
scores, reports or predicts from it.

Each crafted folder below carries a harmless payload that would leave a mark if it ran: `builtins.open` on a marker
file in write mode (created when it is built), or a `${claim_dir:...}` resolver (which creates the folder it names).
Every entry point that reads a run folder refuses the payload in one line naming the file and the key, or leaves
the record unread, and the mark never appears. One command line per entry point is here, where the exit status and the
files left are the point, each through the command's own entry in the test process (`command_here`, `call_main`);
tests/test_crafted_folders.py holds every kind of payload.
"""

from pathlib import Path

import yaml

from src.report import main as report_main
from src.scaling import timed as timing
from src.scaling.predict import main as scaling_main
from src.scaling.timed import Timed
from src.strategies.ddp import HOOKS
from tests.helpers import DATA_ROOT, QUICK, Run, call_main, command_here, train_here
from tests.test_scaling import write_ddp_run

OPEN_MARKER = ["._target_=builtins.open", ".file={marker}", ".mode=w"]


def payload(key: str, marker: Path, add: bool = False) -> list[str]:
    """Override lines that build `builtins.open(marker, "w")` at `key`."""
    return [("+" if add or not line.startswith("._target_") else "") + key + line.format(marker=marker) for line in OPEN_MARKER]


def edit(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))


def assert_refused(result, path: Path, key: str, *marks: Path) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}: {key}=") and "is not allowed in a run's records" in last, result.stderr
    assert not any(mark.exists() for mark in marks)


def resume(run_dir: Path, *args: str):
    """`python -m src.train ... ckpt_path=last` of one process, in this process."""
    return train_here(*QUICK, *args, "ckpt_path=last", f"hydra.run.dir={run_dir}")


def test_a_target_in_the_recorded_overrides_is_refused_and_never_built(tmp_path, quick_run: Run):
    run_dir, marker = quick_run.copy(tmp_path), tmp_path / "marker"
    overrides = run_dir / ".hydra" / "overrides.yaml"
    edit(overrides, lambda lines: lines.extend(payload("model.loss", marker)))
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert_refused(resume(run_dir, "max_epochs=2"), overrides, "model.loss._target_", marker)
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before, "nothing is rewritten"


def test_hydra_settings_in_the_records_are_never_taken(tmp_path, quick_run: Run):
    """A Hydra callback and another run folder recorded in `.hydra/hydra.yaml` (or in the overrides) are not taken: the
    resume writes only into the folder typed, and no callback of the record runs."""
    run_dir, marker, elsewhere = quick_run.copy(tmp_path), tmp_path / "marker", tmp_path / "elsewhere"
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    edit(hydra_yaml, lambda data: data["hydra"]["overrides"]["hydra"].extend(
        [*payload("hydra.callbacks.evil", marker, add=True), f"hydra.run.dir={elsewhere}"]))
    result = resume(run_dir, "max_epochs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists() and not elsewhere.exists()
    assert f"-> {run_dir}" in result.stdout


def test_a_target_in_a_sweeps_record_is_refused_and_never_built(tmp_path, data_root):
    sweep, marker = tmp_path / "sweep", tmp_path / "marker"
    sweep.mkdir()
    record = {"hydra": {"overrides": {"hydra": [], "task": ["seed=1,2", *payload("callbacks.evil", marker, add=True)]}}}
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(record))
    result = train_here(*QUICK, "-m", "seed=1,2", f"hydra.sweep.dir={sweep}", "ckpt_path=auto")  # the sequential launcher
    assert_refused(result, sweep / "multirun.yaml", "callbacks.evil._target_", marker)
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


def test_eval_refuses_a_config_yaml_that_builds_other_code_or_calls_a_resolver(tmp_path, quick_run: Run):
    run_dir, marker, made = quick_run.copy(tmp_path), tmp_path / "marker", tmp_path / "made_by_a_resolver"
    config = run_dir / "config.yaml"
    score = ["trainer.enable_progress_bar=false", f"data.root={DATA_ROOT}", f"ckpt_path={run_dir}",
             f"hydra.run.dir={tmp_path / 'eval'}"]

    edit(config, lambda data: data["model"]["net"].update(pool=f"${{claim_dir:{made}}}"))
    assert_refused(command_here("src.eval", *score), config, "model.net.pool", made)

    edit(config, lambda data: data["model"]["net"].update(pool="avg", _target_="builtins.open", file=str(marker), mode="w"))
    result = command_here("src.eval", *score)
    assert result.returncode == 2 and "builds the model with model.net._target_=builtins.open" in result.stderr
    assert not marker.exists()

    edit(config, lambda data: data.update(model_name="lenet,resnet18"))
    result = command_here("src.eval", *score)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {config}: model_name=lenet,resnet18 is not allowed in a run's records; it must name an option of the model "
        "group; give the model with model=<option>")
    assert not (tmp_path / "eval").exists() and not marker.exists()


def test_report_and_scaling_leave_a_crafted_run_out_and_never_build_or_resolve_it(tmp_path, monkeypatch):
    root, marker, made = tmp_path / "outputs", tmp_path / "marker", tmp_path / "made_by_a_resolver"
    good, crafted, resolving = (write_ddp_run(root / name) for name in ("good", "crafted", "resolving"))
    edit(crafted / "config.yaml", lambda data: data["model"].update(
        net={"_target_": "builtins.open", "file": str(marker), "mode": "w"}))
    edit(resolving / "config.yaml", lambda data: data.update(strategy_name=f"${{claim_dir:{made}}}"))
    (resolving / ".hydra").mkdir()
    (resolving / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"name": f"${{claim_dir:{made}}}"}}}))

    result = call_main(report_main, str(root))
    assert result.returncode == 0, result.stderr
    assert f"warning: {resolving}: left out ({resolving / 'config.yaml'}: strategy_name=" in result.stderr
    assert "| good |" in (root / "report.md").read_text()

    timed = []  # the models src.scaling would time, on processes of their own: what it read of each run's records
    figures = Timed("cpu", overhead_share=0.25, skew=0.01, hooks=dict.fromkeys(HOOKS, 0.002), reducer=dict.fromkeys(HOOKS, 0.003))
    monkeypatch.setattr(timing, "time_run", lambda net, *args, **kwargs: timed.append(net) or figures)
    result = call_main(scaling_main, str(root))
    assert result.returncode == 0, result.stderr
    assert timed and all(net == {"_target_": "src.models.lenet.LeNet"} for net in timed)
    assert (f"warning: {crafted}: left out ({crafted / 'config.yaml'}: model.net._target_=builtins.open is not allowed "
            "in a run's records") in result.stderr
    assert not marker.exists() and not made.exists()

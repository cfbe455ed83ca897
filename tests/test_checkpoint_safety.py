"""A checkpoint file never runs code: every read unpickles tensors and plain values only.

A malicious checkpoint below is a real `torch.save` zip whose pickle, loaded with `weights_only=False`,
creates a marker file. Given to a run, a resume or `src.eval`, it ends in one `error:` line, exit
status 2, and the marker never appears, also with `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`, which turns
torch's own default (and so Lightning's) unsafe. A checkpoint a run writes still resumes and evaluates.
"""

import json
import os
import pathlib
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hydra.utils import instantiate
from lightning import LightningModule, Trainer
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from src.checkpoints import AtomicCheckpointIO, check_checkpoint, newest, open_checkpoint, read_checkpoint, resolve_ckpt_path
from src.errors import UsageError
from src.eval import as_trained
from src.loggers import purge_step
from src.models.module import Classifier
from tests.helpers import DATA_ROOT, QUICK, command_here, train_here
from tests.helpers import composed
from tests.sandbox import sandbox

UNSAFE = "is not a safe checkpoint: it holds objects that cannot be loaded safely"


class Touch:
    """Unpickled without restriction, creates `marker`: what any code a pickle carries could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def malicious_checkpoint(path: Path, marker: Path) -> Path:
    """A LeNet checkpoint in every other respect: right weights' names and shapes, epoch and step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    module = Classifier(instantiate(composed("model=lenet").model.net))
    torch.save({"state_dict": module.state_dict(), "epoch": 0, "global_step": 4, "callbacks": {"RunState": Touch(marker)}}, path)
    return path


@pytest.fixture
def unsafe_default(monkeypatch):
    """torch.load's own default made unsafe, as a user's environment may have it."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def test_the_malicious_checkpoint_runs_code_when_loaded_without_weights_only(tmp_path):
    marker = tmp_path / "marker"
    torch.load(malicious_checkpoint(tmp_path / "bad.ckpt", marker), weights_only=False)
    assert marker.is_file(), "the payload works: the tests below show that it is never run"


def test_every_read_of_a_checkpoint_refuses_it_without_running_it(tmp_path, unsafe_default):
    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", marker)
    lenet = Classifier(instantiate(composed("model=lenet").model.net))
    with pytest.raises(pickle.UnpicklingError):
        read_checkpoint(bad)
    assert open_checkpoint(bad).step == -1 and newest(tmp_path / "run").path == bad
    with pytest.raises(UsageError) as caught:
        check_checkpoint(open_checkpoint(bad), "last", lenet, "lenet")
    assert str(caught.value).startswith(f"ckpt_path=last is not allowed; {bad} {UNSAFE} (getattr)")
    with pytest.raises(pickle.UnpicklingError):
        AtomicCheckpointIO().load_checkpoint(bad, weights_only=False)
    assert not marker.exists()


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightnings_own_load_through_the_runs_checkpoint_io_is_safe(tmp_path, unsafe_default):
    """What Lightning reads itself (a resume, a SLURM requeue's `hpc_ckpt_*`) goes through the run's checkpoint IO."""
    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "bad.ckpt", marker)
    trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path)
    with pytest.raises(pickle.UnpicklingError):
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.ones(4, 2))), ckpt_path=str(bad))
    assert not marker.exists()


def test_a_save_that_fails_midway_leaves_the_last_checkpoint_and_no_partial_copy(tmp_path, monkeypatch):
    """A full disk during a save keeps the checkpoint there was and takes its half-written successor away."""
    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"epoch": 1}, path)

    def disk_full(checkpoint, file):
        file.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        AtomicCheckpointIO().save_checkpoint({"epoch": 2}, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    assert read_checkpoint(path)["epoch"] == 1


def refused_in_one_line(result, message: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], lines[-1]
    assert "Traceback" not in result.stderr and len([line for line in lines if line.startswith("error: ")]) == 1


def test_train_refuses_a_malicious_checkpoint(tmp_path, data_root, unsafe_default):
    marker, run_dir = tmp_path / "marker", tmp_path / "run"
    bad = malicious_checkpoint(tmp_path / "given" / "bad.ckpt", marker)
    result = train_here(*QUICK, f"ckpt_path={bad}", f"hydra.run.dir={run_dir}")
    refused_in_one_line(result, f"error: ckpt_path={bad} is not allowed; {bad} {UNSAFE} (getattr)")
    assert not marker.exists() and not run_dir.exists()


def test_resume_refuses_a_malicious_last_checkpoint_and_keeps_the_folder(tmp_path, quick_run, unsafe_default):
    marker, run_dir = tmp_path / "marker", quick_run.copy(tmp_path)
    for old in (run_dir / "checkpoints").iterdir():
        old.unlink()
    bad = malicious_checkpoint(run_dir / "checkpoints" / "last.ckpt", marker)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    result = train_here(*QUICK, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    refused_in_one_line(result, f"error: ckpt_path=last is not allowed; {bad} {UNSAFE} (getattr)")
    assert not marker.exists()
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_eval_refuses_a_malicious_checkpoint(tmp_path, data_root, unsafe_default):
    marker, eval_dir = tmp_path / "marker", tmp_path / "eval"
    bad = malicious_checkpoint(tmp_path / "given" / "bad.ckpt", marker)
    result = command_here("src.eval", f"data.root={DATA_ROOT}", "debug=quick", f"ckpt_path={bad}", f"hydra.run.dir={eval_dir}")
    refused_in_one_line(result, f"error: ckpt_path={bad} is not allowed; {bad} {UNSAFE} (getattr)")
    assert not marker.exists() and not eval_dir.exists()


def test_eval_refuses_a_run_config_that_builds_the_model_with_another_function(tmp_path):
    """`src.eval ckpt_path=<run folder>` builds the model its `config.yaml` describes; a `_target_` there is code."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = composed("model=lenet")
    saved = OmegaConf.create({"model_name": "lenet", "model": OmegaConf.to_container(cfg.model, resolve=True)})
    saved.model.net = {"_target_": "pathlib.Path.touch", "self": str(tmp_path / "marker")}
    OmegaConf.save(saved, run_dir / "config.yaml")
    cfg.ckpt_path = str(run_dir)
    with pytest.raises(UsageError) as caught:
        as_trained(cfg, [], "model")
    assert str(caught.value).startswith(
        f"ckpt_path={run_dir} is not allowed; {run_dir / 'config.yaml'} builds the model with "
        "model.net._target_=pathlib.Path.touch where model=lenet has src.models.lenet.LeNet")
    saved.model.net = OmegaConf.to_container(cfg.model.net, resolve=True)
    saved.model.loss.label_smoothing = 0.1  # a value, not a function: the run's own
    OmegaConf.save(saved, run_dir / "config.yaml")
    assert as_trained(cfg, [], "model").loss.label_smoothing == 0.1


@pytest.mark.slow
def test_a_checkpoint_written_by_a_run_resumes_and_evaluates(tmp_path, data_root):
    """Everything a run saves (RunState's generators, val/acc_best, loops, momentum, hyper-parameters) is plain. The
    commands run in this process; the file is what is read back."""
    run_dir = tmp_path / "run"
    args = [*QUICK, "optim.momentum=0.9", "checkpoint.every_n_train_steps=2"]
    first = train_here(*args, f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        state = read_checkpoint(path)
        assert "RunState" in state["callbacks"] and state["optimizer_states"][0]["state"], path.name
        assert "val_acc_best.max_value" in state["state_dict"] and state["loops"]["fit_loop"] and state["hyper_parameters"]
    resumed = train_here(*args, "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints'}" in resumed.stdout
    assert read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["epoch"] == 1
    scored = command_here("src.eval", f"data.root={DATA_ROOT}", "debug=quick", f"ckpt_path={run_dir}",
                          f"hydra.run.dir={tmp_path / 'eval'}")
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert len([line for line in scored.stdout.splitlines() if "test/acc=" in line]) == 1


def test_a_checkpoint_to_resume_is_read_once_before_the_run(tmp_path, monkeypatch):
    """Which file is newest, whether it is safe and of this model, where TensorBoard takes up: one read."""
    run_dir = tmp_path / "run"
    lenet = Classifier(instantiate(composed("model=lenet").model.net))
    last = run_dir / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"state_dict": lenet.state_dict(), "epoch": 0, "global_step": 4}, last)
    reads: list[Path] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *args, **kwargs: reads.append(Path(path)) or real_load(path, *args, **kwargs))
    saved = resolve_ckpt_path("last", run_dir)
    check_checkpoint(saved, "last", lenet, "lenet")
    assert purge_step(saved, run_dir) == 4
    assert reads == [last]


def test_lightnings_load_from_checkpoint_builds_the_runs_model_from_the_file_alone(quick_run):
    """`Classifier.load_from_checkpoint(path)`, the first thing a Lightning user types, needs no config."""
    path = quick_run.dir / "checkpoints" / "last.ckpt"
    module = Classifier.load_from_checkpoint(path, map_location="cpu")
    saved = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    assert module.state_dict().keys() == saved.keys()
    assert all(torch.equal(module.state_dict()[name], tensor) for name, tensor in saved.items())
    assert module.eval()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_load_from_checkpoint_builds_no_class_that_conf_does_not_name(tmp_path, quick_run):
    marker = tmp_path / "made_by_the_checkpoint"
    checkpoint = torch.load(quick_run.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["net"] = {"_target_": "os.makedirs", "name": str(marker)}
    torch.save(checkpoint, tmp_path / "crafted.ckpt")
    with pytest.raises(UsageError, match="net._target_"):
        Classifier.load_from_checkpoint(tmp_path / "crafted.ckpt", map_location="cpu")
    assert not marker.exists()


def test_a_new_run_from_a_finished_runs_checkpoint_with_nothing_left_to_train_is_refused_in_one_line(quick_run,
                                                                                                     tmp_path):
    """It made a folder, trained nothing, tested the old folder's best file and printed the old run's epoch time."""
    last = quick_run.dir / "checkpoints" / "last.ckpt"
    result = train_here(*QUICK, f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'new'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: ckpt_path={last}: it holds 1 finished epoch (4 steps), and max_epochs=1 leaves nothing to train; "
        f"raise max_epochs, or score it with src.eval ckpt_path={last}"]
    assert not (tmp_path / "new").exists()


def test_a_new_run_from_another_folders_checkpoint_tests_and_reports_only_what_it_trained(quick_run, tmp_path):
    """Lightning keeps the old folder's best path and the callbacks' figures: the run tests its own best file, and
    its epoch time, hardware use and loss verdict are those of the epoch it trained."""
    from tests.helpers import scalars

    new = tmp_path / "new"
    result = train_here(*QUICK, "max_epochs=2", f"ckpt_path={quick_run.dir / 'checkpoints' / 'last.ckpt'}",
                        f"hydra.run.dir={new}")
    assert result.returncode == 0, result.stderr[-3000:]
    # the old folder's best is best-epoch1.ckpt; this run's own is of its second epoch, best-epoch2.ckpt
    assert "tested best-epoch2.ckpt" in result.stdout and (new / "checkpoints" / "best-epoch2.ckpt").is_file()
    recorded = json.loads((new / "result.json").read_text())
    [own_epoch] = scalars(new)["time/epoch_s"]  # the one epoch this run trained
    assert recorded["metrics"]["time/epoch_s"] == pytest.approx(own_epoch)
    assert "in 4 steps" in result.stdout  # the loss verdict over its own 4 steps, not the old run's too


def forge_callback_state(checkpoint: Path, callback: str, **state: object) -> None:
    """A checkpoint callback's recorded state changed, still plain tensors and strings (a weights-only save)."""
    saved = read_checkpoint(checkpoint)
    [key] = [key for key in saved["callbacks"] if key.startswith(callback + "{")]
    saved["callbacks"][key].update(state)
    torch.save(saved, checkpoint)


def test_a_resume_deletes_no_file_that_a_checkpoints_callback_state_names(tmp_path, quick_run):
    """Lightning removes a "worse" best model and the previous file by the paths in its restored state, and checks
    containment with `..` kept: forged paths outside the folder, of another callback and of a URL delete nothing."""
    run_dir = quick_run.copy(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    outside = [tmp_path / "elsewhere" / name for name in ("best.txt", "last.txt")]
    outside[0].parent.mkdir()
    for file in outside:
        file.write_text("kept")
    recorded = next(state["dirpath"] for key, state in read_checkpoint(last)["callbacks"].items()
                    if key.startswith("BestCheckpoint"))
    best, previous = (f"{recorded}/../../elsewhere/{file.name}" for file in outside)
    worst = torch.tensor(0.0)  # any val/acc is better: the listed best model is the one to delete
    forge_callback_state(last, "BestCheckpoint", best_k_models={best: worst}, kth_best_model_path=best,
                         kth_value=worst, best_model_path=best, best_model_score=worst)
    forge_callback_state(last, "ModelCheckpoint", best_model_path=previous, last_model_path=previous,
                         best_k_models={previous: None}, kth_best_model_path=previous)
    step = run_dir / "checkpoints" / "step.ckpt"  # a file of another callback, listed as this one's best
    step.write_bytes(b"kept")
    with sandbox(run_dir) as box:
        result = train_here(*QUICK, "ckpt_path=last", "max_epochs=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [file.read_text() for file in outside] == ["kept", "kept"] and box.outside == []
    assert (run_dir / "checkpoints" / "best-epoch2.ckpt").is_file()  # the run's own best is saved as ever


@settings(max_examples=300, deadline=None)
@given(paths=st.lists(st.one_of(
    st.text(alphabet="/.\\ab-:{}\0", max_size=40),
    st.builds(lambda tail: f"/run/checkpoints/{tail}", st.text(alphabet="/.ab-ckpt:\0", max_size=30)),
    st.sampled_from(["/run/checkpoints/best-epoch1.ckpt", "/run/checkpoints/../x/best-epoch1.ckpt",
                     "memory://run/checkpoints/best-epoch1.ckpt", "/run/checkpoints/last.ckpt"])), max_size=4))
def test_a_checkpoint_callback_keeps_only_paths_of_its_own_files_in_its_folder(paths):
    from src.checkpoints import own_paths

    state = {"dirpath": "/run/checkpoints", "best_k_models": {p: 0.5 for p in paths}, "best_model_path": paths[0]
             if paths else "", "kth_best_model_path": paths[-1] if paths else "", "last_model_path": ""}
    kept = own_paths(state, "/run/checkpoints", "best-epoch{epoch}", ".ckpt")
    for path in [*kept["best_k_models"], kept["best_model_path"], kept["kth_best_model_path"]]:
        if path:
            folder, name = os.path.split(path)
            assert folder == "/run/checkpoints" and name.startswith("best-epoch") and name.endswith(".ckpt")
            assert os.path.normpath(path) == path and "\0" not in path


def test_a_fifo_where_a_checkpoint_is_read_is_one_line_not_a_hang(tmp_path, quick_run):
    """A FIFO at `best-*.ckpt` made src.eval wait for a writer forever."""
    run_dir = quick_run.copy(tmp_path)
    best = next((run_dir / "checkpoints").glob("best-*.ckpt"))
    best.unlink()
    os.mkfifo(best)
    result = command_here("src.eval", f"data.root={DATA_ROOT}", f"ckpt_path={run_dir}",
                          f"hydra.run.dir={tmp_path / 'eval'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: ckpt_path={run_dir} is not allowed; {best} is not a checkpoint file (not a regular file); beside it: "
        "last.ckpt, which ckpt_path=<file> takes"]


def test_an_optimizer_state_of_another_shape_is_one_line(tmp_path, quick_run):
    """A last.ckpt whose momentum buffer had another shape than its parameter: the resume ended in torch's traceback
    at its first step."""
    run_dir = quick_run.copy(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    saved = read_checkpoint(last)
    [state] = saved["optimizer_states"]
    index, values = next((i, v) for i, v in state["state"].items() if "momentum_buffer" in v)
    values["momentum_buffer"] = torch.zeros(3, 3)
    torch.save(saved, last)
    result = train_here(*QUICK, "ckpt_path=last", "max_epochs=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: ckpt_path=last is not allowed; {last}'s optimizer state momentum_buffer of "
                           f"parameter {index} is shaped (3, 3), the parameter (")
    assert line.endswith(": it is damaged or of another model; resume from another checkpoint")

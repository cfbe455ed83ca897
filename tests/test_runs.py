"""`src.runs`: how a run folder is found and read, on folders written here with known contents."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter

from src.errors import UsageError
from src.runs import RunFolder, find_run_dirs, median, read_runs, resolved_config, resolved_config_file


def write_run(folder: Path, config: dict, scalars: dict[str, list[float]], choices: dict | None = None) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    if choices is not None:
        OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": choices}}}), folder / ".hydra" / "hydra.yaml")
    with SummaryWriter(log_dir=str(folder)) as writer:
        for tag, values in scalars.items():
            for step, value in enumerate(values):
                writer.add_scalar(tag, value, step * 10)
    return folder


def test_values_come_from_the_resolved_config_and_hydra_yaml_is_plain_data(tmp_path):
    run = write_run(tmp_path / "run", {"model_name": "resnet18", "devices": 2}, {"x": [1.0]},
                    choices={"model": "resnet18"})
    folder = RunFolder(run, tmp_path)
    assert folder.value("model_name") == "resnet18" and folder.value("devices") == 2
    assert folder.hydra == {"runtime": {"choices": {"model": "resnet18"}}} and not folder.evaluation
    assert folder.name == "run" and RunFolder(run, run).name == "run"


def test_a_resolver_in_a_record_is_refused_and_never_run(tmp_path):
    made = tmp_path / "made_by_a_resolver"
    run = write_run(tmp_path / "run", {"model_name": f"${{claim_dir:{made}}}"}, {"x": [1.0]})
    with pytest.raises(UsageError, match=r"config.yaml: model_name=\$\{claim_dir:.*a resolver or escape could act"):
        RunFolder(run, tmp_path)
    assert not made.exists()


def test_scalars_come_from_the_first_tag_logged(tmp_path):
    run = RunFolder(write_run(tmp_path / "run", {}, {"a_epoch": [1.0, 3.0], "b": [5.0]}), tmp_path)
    assert run.scalars("a", "a_epoch") == [(0, 1.0), (10, 3.0)]
    assert run.values("b", "a_epoch") == [5.0]
    assert run.scalars("missing") == [] and run.hparams() == {}
    assert median(run.values("a_epoch")) == 2.0 and median([]) is None


def test_a_run_logged_before_the_rename_gives_its_transfer_scalars_under_xfer(tmp_path):
    run = RunFolder(write_run(tmp_path / "run", {}, {"comm/bytes_per_step": [8.0], "xfer/hook_ms": [2.0]}), tmp_path)
    assert run.values("xfer/bytes_per_step") == [8.0] and run.values("xfer/hook_ms") == [2.0]
    assert run.values("xfer/overlap_ms") == []


def test_only_folders_with_a_config_and_events_are_runs(tmp_path):
    write_run(tmp_path / "deep" / "run", {}, {"x": [1.0]})
    (tmp_path / "config_only").mkdir(parents=True)
    (tmp_path / "config_only" / "config.yaml").write_text("devices: 1\n")
    assert find_run_dirs(tmp_path) == [tmp_path / "deep" / "run"]
    assert read_runs(tmp_path, lambda run: run.name) == ["deep/run"]
    assert read_runs(tmp_path, lambda run: None) == []


def test_a_folder_that_cannot_be_read_is_left_out_with_a_line_naming_it(tmp_path, capsys):
    run = write_run(tmp_path / "run", {}, {"x": [1.0]})
    good = write_run(tmp_path / "good", {}, {"x": [1.0]})
    (run / "config.yaml").write_text("devices: [\n")
    assert read_runs(tmp_path, lambda run: run.name) == ["good"]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {run}: left out ({run / 'config.yaml'}: cannot be read as a record (while parsing")
    (good / "config.yaml").write_text("[1, 2]\n")
    with pytest.raises(UsageError, match=f"{good}: left out .*holds no config"):
        read_runs(tmp_path, lambda run: run.name)
    with pytest.raises(UsageError, match="no such folder"):
        read_runs(tmp_path / "nowhere", lambda run: run.name)
    with pytest.raises(UsageError, match="no run folders"):
        read_runs(run / ".hydra", lambda run: run.name)


def test_a_checkpoint_and_its_run_folder_lead_to_the_same_resolved_config(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    OmegaConf.save(OmegaConf.create({"model_name": "lenet"}), tmp_path / "config.yaml")
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert resolved_config_file(checkpoint) == resolved_config_file(tmp_path) == tmp_path / "config.yaml"
    assert resolved_config(checkpoint).model_name == "lenet"
    assert resolved_config(tmp_path / "elsewhere" / "checkpoints" / "x.ckpt") is None and resolved_config(None) is None
